"""GPTQ's NumPy column loop (issue 32) against the torch loop it replaces, bit for bit.

``ColumnRounding`` runs a block's columns through :func:`~quark_brevitas.algorithms.column_kernel.round_columns`
when the grid is Brevitas's plain one and everything is float32, else through torch (the loop GPTQ ran before).
Both paths are run here on the same weights, Hessians and Brevitas grids (symmetric and asymmetric, static and
dynamic groups, act-order permutations, blocks that do not divide the width, Qronos's start at column 1), and
every output is compared as raw bits (``view(int32)``: a zero's sign counts too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import INT4_G32, UINT4_G32  # noqa: E402

from quark_brevitas.algorithms import gptq  # noqa: E402
from quark_brevitas.algorithms.gptq import ColumnRounding, gptq_columns  # noqa: E402
from quark_brevitas.algorithms.qronos import qronos_columns  # noqa: E402
from quark_brevitas.brevitas_adapter import weight_grid  # noqa: E402
from quark_brevitas.config import QuantizationSpec  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

INT3_G32 = QuantizationSpec(bit_width=3, qscheme=QSchemeType.per_group, group_size=32)


def _layer(spec: QuantizationSpec, features: int, outputs: int, seed: int):
    import brevitas.nn as qnn

    from quark_brevitas.quantizers import build_quantizer

    torch.manual_seed(seed)
    layer = qnn.QuantLinear(features, outputs, bias=False, weight_quant=build_quantizer(spec, "weight"))
    with torch.no_grad():  # a few outlier columns, as LLM weights have
        layer.weight[:, ::17] *= 4
    return layer


def _hessian(features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, features, generator=generator)
    inputs = torch.randn(512, 16, generator=generator) @ basis + 0.1 * torch.randn(512, features, generator=generator)
    inputs[:, 5] = 0  # a dead input: its diagonal is set to 1 and its weight column to 0
    return inputs.t() @ inputs / len(inputs)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def _both_paths(monkeypatch: pytest.MonkeyPatch, run) -> tuple:
    fast = run()
    with monkeypatch.context() as patched:
        patched.setattr(ColumnRounding, "_numpy_loop", lambda self, factor: False)
        slow = run()
    return fast, slow


@pytest.mark.parametrize("spec", [INT4_G32, UINT4_G32, dataclasses.replace(INT4_G32, narrow_range=True), INT3_G32],
                         ids=["int4", "uint4", "int4-narrow", "int3"])
@pytest.mark.parametrize(("act_order", "static_groups", "block_size"),
                         [(False, False, 128), (True, False, 128), (False, True, 40), (True, True, 7)])
def test_numpy_column_loop_is_the_torch_loop_bit_for_bit(monkeypatch, spec, act_order, static_groups,
                                                         block_size) -> None:
    layer = _layer(spec, 96, 48, seed=1)
    weight, hessian = layer.weight.detach().clone(), _hessian(96, seed=2)
    calls = []
    original = gptq.round_columns

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gptq, "round_columns", counting)

    def run():
        return gptq_columns(weight, hessian, lambda tensor: weight_grid(layer, tensor), damp_percent=0.01,
                            act_order=act_order, group_size=32, static_groups=static_groups, block_size=block_size)

    fast, slow = _both_paths(monkeypatch, run)
    assert calls, "the NumPy loop did not run"
    assert torch.equal(_bits(fast.quantized), _bits(slow.quantized))
    assert torch.equal(_bits(fast.scale_source), _bits(slow.scale_source))
    assert fast.loss == slow.loss and fast.on_grid == slow.on_grid
    assert not torch.equal(fast.quantized, weight_grid(layer, weight).quantize(weight))  # GPTQ moved something


def test_numpy_column_loop_serves_qronos_from_column_one(monkeypatch) -> None:
    layer = _layer(INT3_G32, 96, 40, seed=3)
    weight, hessian = layer.weight.detach().clone(), _hessian(96, seed=4)
    cross = hessian + 0.01 * _hessian(96, seed=5)

    def run():
        return qronos_columns(weight, hessian, cross, lambda tensor: weight_grid(layer, tensor), alpha=1e-3,
                              beta=1e4, act_order=True, group_size=32, static_groups=False, block_size=128)

    fast, slow = _both_paths(monkeypatch, run)
    assert torch.equal(_bits(fast.quantized), _bits(slow.quantized))
    assert fast.loss == slow.loss
