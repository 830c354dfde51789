"""End to end on the digits CNN: accuracy per spec family, the caller's model, the plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, ParamType, QLayerConfig, QTensorConfig, QuantType, algos
from quark_brevitas.algorithms import handler_for
from quark_brevitas.cli.digits import evaluate
from quark_brevitas.types import QSchemeType, ScaleType

A8 = QTensorConfig()
B32 = QTensorConfig(bit_width=32)
FP8 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3)
FP8_E5M2 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=5, mantissa_bit_width=2)
W4_PC = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel)


def quantize(model: nn.Module, data, **layer) -> nn.Module:
    return ModelQuantizer(Config(global_quant_config=QLayerConfig(**layer))).quantize_model(model, data.calib)


@pytest.mark.parametrize(
    "layer",
    [
        pytest.param(dict(weight=QTensorConfig(), input_tensors=A8, bias=B32), id="W8A8"),
        pytest.param(dict(weight=W4_PC, input_tensors=A8, bias=B32), id="W4pcA8"),
    ],
)
def test_done_when_accuracy_within_one_point(digits_model, digits_data, layer) -> None:
    float_acc = evaluate(digits_model, digits_data.test)
    quant_acc = evaluate(quantize(digits_model, digits_data, **layer), digits_data.test)
    assert float_acc >= 95.0
    assert quant_acc > float_acc - 1.0, (float_acc, quant_acc)


SPEC_FAMILIES = {
    "int8_per_channel_mse": dict(weight=QTensorConfig(qscheme=QSchemeType.per_channel, param_type=ParamType.mse),
                                 input_tensors=QTensorConfig(param_type=ParamType.mse)),
    "int8_asym": dict(weight=QTensorConfig(symmetric=False), input_tensors=QTensorConfig(symmetric=False)),
    "int8_pof2": dict(weight=QTensorConfig(scale_type=ScaleType.pof2),
                      input_tensors=QTensorConfig(scale_type=ScaleType.pof2), bias=QTensorConfig(bit_width=16)),
    "int6_w_int12_a": dict(weight=QTensorConfig(bit_width=6, qscheme=QSchemeType.per_channel),
                           input_tensors=QTensorConfig(bit_width=12)),
    "int8_with_output": dict(weight=QTensorConfig(), input_tensors=A8, output_tensors=A8, bias=B32),
    "fp8_e4m3": dict(weight=FP8, input_tensors=FP8),
    "fp8_e5m2_per_channel": dict(weight=QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=5,
                                                      mantissa_bit_width=2, qscheme=QSchemeType.per_channel),
                                 input_tensors=FP8_E5M2),
    "fp8_mse": dict(weight=QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3,
                                         param_type=ParamType.mse), input_tensors=FP8),
    "weight_only_int4_mse": dict(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel,
                                                      param_type=ParamType.mse)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SPEC_FAMILIES))
def test_spec_family_end_to_end(digits_model, digits_data, family: str) -> None:
    float_acc = evaluate(digits_model, digits_data.test)
    quant = quantize(digits_model, digits_data, **SPEC_FAMILIES[family])
    quant_layers = [m for m in quant.modules() if type(m).__module__.startswith("brevitas.nn")]
    assert len(quant_layers) == 4  # two convolutions, two linears
    assert quant_layers[0].weight_quant.is_quant_enabled
    assert evaluate(quant, digits_data.test) > float_acc - 3.0


def test_callers_model_is_untouched_and_requantizing_gives_the_same_model(digits_model, digits_data) -> None:
    before = copy.deepcopy(digits_model.state_dict())
    layer = dict(weight=QTensorConfig(), input_tensors=A8, bias=B32)
    first = quantize(digits_model, digits_data, **layer)
    after = digits_model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(isinstance(m, nn.BatchNorm2d) for m in digits_model.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in first.modules())  # merged in the copy only
    second = quantize(digits_model, digits_data, **layer)
    x = next(iter(digits_data.test))[0]
    with torch.no_grad():
        assert torch.equal(first(x), second(x))
    assert evaluate(second, digits_data.test) == evaluate(first, digits_data.test)


def test_inplace_opt_in_reuses_the_model(digits_model, digits_data) -> None:
    model = copy.deepcopy(digits_model)
    float_weights = {name: getattr(model, name).weight.detach().clone() for name in ("conv1", "conv2", "fc1", "fc2")}
    kept = {name: getattr(model, name) for name in ("bn1", "relu1", "bn2", "pool")}
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(model, inplace=True)
    assert quant is model
    # The caller's own attributes now hold the quantized layers, built from its float weights (no BatchNorm
    # merge without pre-quant steps); the other modules are the caller's objects, untouched.
    assert {name: type(getattr(model, name)).__name__ for name in float_weights} == {
        "conv1": "QuantConv2d", "conv2": "QuantConv2d", "fc1": "QuantLinear", "fc2": "QuantLinear"}
    for name, weight in float_weights.items():
        assert torch.equal(getattr(model, name).weight.detach(), weight), name
    assert all(getattr(model, name) is module for name, module in kept.items())


def test_weight_only_needs_no_data(digits_model, digits_data) -> None:
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(digits_model)
    assert evaluate(quant, digits_data.test) > evaluate(digits_model, digits_data.test) - 1.0


def test_plan_lists_every_module_without_touching_it(digits_model) -> None:
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=A8))
    rows = ModelQuantizer(config).plan(digits_model)
    quantized = [r for r in rows if r.layer_config is not None]
    assert [r.module_type for r in quantized] == ["Conv2d", "Conv2d", "Linear", "Linear"]
    assert any(r.module_type == "BatchNorm2d" and r.layer_config is None for r in rows)
    assert not any(type(m).__module__.startswith("brevitas") for m in digits_model.modules())


def test_unsupported_model_error_lists_supported_types() -> None:
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[])
    with pytest.raises(ValueError, match=r"no layer the backend can quantize; supported layer types: .*Conv2d"):
        ModelQuantizer(config).quantize_model(nn.Sequential(nn.LayerNorm(4)))


def test_quantized_model_logs_float_layers(digits_model, digits_data, caplog) -> None:
    with caplog.at_level("INFO", logger="quark_brevitas.backend"):
        quantize(digits_model, digits_data, weight=QTensorConfig(), input_tensors=A8)
    lines = [r.getMessage() for r in caplog.records if "kept in float" in r.getMessage()]
    assert len(lines) == 1 and "ReLU" in lines[0] and "MaxPool2d" in lines[0]


def test_multihead_attention_is_replaced() -> None:
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.mha(x, x, x)[0])

    model = Attn().eval()
    x = torch.randn(4, 5, 16)
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=A8, bias=B32))
    quant = ModelQuantizer(config).quantize_model(model, [x])
    assert type(quant.mha).__name__ == "QuantMultiheadAttention"
    assert type(quant.mha.out_proj).__name__ == "QuantLinear"
    with torch.no_grad():
        ref, out = model(x), quant(x)
    assert 0 < (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_algorithms_run_in_list_order(digits_model, digits_data, monkeypatch) -> None:
    calls: list[str] = []
    for cls in (algos.BiasCorrection, algos.CalibrateBatchNorm):
        handler = handler_for(cls())
        original = handler.apply

        def spy(algo, model, data, _original=original, _name=cls.__name__):
            calls.append(_name)
            return _original(algo, model, data)

        monkeypatch.setattr(handler, "apply", spy)
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=A8),
                    algo_config=[algos.CalibrateBatchNorm(), algos.BiasCorrection(), algos.CalibrateBatchNorm()])
    ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    assert calls == ["CalibrateBatchNorm", "BiasCorrection", "CalibrateBatchNorm"]
