"""Every code of the grid (issue 19, item 1): symmetric int2/int3/int4 weights use the full two's-complement range
(-2..1, -4..3, -8..7) with Quark's scale ``max|w| / (2^(b-1) - 1/2)`` unless ``narrow_range=True`` keeps
``-(2^(b-1)-1)..2^(b-1)-1`` with ``max|w| / (2^(b-1) - 1)``; the integer weights, checkpoints, exports and the
config files carry it exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from quark_brevitas import ModelQuantizer, integer_weights, load_quantized, save_quantized
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.specs import narrow_range_of
from quark_brevitas.errors import ConfigError
from quark_brevitas.export import export_onnx_qcdq, export_safetensors
from quark_brevitas.export.onnx.qonnx import export_qonnx
from quark_brevitas.types import Dtype, QSchemeType, ScaleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import reference as ref  # noqa: E402
from helpers.llm_models import tiny_llama  # noqa: E402

PC, PG = QSchemeType.per_channel, QSchemeType.per_group

#: (bits, narrow) -> (divisor of max|w|, codes of the rows d * [1, -1, 0.5, 0.3] and its negation), by hand:
#: with max|w| = d the scale is exactly 1, so the codes are the dequantized values; ties round half to even
#: and the top code clamps (full int3: 3.5 -> 4 -> 3, -3.5 -> -4).
HAND = {
    (2, False): (1.5, [[1, -2, 1, 0], [-2, 1, -1, 0]]),   # 1.5, -1.5, 0.75, 0.45
    (2, True): (1.0, [[1, -1, 0, 0], [-1, 1, 0, 0]]),     # 1, -1, 0.5, 0.3
    (3, False): (3.5, [[3, -4, 2, 1], [-4, 3, -2, -1]]),  # 3.5, -3.5, 1.75, 1.05
    (3, True): (3.0, [[3, -3, 2, 1], [-3, 3, -2, -1]]),   # 3, -3, 1.5, 0.9
    (4, False): (7.5, [[7, -8, 4, 2], [-8, 7, -4, -2]]),  # 7.5, -7.5, 3.75, 2.25
    (4, True): (7.0, [[7, -7, 4, 2], [-7, 7, -4, -2]]),   # 7, -7, 3.5, 2.1
}


def _one_linear(weight: torch.Tensor) -> nn.Module:
    model = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    return model


def _quantize(model: nn.Module, spec: QTensorConfig, **layer: QTensorConfig) -> nn.Module:
    config = Config(QLayerConfig(weight=spec, **layer), pre_quant_opt_config=[])
    return ModelQuantizer(config).quantize_model(model)


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "quant_weight")]


# ===================================================================== the grid, by hand
@pytest.mark.parametrize("scheme", ["per_channel", "per_group"])
@pytest.mark.parametrize(("bits", "narrow"), sorted(HAND))
def test_quantize_dequantize_by_hand(bits: int, narrow: bool, scheme: str) -> None:
    divisor, codes = HAND[bits, narrow]
    row = torch.tensor([1.0, -1.0, 0.5, 0.3]) * divisor
    grouping = {"qscheme": PC} if scheme == "per_channel" else {"qscheme": PG, "group_size": 4}
    quant = _quantize(_one_linear(torch.stack([row, -row])), QTensorConfig(bit_width=bits, narrow_range=narrow,
                                                                           **grouping))
    weight = _layers(quant)[0].quant_weight()
    assert bool((weight.scale == 1).all())
    assert weight.value.detach().reshape(2, 4).tolist() == codes
    assert weight.int().reshape(2, 4).tolist() == codes


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_full_range_up_to_4_bits_when_asked(bits: int) -> None:
    divisor, codes = HAND[bits, False]
    row = torch.tensor([1.0, -1.0, 0.5, 0.3]) * divisor
    quant = _quantize(_one_linear(torch.stack([row, -row])), QTensorConfig(bit_width=bits, qscheme=PC,
                                                                           narrow_range=False))
    assert _layers(quant)[0].quant_weight().int().tolist() == codes


@pytest.mark.parametrize(("bits", "width"), [(2, {"bit_width": 2}), (3, {"bit_width": 3}), (4, {"bit_width": 4}),
                                             (4, {"dtype": Dtype.int4})], ids=["int2", "int3", "int4", "dtype_int4"])
def test_the_default_is_the_full_range_up_to_4_bits(bits: int, width: dict) -> None:
    """narrow_range=None gives 2-4 bit weights every code (measured better, README Number formats), whether the
    width is given as ``bit_width`` or as the ``dtype`` short form (whose spec keeps ``bit_width=8`` until
    resolved)."""
    divisor, codes = HAND[bits, False]
    row = torch.tensor([1.0, -1.0, 0.5, 0.3]) * divisor
    spec = QTensorConfig(qscheme=PC, **width)
    assert narrow_range_of(spec) is False
    quant = _quantize(_one_linear(torch.stack([row, -row])), spec)
    assert _layers(quant)[0].quant_weight().int().tolist() == codes


def test_narrow_default_above_4_bits_and_explicit_values_win() -> None:
    assert [narrow_range_of(QTensorConfig(bit_width=b)) for b in range(2, 9)] == [False] * 3 + [True] * 4
    assert narrow_range_of(QTensorConfig(dtype=Dtype.int8)) is True
    assert narrow_range_of(QTensorConfig(bit_width=3, narrow_range=True)) is True
    assert narrow_range_of(QTensorConfig(bit_width=8, narrow_range=False)) is False
    row = torch.tensor([1.0, -1.0, 0.5, 0.3]) * 127.5
    quant = _quantize(_one_linear(torch.stack([row, -row])), QTensorConfig(qscheme=PC, narrow_range=False))
    assert _layers(quant)[0].quant_weight().int().tolist() == [[127, -128, 64, 38], [-128, 127, -64, -38]]
    quant = _quantize(_one_linear(torch.stack([row, -row])), QTensorConfig(qscheme=PC))  # int8: narrow
    assert _layers(quant)[0].quant_weight().int().min() == -127


def test_power_of_two_scales_keep_brevitas_divisor() -> None:
    """pof2 scales: ``2^ceil(log2(max / 2^(b-1)))`` (a power of two), full range codes."""
    row = torch.tensor([1.0, -1.0, 0.5, 0.3])
    quant = _quantize(_one_linear(torch.stack([row, -row])), QTensorConfig(bit_width=3, qscheme=PC,
                                                                           scale_type=ScaleType.pof2,
                                                                           narrow_range=False))
    weight = _layers(quant)[0].quant_weight()
    assert torch.equal(weight.scale.flatten(), torch.full((2,), 0.25))
    assert weight.int().tolist() == [[3, -4, 2, 1], [-4, 3, -2, -1]]


@pytest.mark.parametrize(("spec", "where"), [
    (QTensorConfig(bit_width=4, symmetric=False, narrow_range=False), "weight"),
    (QTensorConfig(narrow_range=True), "input_tensors"),
])
def test_narrow_range_outside_symmetric_int_weights_is_refused(spec: QTensorConfig, where: str) -> None:
    layer = QLayerConfig(**{where: spec})
    with pytest.raises(ConfigError, match=rf"{where}\.narrow_range.*symmetric int_quant weights"):
        ModelQuantizer(Config(layer)).quantize_model(nn.Sequential(nn.Linear(4, 2)))


# ===================================================================== the grid on random weights, by definition
def _full_range_qdq(w: torch.Tensor, absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Quark's full-range definition: ``scale = max|w| / (2^(b-1) - 1/2)``, codes ``-2^(b-1)..2^(b-1)-1``."""
    scale = absmax / (2 ** (bits - 1) - 0.5)
    return ref.int_qdq(w, scale, 0.0, bits, True, False)


def _random_weight(shape: tuple[int, int] = (12, 64), seed: int = 3) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel", "per_group"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_random_weights_match_the_full_range_definition(bits: int, scheme: str) -> None:
    w = _random_weight()
    grouping = {"per_tensor": {}, "per_channel": {"qscheme": PC}, "per_group": {"qscheme": PG, "group_size": 16}}
    quant = _quantize(_one_linear(w), QTensorConfig(bit_width=bits, narrow_range=False, **grouping[scheme]))
    absmax = {"per_tensor": w.abs().max(), "per_channel": w.abs().amax(1, keepdim=True),
              "per_group": ref.group_absmax(w, 16)}[scheme]
    weight = _layers(quant)[0].quant_weight()
    ref.assert_close(weight.value.reshape(w.shape), _full_range_qdq(w, absmax, bits), "values")
    codes = weight.int().reshape(w.shape)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert low <= int(codes.min()) and int(codes.max()) == high
    if scheme != "per_tensor":  # some row's or group's negative extreme lands on the extra code
        assert int(codes.min()) == low


@pytest.mark.parametrize("bits", [2, 4])
def test_mse_scales_search_on_the_full_grid(bits: int) -> None:
    """MSE scales keep the full range's codes (values on their own full grid) and do not lose to min-max."""
    from quark_brevitas.config import ParamType

    w = _random_weight()
    mse = _layers(_quantize(_one_linear(w), QTensorConfig(bit_width=bits, qscheme=PC, narrow_range=False,
                                                          param_type=ParamType.mse)))[0].quant_weight()
    stats = _layers(_quantize(_one_linear(w), QTensorConfig(bit_width=bits, qscheme=PC,
                                                            narrow_range=False)))[0].quant_weight()
    ref.assert_close(mse.value, ref.int_qdq(w, mse.scale.detach(), 0.0, bits, True, False), "values on own grid")
    assert ((mse.value - w) ** 2).mean() <= ((stats.value - w) ** 2).mean() * (1 + 1e-6)


# ===================================================================== integer weights, exports, files
def _random_linear(seed: int = 0, shape: tuple[int, int] = (16, 64)) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(shape[1], shape[0]), nn.ReLU(), nn.Linear(shape[0], 8))


@pytest.mark.parametrize(("narrow", "low", "high"), [(False, -4, 3), (True, -3, 3), (None, -4, 3)])
def test_integer_weights_hold_every_code(narrow: bool | None, low: int, high: int) -> None:
    quant = _quantize(_random_linear(), QTensorConfig(bit_width=3, qscheme=PG, group_size=16, narrow_range=narrow))
    entries = integer_weights(quant)
    assert len(entries) == 2
    for entry, layer in zip(entries.values(), _layers(quant), strict=True):
        codes = entry.int_weight
        assert (int(codes.min()), int(codes.max())) == (low, high)
        assert entry.narrow_range is (narrow is True)
        assert torch.equal(entry.dequantize(), layer.quant_weight().value.detach())


def test_qcdq_and_qonnx_exports_carry_the_full_range(tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    spec = QTensorConfig(bit_width=3, qscheme=PC, narrow_range=False)
    quant = _quantize(_random_linear(), spec)
    x = torch.randn(5, 64)
    # The INT4 DequantizeLinear form (MatMulNBits, the default kernel, is checked by
    # tests/export/onnx/test_matmul_nbits.py).
    report = export_onnx_qcdq(quant, x, tmp_path / "qcdq.onnx", int4_kernel="dequantize")
    assert report.max_abs_diff < 1e-5
    graph = onnx.load(str(tmp_path / "qcdq.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    codes = [inits[n.input[0]] for n in graph.node
             if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].ndim == 2]
    assert len(codes) == 2  # the weights' codes, folded to constants: -4..3, not -3..3
    assert all((int(c.min()), int(c.max())) == (-4, 3) for c in codes)
    report = export_qonnx(quant, x, tmp_path / "qonnx.onnx")
    assert report.max_abs_diff <= report.tolerance
    nodes = [n for n in onnx.load(str(tmp_path / "qonnx.onnx")).graph.node if n.op_type == "Quant"]
    narrow = {a.name: a.i for n in nodes for a in n.attribute}.get("narrow")
    assert narrow == 0


def test_checkpoint_and_config_round_trip(tmp_path: Path) -> None:
    spec = QTensorConfig(bit_width=3, qscheme=PG, group_size=16, narrow_range=False)
    model = _random_linear()
    quant = _quantize(model, spec)
    save_quantized(quant, tmp_path / "ckpt", example_input=torch.randn(2, 64))
    loaded = load_quantized(_random_linear(), tmp_path / "ckpt")
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), quant(x))
    assert int(_layers(loaded)[0].quant_weight().int().min()) == -4
    for narrow in (None, True, False):
        config = Config(QLayerConfig(weight=QTensorConfig(bit_width=3, narrow_range=narrow)))
        plain = config.to_dict()
        assert ("narrow_range" in plain["global_quant_config"]["weight"]) is (narrow is not None)
        assert Config.from_json(json.dumps(plain)) == config
        assert Config.from_dict(plain).global_quant_config.weight.narrow_range is narrow


def test_gguf_q4_0_and_compressed_tensors_hold_code_minus_8(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.export import export_gguf

    preset = get_preset("gguf_q4_0")  # GGUF's own Q4_0 grid, -8..7, whatever the default
    assert [layer.weight.narrow_range for layer in preset.layer_type_quant_config.values()] == [False]
    quant = ModelQuantizer(preset).quantize_model(tiny_llama())
    down = quant.model.layers[1].mlp.down_proj
    assert int(down.quant_weight().int().min()) == -8
    path = export_gguf(quant, tmp_path / "gguf", model_type="llama")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    decoded = gguf.quants.dequantize(tensors["blk.1.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q4_0)
    assert np.abs(decoded - down.quant_weight().value.detach().numpy()).max() == 0.0

    layer = QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=PG, group_size=32, narrow_range=False))
    quant = ModelQuantizer(Config(layer, exclude=["lm_head"])).quantize_model(tiny_llama())
    folder = export_safetensors(quant, tmp_path / "ct")
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj."
    codes = unpack_from_int32(tensors[prefix + "weight_packed"], 4, tensors[prefix + "weight_shape"])
    assert int(codes.min()) == -8
    rebuilt = codes.float() * tensors[prefix + "weight_scale"].repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt, quant.model.layers[1].mlp.down_proj.quant_weight().value.detach())


def test_gguf_presets_use_their_types_codes() -> None:
    """Q4_0 stores -8..7 (llama.cpp puts a block's largest weight on -8), Q8_0 -127..127 (llama.cpp divides by 127),
    Q4_1 is asymmetric: each preset says so itself, so a change of the default grid cannot move them."""
    from quark_brevitas.config.presets import get_preset

    grids = {name: [layer.weight.narrow_range for layer in get_preset(name).layer_type_quant_config.values()]
             for name in ("gguf_q4_0", "gguf_q8_0", "gguf_q4_1")}
    assert grids == {"gguf_q4_0": [False], "gguf_q8_0": [True], "gguf_q4_1": [None]}


def test_version_2_files_keep_the_narrow_grid_they_were_written_with() -> None:
    """A config (a checkpoint's included) written by to_dict before the full range became the default reads with
    narrow_range=True where it left the field unset; newer files and hand-written ones (no version) take today's
    default; an explicit value always wins."""
    from quark_brevitas.config import FORMAT_VERSION, Config, QuantizationConfig, QuantizationSpec
    from quark_brevitas.types import Dtype, QSchemeType

    int4 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)
    config = Config(QuantizationConfig(weight=int4), layer_quant_config={
        "fc": QuantizationConfig(weight=QuantizationSpec(dtype=Dtype.int4, narrow_range=False)),
        "head": QuantizationConfig(weight=QuantizationSpec())})  # int8: narrow whatever the version
    written = config.to_dict()
    assert written["format_version"] == FORMAT_VERSION == 3
    old = Config.from_dict({**written, "format_version": 2})
    assert old.global_quant_config.weight.narrow_range is True
    assert old.layer_quant_config["fc"].weight.narrow_range is False
    assert old.layer_quant_config["head"].weight.narrow_range is None
    assert Config.from_dict(written).global_quant_config.weight.narrow_range is None
    unversioned = {k: v for k, v in written.items() if k != "format_version"}
    assert Config.from_dict(unversioned).global_quant_config.weight.narrow_range is None
