"""GPTQConfig block by block computes each layer about once per batch (issue 32), with the same weights.

- A Hessian pass stops at the group's first call when the group reads one input (q/k/v, gate/up): one product
  ``X^T X`` per input, credited to every layer of the group.
- Layers rounded in an earlier pass return what they computed then (``brevitas_adapter.memo``), and the block
  engine's pass for the block's outputs takes over GPTQ's memo (``outputs_handed_over``): only the last group
  (the MLP's down projection) is computed again there.
- None of this changes a weight: the same codes with the memo switched off (budget 0), and the codes snapshot
  (tests/algorithms/test_llm_codes_snapshot.py) still holds.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.forward_calls import count_forward_calls  # noqa: E402
from helpers.llm_models import tiny_llama, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import (  # noqa: E402
    QuantLayer,
    discard_handed_over_outputs,
    layer_output_budget,
    layer_outputs_remembered,
    outputs_handed_over,
)
from quark_brevitas.config import (  # noqa: E402
    Config,
    GPTQConfig,
    QronosConfig,
    QuantizationConfig,
    QuantizationSpec,
)
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

INT4_G32 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)
BATCHES = 8


def _quantize(budget: int | None = None, algorithm: str = "gptq") -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """GPTQConfig's (or QronosConfig's) weights on the tiny 2-block Llama and how often each quantized layer of
    the model really computed (its class's ``forward``, which a remembered output skips)."""
    torch.set_num_threads(1)
    model = tiny_llama(2)
    algo = GPTQConfig(sym=True, group_size=32) if algorithm == "gptq" else QronosConfig()
    config = Config(QuantizationConfig(weight=INT4_G32), pre_quant_opt_config=[], algo_config=[algo],
                    exclude=["lm_head"])
    runs: dict[str, int] = {}
    patched: dict[type, object] = {}

    def counting(original: object) -> object:
        def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
            name = getattr(self, "_counted_name", None)
            if name is not None:
                runs[name] = runs.get(name, 0) + 1
            return original(self, *args, **kwargs)  # type: ignore[operator]

        return forward

    from quark_brevitas.algorithms import gptq, qronos

    handler = gptq.GPTQConfigHandler if algorithm == "gptq" else qronos.QronosConfigHandler
    original_apply = handler.apply_block

    def apply_block(self: object, algo: object, block: nn.Module, data: object, name: str) -> nn.Module:
        for layer_name, module in block.named_modules():
            if isinstance(module, QuantLayer) and type(module) not in patched:
                patched[type(module)] = type(module).forward
                type(module).forward = counting(type(module).forward)  # type: ignore[method-assign]
            if isinstance(module, QuantLayer) and not hasattr(module, "_counted_name"):
                object.__setattr__(module, "_counted_name", f"{name}.{layer_name}")
        return original_apply(self, algo, block, data, name)  # type: ignore[arg-type]

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(handler, "apply_block", apply_block)
            context = layer_output_budget(budget) if budget is not None else contextlib.nullcontext()
            with context:
                quant = ModelQuantizer(config).quantize_model(model, token_batches(BATCHES))
    finally:
        for cls, forward in patched.items():
            cls.forward = forward  # type: ignore[method-assign]
    weights = {name: p.detach().clone() for name, p in quant.named_parameters() if name.endswith("weight")}
    return weights, runs


@pytest.fixture(scope="module")
def remembered() -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    return _quantize()


def test_qronos_memos_change_no_weight() -> None:
    """QronosConfig remembers its float twin's outputs (its layers never change) and the block's, as GPTQConfig:
    its layers compute less often, and the weights equal those without the memos, bit for bit."""
    weights, runs = _quantize(algorithm="qronos")
    plain_weights, plain_runs = _quantize(budget=0, algorithm="qronos")
    assert sum(plain_runs.values()) > 1.5 * sum(runs.values())
    assert sorted(plain_weights) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(plain_weights[name], value), name


def test_each_layer_computes_about_once_per_batch(remembered: tuple[dict[str, torch.Tensor], dict[str, int]]) -> None:
    """Four Hessian passes and the outputs' pass per block: the first batch of a pass runs the whole block (the
    group is not known yet), every later batch computes only the layers that changed since the last pass."""
    _, runs = remembered
    assert runs, "no quantized layer was counted"
    for name, count in runs.items():
        assert count <= BATCHES + 4, f"{name} computed {count} times for {BATCHES} batches"


def test_forgetting_nothing_changes_no_weight(remembered: tuple[dict[str, torch.Tensor], dict[str, int]]) -> None:
    """The memo off (budget 0): every layer computed in every pass, the same weights bit for bit."""
    weights, runs = remembered
    plain_weights, plain_runs = _quantize(budget=0)
    assert sum(plain_runs.values()) > 2 * sum(runs.values())
    assert sorted(plain_weights) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(plain_weights[name], value), name


def _layer() -> nn.Module:
    from brevitas.nn import QuantLinear

    torch.manual_seed(0)
    return nn.Sequential(QuantLinear(8, 4, bias=True))


def test_a_handed_over_memo_serves_one_more_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _layer()
    runs = count_forward_calls(monkeypatch, type(model[0]))
    x = torch.randn(5, 8)
    with torch.no_grad(), outputs_handed_over() as handoff:
        with layer_outputs_remembered(model, hand_over=True):
            first = model(x)
        assert "forward" in model[0].__dict__  # still installed: handed over
        with handoff.replaying():
            assert torch.equal(model(x.clone()), first) and runs[0] == 1
        assert "forward" not in model[0].__dict__ and handoff.kept is None
        with torch.no_grad():
            model(x)
        assert runs[0] == 2


def test_a_memo_is_not_handed_over_outside_the_engine_or_past_another_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _layer()
    runs = count_forward_calls(monkeypatch, type(model[0]))
    x = torch.randn(5, 8)
    with torch.no_grad():
        with layer_outputs_remembered(model, hand_over=True):
            model(x)
        assert "forward" not in model[0].__dict__  # no handoff open: dropped as usual
        with outputs_handed_over() as handoff:
            with layer_outputs_remembered(model, hand_over=True):
                model(x)
            discard_handed_over_outputs()  # the pipeline, before the next algorithm
            assert "forward" not in model[0].__dict__
            with handoff.replaying():
                model(x)
        assert runs[0] == 3


def test_a_weight_set_in_place_is_never_served_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight changed through the parameter (``copy_``, as ``set_linear_weight`` does) without ``forget``: the
    memo sees its version counter and computes again."""
    model = _layer()
    runs = count_forward_calls(monkeypatch, type(model[0]))
    x = torch.randn(5, 8)
    with torch.no_grad(), layer_outputs_remembered(model) as memo:
        first = model(x)
        model[0].weight.copy_(model[0].weight * 2)
        memo.new_pass()
        second = model(x)
        assert runs[0] == 2 and not torch.equal(first, second)
