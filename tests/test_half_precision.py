"""float16 / bfloat16 models: quantize, run, calibrate, export and checkpoint like float32 ones.

The documented contract: weights and activations stay in the model's dtype; every quantizer's scales and
zero points are float32 and the quantization arithmetic runs in float32, its result rounded to the model's
dtype; export writes a float32 copy. Numerics are checked against hand-computed quantize/dequantize.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from quark_brevitas import ModelExporter, ModelQuantizer, load_quantized, save_quantized
from quark_brevitas.brevitas_adapter import iter_quantizers
from quark_brevitas.checkpoint import CheckpointError, read_checkpoint
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import run_onnx
from quark_brevitas.export.intweights import integer_weights
from quark_brevitas.types import QSchemeType

HALF = [torch.float16, torch.bfloat16]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.relu(self.conv(x)), 1))


def _model_and_data(dtype: torch.dtype) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, 6, 6, generator=g).to(dtype) for _ in range(3)]
    return ConvNet().to(dtype).eval(), batches


def _quantizer_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {}
    for site in iter_quantizers(model, enabled_only=False):
        for key, value in (*site.proxy.named_parameters(), *site.proxy.named_buffers()):
            tensors[f"{site.name}.{key}"] = value
    return tensors


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_per_channel", "w4a8_gptq", "fp8", "w4_weight_only"])
@pytest.mark.parametrize("dtype", HALF)
def test_presets_quantize_and_run_in_the_models_dtype(dtype: torch.dtype, preset: str) -> None:
    model, batches = _model_and_data(dtype)
    quantized = ModelQuantizer(get_preset(preset)).quantize_model(model, batches)
    with torch.no_grad():
        output, reference = quantized(batches[0]), model(batches[0])
    assert output.dtype == dtype
    error = float((output.float() - reference.float()).norm() / reference.float().norm())
    assert error < (0.2 if "4" in preset else 0.1), error
    for name, param in quantized.named_parameters():
        if "quant" not in name:
            assert param.dtype == dtype, f"{name} is {param.dtype}"
    scales = _quantizer_tensors(quantized)
    assert scales and all(t.dtype == torch.float32 for t in scales.values() if t.is_floating_point()), \
        {k: t.dtype for k, t in scales.items() if t.dtype != torch.float32}


@pytest.mark.parametrize("dtype", HALF)
def test_quantized_weights_and_activations_match_a_hand_computed_reference(dtype: torch.dtype) -> None:
    """Per-channel int8 weights: scale = max|w| / 127 per output channel in float32, codes rounded half to
    even; int8 input: the calibrated float32 scale; values rounded to the model's dtype at the end."""
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=QTensorConfig()),
                    pre_quant_opt_config=[])
    model, batches = _model_and_data(dtype)
    quantized = ModelQuantizer(config).quantize_model(model, batches)
    for layer in (quantized.conv, quantized.fc):
        w = layer.weight.detach().float()
        scale = w.flatten(1).abs().amax(dim=1).view(-1, *[1] * (w.dim() - 1)) / 127
        expected = (torch.round(w / scale).clamp(-127, 127) * scale).to(dtype)
        assert torch.equal(layer.quant_weight().value, expected)
    x = batches[1]
    input_scale = quantized.conv.input_quant.scale()
    assert input_scale.dtype == torch.float32
    expected_input = (torch.round(x.float() / input_scale).clamp(-128, 127) * input_scale).to(dtype)
    assert torch.equal(quantized.conv.input_quant(x).value, expected_input)


@pytest.mark.parametrize("dtype", HALF)
def test_export_writes_a_verified_float32_copy(dtype: torch.dtype, tmp_path: Any, caplog: Any) -> None:
    model, batches = _model_and_data(dtype)
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(model, batches)
    path = tmp_path / "half.onnx"
    with caplog.at_level(logging.INFO, logger="quark_brevitas.export.onnx.precision"):
        report = ModelExporter(path).export_onnx_model(quantized, batches[0])
    assert report.max_abs_diff <= report.tolerance
    assert any("float32 copy" in r.message and str(dtype).removeprefix("torch.") in r.message for r in caplog.records)
    assert next(iter(quantized.parameters())).dtype == dtype  # the caller's model was not converted
    onnx_out = torch.from_numpy(run_onnx(path, batches[0].float())[0])
    with torch.no_grad():
        half_out = quantized(batches[0]).float()
    # The file matches the half model up to the half model's own rounding (a few of its ulps here).
    assert float((onnx_out - half_out).abs().max()) <= 8 * float(half_out.abs().max()) * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", HALF)
def test_checkpoint_round_trip_records_and_checks_the_dtype(dtype: torch.dtype, tmp_path: Any) -> None:
    model, batches = _model_and_data(dtype)
    quantized = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(model, batches)
    save_quantized(quantized, tmp_path, example_input=batches[0])
    manifest = read_checkpoint(tmp_path).manifest
    name = str(dtype).removeprefix("torch.")
    assert manifest["dtype"] == name
    assert manifest["tensors"]["fc.weight"]["dtype"] == name
    assert manifest["tensors"]["fc.weight_quant.tensor_quant.scaling_impl.value"]["dtype"] == "float32"
    loaded = load_quantized(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]), quantized(batches[0]))
    with pytest.raises(CheckpointError, match=rf"'conv\.weight' is {name} in the checkpoint but float32 .*"
                                              rf"\.to\({name}\)"):
        load_quantized(ConvNet(), tmp_path)


@pytest.mark.parametrize("dtype", HALF)
def test_integer_weights_of_a_half_model_are_exact(dtype: torch.dtype) -> None:
    model, batches = _model_and_data(dtype)
    quantized = ModelQuantizer(get_preset("w8a8_per_channel")).quantize_model(model, batches)
    weights = integer_weights(quantized)
    for name, entry in weights.items():
        assert entry.scale.dtype == torch.float32
        layer_weight = quantized.get_submodule(name).quant_weight().value
        assert torch.equal(entry.dequantize().to(dtype), layer_weight)


def test_float64_models_quantize_too() -> None:
    model, batches = _model_and_data(torch.float64)
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(model, batches)
    with torch.no_grad():
        output = quantized(batches[0])
    assert output.dtype == torch.float64
    assert float((output - model(batches[0])).norm() / model(batches[0]).norm()) < 0.1
