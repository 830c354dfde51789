"""Tests of quark_brevitas.export.intweights: integer (or float8) weights, scales and zero points per layer.

Done-when check: integer weights times scales (minus zero points) reproduce every quantized weight
exactly, for int8/int4, per tensor/per channel, symmetric/asymmetric, power-of-two scales and fp8.
The products are recomputed here independently of ``IntegerWeight.dequantize``, also from the
files written for C/FPGA flows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from quark_brevitas import (
    Config,
    IntegerWeight,
    ModelQuantizer,
    QLayerConfig,
    QTensorConfig,
    QuantType,
    integer_weights,
    save_integer_weights,
)
from quark_brevitas.config import ParamType
from quark_brevitas.config.specs import narrow_range_of
from quark_brevitas.types import Dtype, QSchemeType, ScaleType

PC = QSchemeType.per_channel


def _fp(e: int, m: int, **kwargs) -> QTensorConfig:
    return QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=e, mantissa_bit_width=m,
                         bit_width=1 + e + m, **kwargs)


# name -> (weight spec, int_weight dtype, format, (min code, max code) allowed, per-channel)
SPECS = {
    "int8": (QTensorConfig(), torch.int8, "int8", (-127, 127), False),
    "int4_per_channel": (QTensorConfig(bit_width=4, qscheme=PC), torch.int8, "int4", (-8, 7), True),
    "uint8_asym_per_channel": (QTensorConfig(symmetric=False, qscheme=PC), torch.uint8, "uint8", (0, 255), True),
    "uint4_asym": (QTensorConfig(bit_width=4, symmetric=False), torch.uint8, "uint4", (0, 15), False),
    "int8_pof2": (QTensorConfig(scale_type=ScaleType.pof2), torch.int8, "int8", (-127, 127), False),
    "int6_mse_per_channel": (QTensorConfig(bit_width=6, qscheme=PC, param_type=ParamType.mse), torch.int8, "int6",
                             (-31, 31), True),
    "fp8_e4m3": (_fp(4, 3), torch.float8_e4m3fn, "fp8_e4m3", None, False),
    "fp8_e5m2_per_channel": (_fp(5, 2, qscheme=PC), torch.float8_e5m2, "fp8_e5m2", None, True),
    "fp6_e3m2": (_fp(3, 2), torch.float32, "fp6_e3m2", None, False),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.deconv = nn.ConvTranspose2d(8, 5, 2)
        self.fc = nn.Linear(5 * 7 * 7, 10)
        self.attn = nn.MultiheadAttention(10, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(torch.relu(self.deconv(torch.relu(self.conv(x)))).flatten(1)).unsqueeze(1)
        return self.attn(y, y, y)[0]


def _weight_only(spec: QTensorConfig) -> nn.Module:
    torch.manual_seed(0)
    config = Config(global_quant_config=QLayerConfig(weight=spec), pre_quant_opt_config=[])
    return ModelQuantizer(config).quantize_model(Net())  # weight-only: no calibration data needed


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "quant_weight")}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_integer_weights_reproduce_quantized_weights_exactly(name: str) -> None:
    spec, dtype, fmt, code_range, per_channel = SPECS[name]
    model = _weight_only(spec)
    weights = integer_weights(model)
    layers = _layers(model)
    assert list(weights) == ["conv", "deconv", "fc", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"] \
        == list(layers)
    for layer_name, entry in weights.items():
        with torch.no_grad():
            quant_weight = layers[layer_name].quant_weight().value
        assert isinstance(entry, IntegerWeight) and entry.name == layer_name
        assert entry.int_weight.dtype == dtype and entry.format == fmt
        assert entry.int_weight.shape == quant_weight.shape
        rebuilt = (entry.int_weight.float() - entry.zero_point.float()) * entry.scale  # not via dequantize()
        assert torch.equal(rebuilt, quant_weight), layer_name
        assert torch.equal(entry.dequantize(), quant_weight)
        if code_range is not None:
            assert code_range[0] <= int(entry.int_weight.min()) and int(entry.int_weight.max()) <= code_range[1]
            assert entry.zero_point.dtype == dtype
            assert entry.narrow_range == (spec.symmetric and narrow_range_of(spec.resolved()))
            assert entry.bit_width == spec.bit_width and entry.signed == spec.symmetric
        else:
            assert not bool(entry.zero_point.any())
            assert (entry.exponent_bit_width, entry.mantissa_bit_width) == (spec.exponent_bit_width,
                                                                             spec.mantissa_bit_width)
        channel_axis = 1 if layer_name == "deconv" else 0
        assert entry.axis == (channel_axis if per_channel else None)
        assert entry.scale.numel() == (quant_weight.shape[channel_axis] if per_channel else 1)
        if spec.scale_type is ScaleType.pof2:
            assert torch.equal(entry.scale, 2.0 ** torch.round(torch.log2(entry.scale)))
    if not spec.symmetric:
        assert any(bool((w.zero_point != 0).any()) for w in weights.values())  # a real zero point was tested


def test_calibrated_digits_model(digits_model, digits_data) -> None:
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=PC),
                                                     input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)))
    quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    weights = integer_weights(quant)
    assert list(weights) == ["conv1", "conv2", "fc1", "fc2"]
    for name, module in _layers(quant).items():
        assert torch.equal(weights[name].dequantize(), module.quant_weight().value)
    assert sum(w.int_weight.numel() for w in weights.values()) == sum(
        m.weight.numel() for m in _layers(quant).values())


def test_float_model_has_no_integer_weights() -> None:
    assert integer_weights(nn.Linear(3, 3)) == {}
    with pytest.raises(TypeError, match="torch.nn.Module"):
        integer_weights("model")


@pytest.mark.parametrize("name", ["uint8_asym_per_channel", "fp8_e4m3", "int4_per_channel"])
def test_saved_files_reproduce_weights(tmp_path: Path, name: str) -> None:
    model = _weight_only(SPECS[name][0])
    weights = integer_weights(model)
    layers = _layers(model)

    st_path = save_integer_weights(weights, tmp_path / "w.safetensors")
    tensors = load_file(str(st_path))
    with safe_open(str(st_path), "pt") as handle:
        metadata = json.loads(handle.metadata()["quark_brevitas.integer_weights"])
    npz = np.load(save_integer_weights(weights, tmp_path / "w.npz", format="npz"))  # allow_pickle=False
    npz_metadata = json.loads(str(npz["__metadata__"]))
    assert metadata == npz_metadata and set(metadata) == set(layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.npz", "w.safetensors"]
    for layer_name, layer in layers.items():
        info = metadata[layer_name]
        expected = layer.quant_weight().value.detach()
        codes = tensors[f"{layer_name}.int_weight"]
        assert str(codes.dtype).removeprefix("torch.") == info["int_weight_dtype"]
        from_st = (codes.float() - tensors[f"{layer_name}.zero_point"].float()) * tensors[f"{layer_name}.scale"]
        assert torch.equal(from_st, expected)

        raw = npz[f"{layer_name}.int_weight"]
        if info["int_weight_dtype"].startswith("float8"):  # numpy has no float8: uint8 bit patterns
            assert raw.dtype == np.uint8
            raw_codes = torch.from_numpy(raw).view(getattr(torch, info["int_weight_dtype"])).float().numpy()
        else:
            raw_codes = raw.astype(np.float32)
        from_npz = (raw_codes - npz[f"{layer_name}.zero_point"].astype(np.float32)) * npz[f"{layer_name}.scale"]
        assert np.array_equal(from_npz, expected.numpy())
        assert info["bit_width"] == weights[layer_name].bit_width and info["axis"] == weights[layer_name].axis


def test_save_rejects_bad_arguments(tmp_path: Path) -> None:
    weights = integer_weights(_weight_only(QTensorConfig()))
    with pytest.raises(ValueError, match="'safetensors' or 'npz'"):
        save_integer_weights(weights, tmp_path / "w.bin", format="bin")
    with pytest.raises(ValueError, match="is a directory"):
        save_integer_weights(weights, tmp_path)
    with pytest.raises(TypeError, match=r"weights\['x'\] must be an IntegerWeight"):
        save_integer_weights({"x": 1}, tmp_path / "w.safetensors")


# ------------------------------------------------------------------ per group (and MX)
PG = QSchemeType.per_group


def _grouped_linear(spec: QTensorConfig, in_features: int = 256) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, 24), nn.ReLU(), nn.Linear(24, 8))
    # Only layer 0 is checked; layer 2's 24 inputs would need padding for groups of 32 or 128.
    config = Config(global_quant_config=QLayerConfig(weight=spec), pre_quant_opt_config=[], exclude=["2"])
    return ModelQuantizer(config).quantize_model(model)


@pytest.mark.parametrize("dtype", [Dtype.int4, Dtype.uint4, Dtype.int8, Dtype.uint8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_per_group_integer_weights_are_exact(dtype: Dtype, group_size: int) -> None:
    quant = _grouped_linear(QTensorConfig(dtype=dtype, qscheme=PG, group_size=group_size))
    entry = integer_weights(quant)["0"]
    weight = quant[0].quant_weight().value
    groups = 256 // group_size
    assert (entry.group_size, entry.axis) == (group_size, 1)
    assert entry.scale.shape == (24, groups)
    asymmetric = dtype in (Dtype.uint4, Dtype.uint8)
    assert entry.zero_point.shape == ((24, groups) if asymmetric else ())
    low, high = {Dtype.int4: (-8, 7), Dtype.uint4: (0, 15), Dtype.int8: (-127, 127), Dtype.uint8: (0, 255)}[dtype]
    codes = entry.int_weight.to(torch.int32)
    assert low <= codes.min() and codes.max() <= high
    # Independent of IntegerWeight.dequantize: one scale per group of consecutive input channels.
    grouped_codes = codes.float().reshape(24, groups, group_size)
    zero_point = entry.zero_point.float().reshape(24, groups, 1) if asymmetric else 0.0
    product = ((grouped_codes - zero_point) * entry.scale.reshape(24, groups, 1)).reshape(24, 256)
    assert torch.equal(product, weight)
    assert torch.equal(entry.dequantize(), weight)
    # A group of the layer's scales really varies between groups (not one per-channel scale in disguise).
    assert not torch.equal(entry.scale[:, 0], entry.scale[:, -1]) or groups == 1


def test_per_group_with_a_short_last_group_is_exact() -> None:
    quant = _grouped_linear(QTensorConfig(dtype=Dtype.uint4, qscheme=PG, group_size=32, pad_groups=True),
                            in_features=200)  # the short last group is what is checked: padding asked for
    entry = integer_weights(quant)["0"]
    assert entry.scale.shape == (24, 7) and entry.int_weight.shape == (24, 200)
    assert torch.equal(entry.dequantize(), quant[0].quant_weight().value)


@pytest.mark.parametrize("element", [Dtype.int8, Dtype.fp4])
def test_mx_weights_carry_shared_exponents(element: Dtype) -> None:
    quant = _grouped_linear(QTensorConfig(dtype=Dtype.mx, mx_element_dtype=element))
    entry = integer_weights(quant)["0"]
    assert (entry.group_size, entry.axis, entry.scale.shape) == (32, 1, (24, 8))
    assert entry.shared_exponent is not None and entry.shared_exponent.dtype == torch.int16
    assert torch.equal(torch.exp2(entry.shared_exponent.float()), entry.scale)
    assert torch.equal(entry.dequantize(), quant[0].quant_weight().value)


def test_per_group_saved_file_reproduces_weights(tmp_path: Path) -> None:
    quant = _grouped_linear(QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8))
    path = save_integer_weights(integer_weights(quant), tmp_path / "w.safetensors")
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["quark_brevitas.integer_weights"])
    assert meta["0"]["group_size"] == 32 and meta["0"]["axis"] == 1
    scale = tensors["0.scale"].repeat_interleave(32, dim=1)
    assert torch.equal(tensors["0.int_weight"].float() * scale, quant[0].quant_weight().value)
    assert torch.equal(torch.exp2(tensors["0.shared_exponent"].float()), tensors["0.scale"])
