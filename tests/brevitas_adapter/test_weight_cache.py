"""Quantized weights computed once per calibration pass (issue 20): fewer quantizer calls, the same outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import brevitas.nn as qnn
import pytest
import torch
from torch import nn

from quark_brevitas.brevitas_adapter import weight_cache_budget, weights_quantized_once
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config import QuantizationSpec
from quark_brevitas.quantizers import build_quantizer
from quark_brevitas.types import Dtype, QSchemeType

INT4_G16 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(qnn.QuantLinear(32, 32, bias=True, weight_quant=build_quantizer(INT4_G16, "weight")),
                         nn.ReLU(),
                         qnn.QuantLinear(32, 8, bias=False, weight_quant=build_quantizer(INT4_G16, "weight"))).eval()


def _count_quantizer_calls(model: nn.Module) -> list[int]:
    calls = [0]
    for module in model.modules():
        if isinstance(module, qnn.QuantLinear):
            module.weight_quant.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _pass(model: nn.Module, batches: int) -> tuple[list[int], Callable[[], bool]]:
    """Count the model's weight-quantizer calls, and a pass over ``batches`` random batches returning whether
    its outputs equal the model's own, batch by batch."""
    data = [torch.randn(4, 32) for _ in range(batches)]
    with torch.no_grad():
        expected = [model(b) for b in data]
    calls = _count_quantizer_calls(model)

    def run() -> bool:
        outputs: list[torch.Tensor] = []
        CalibrationData(data).forward(model, "pass", on_output=lambda _i, out: outputs.append(out))
        return len(outputs) == batches and all(torch.equal(a, b) for a, b in zip(outputs, expected))

    return calls, run


def test_a_pass_quantizes_each_weight_once_with_the_same_outputs() -> None:
    model = _model()
    calls, run = _pass(model, 8)
    assert run()
    assert calls[0] == 2  # one per layer, not one per layer and batch (16 before)
    assert "quant_weight" not in model[0].__dict__  # the cache lives for the pass only


def test_a_budget_keeps_the_first_layers_weights_and_the_same_outputs() -> None:
    model = _model()
    calls, run = _pass(model, 4)
    with weight_cache_budget(32 * 32 * 4):  # the first layer's quantized weight only
        assert run()
    assert calls[0] == 1 + 4  # the first layer once, the second at every batch


def test_a_batch_that_does_not_call_a_layer_drops_its_weight() -> None:
    model = _model()
    with torch.no_grad(), weights_quantized_once(model) as weights:
        model(torch.randn(4, 32))
        weights.batch_done()
        assert model[2].__dict__["quant_weight"].value is not None
        model[0](torch.randn(4, 32))  # a batch that stops before the second layer (as GPTQ's passes do)
        weights.batch_done()
        assert model[0].__dict__["quant_weight"].value is not None
        assert model[2].__dict__["quant_weight"].value is None


def test_a_weight_changed_in_place_is_quantized_again() -> None:
    model = _model()
    x = torch.randn(4, 32)
    with torch.no_grad(), weights_quantized_once(model):
        before = model(x)
        model[0].weight.mul_(0.5)
        after = model(x)
    with torch.no_grad():
        assert torch.equal(after, model(x))
    assert not torch.equal(before, after)


def test_no_cache_with_gradients() -> None:
    model = _model()
    calls = _count_quantizer_calls(model)
    with weights_quantized_once(model):
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
    assert calls[0] == 6
    assert model[0].weight.grad is not None


def _brevitas_gptq(model: nn.Module, batches: list[torch.Tensor], gptq_class: type | None,
                   monkeypatch: pytest.MonkeyPatch) -> int:
    """Brevitas's GPTQ on ``model`` (with ``gptq_class``, or Brevitas's own); returns how often a weight
    quantizer's submodules were walked."""
    from brevitas.graph.gptq import gptq_mode

    walks = [0]
    proxy_class = type(model[0].weight_quant)
    original = proxy_class.modules

    def counted(self: nn.Module) -> Any:
        walks[0] += 1
        return original(self)

    kwargs = {"gptq_class": gptq_class} if gptq_class is not None else {}
    with torch.no_grad():
        model(batches[0])  # initialise the quantizers' scales
        with monkeypatch.context() as patch, gptq_mode(model, use_quant_activations=False, create_weight_orig=False,
                                                       **kwargs) as mode:
            patch.setattr(proxy_class, "modules", counted)
            for _ in range(mode.num_layers):
                for batch in batches:
                    mode.model(batch)
                mode.update()
    return walks[0]


def test_brevitas_gptq_checks_the_quantizer_once_per_layer_with_the_same_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quark_brevitas.brevitas_adapter import gptq_class_checking_once

    batches = [torch.randn(16, 32) for _ in range(4)]
    reference, ours = _model(), _model()
    walks_before = _brevitas_gptq(reference, batches, None, monkeypatch)
    walks_after = _brevitas_gptq(ours, batches, gptq_class_checking_once(), monkeypatch)
    assert torch.equal(reference[0].weight, ours[0].weight) and torch.equal(reference[2].weight, ours[2].weight)
    assert walks_before >= 64  # one walk per column (32 + 32 columns)
    assert walks_after <= walks_before - 60  # once per layer
