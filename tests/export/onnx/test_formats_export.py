"""Export of per-group, MX, fp6 and fp4 weights (blocked DequantizeLinear, opset 21) and the clear
errors for what cannot go to a target."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers.onnx_check import assert_onnx_predictions_match
from torch import nn

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.cli.digits import example_input
from quark_brevitas.export import ExportError, ExportMismatchError, export_onnx_qcdq, run_onnx, verify_onnx
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ZeroPointType

PG = QSchemeType.per_group
T = onnx.TensorProto

DIGITS = {
    # name: (weight spec, stored weight type, block size); the digits CNN's 1- and 16-channel convs pad their
    # groups (asked for with pad_groups; MX pads as Quark's does)
    "int4 g32": (QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=32, pad_groups=True), T.INT4, 32),
    "int4 g128": (QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=128, pad_groups=True), T.INT4, 128),
    "mxint8": (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8), T.INT8, 32),
    "mxfp8 e4m3": (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3), T.FLOAT8E4M3FN, 32),
    "mxfp6 e2m3": (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp6_e2m3), T.INT8, 32),
    "mxfp4": (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4), T.INT8, 32),
}


def _weight_dequantizers(path) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    return [(n, inits[n.input[0]]) for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in inits and len(inits[n.input[0]].dims) >= 2]


def _matmul_nbits(path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DIGITS))
def test_digits_exports_run_in_onnxruntime_with_pytorchs_predictions(digits_model, digits_data, tmp_path, name):
    spec, code_type, block = DIGITS[name]
    quant = ModelQuantizer(Config(QLayerConfig(weight=spec, input_tensors=QTensorConfig()))).quantize_model(
        digits_model, digits_data.calib)
    path = tmp_path / "digits.onnx"
    report = ModelExporter(path).export_onnx_model(quant, example_input(digits_data))
    assert report.opset == 21 and report.max_abs_diff <= report.tolerance
    assert report.max_abs_diff < 1e-4  # exact weights: only float summation order differs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.onnx"]
    dequantizers = _weight_dequantizers(path)
    # every layer's weight stored as codes; 4-bit Linear weights as MatMulNBits (the default int4_kernel)
    nbits = _matmul_nbits(path)
    assert len(nbits) == (2 if code_type == T.INT4 else 0)
    assert all(onnx.helper.get_attribute_value(a) == block for n in nbits for a in n.attribute
               if a.name == "block_size")
    assert len(dequantizers) + len(nbits) == 4
    for node, codes in dequantizers:
        assert codes.data_type == code_type
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["block_size"] == block and attributes["axis"] in (0, 1)
    code_shapes = {tuple(codes.dims) for _, codes in dequantizers}
    scales = {node.input[1] for node, _ in dequantizers}
    float_weights = [i.name for i in onnx.load(str(path)).graph.initializer
                     if i.data_type == T.FLOAT and tuple(i.dims) in code_shapes and i.name not in scales]
    assert not float_weights

    assert_onnx_predictions_match(quant, path, digits_data.test)


def _mlp() -> nn.Module:
    """48 and 40 inputs: per-group specs below ask for padding (pad_groups), whose export is part of the check."""
    torch.manual_seed(20)
    return nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 6))


@pytest.mark.parametrize(
    "spec",
    [
        QTensorConfig(dtype=Dtype.uint4, qscheme=PG, group_size=16, pad_groups=True),
        QTensorConfig(bit_width=3, qscheme=PG, group_size=32, pad_groups=True),
        QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e5m2),
        QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp6_e3m2),
        QTensorConfig(dtype=Dtype.fp4, qscheme=QSchemeType.per_channel),
        QTensorConfig(dtype=Dtype.fp6_e2m3),
        QTensorConfig(dtype=Dtype.fp8_e4m3, qscheme=PG, group_size=16, pad_groups=True),
    ],
    ids=lambda s: s.short(),
)
def test_weight_formats_export_exactly_on_token_inputs(tmp_path, spec):
    """3-D (token) inputs: the torch exporter writes the Linear weights transposed for MatMul (weights with 4/8-bit
    integer codes then become MatMulNBits, the others stay DequantizeLinear)."""
    quant = ModelQuantizer(Config(QLayerConfig(weight=spec), pre_quant_opt_config=[])).quantize_model(_mlp())
    x = torch.randn(3, 5, 48)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert report.opset == 21 and report.max_abs_diff < 1e-4
    nbits = len(_matmul_nbits(tmp_path / "m.onnx"))
    assert nbits == 2 or not spec.resolved().short().startswith(("int", "uint"))
    assert len(_weight_dequantizers(tmp_path / "m.onnx")) + nbits == 2
    assert any(spec.resolved().short().split()[0] in f or "fp" in f for f in report.formats)
    other = torch.randn(7, 5, 48)  # the batch is dynamic
    with torch.no_grad():
        np.testing.assert_allclose(run_onnx(tmp_path / "m.onnx", other)[0], quant(other).numpy(), atol=1e-4)


def test_conv_transpose_groups_run_over_its_input_channels(tmp_path):
    torch.manual_seed(21)
    model = nn.Sequential(nn.ConvTranspose2d(40, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    spec = QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=16, pad_groups=True)  # 40 / 8 inputs
    quant = ModelQuantizer(Config(QLayerConfig(weight=spec), pre_quant_opt_config=[])).quantize_model(model)
    report = export_onnx_qcdq(quant, torch.randn(2, 40, 5, 5), tmp_path / "m.onnx")
    assert report.max_abs_diff < 1e-4
    axes = sorted(onnx.helper.get_attribute_value(a) for node, _ in _weight_dequantizers(tmp_path / "m.onnx")
                  for a in node.attribute if a.name == "axis")
    assert axes == [0, 1]  # ConvTranspose weight [in, out, k, k]: groups over axis 0


@pytest.mark.parametrize(
    ("layer", "needle"),
    [
        (QLayerConfig(input_tensors=QTensorConfig(is_dynamic=True)), "dynamic activation quantization"),
        (QLayerConfig(input_tensors=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3)),
         "per-group / MX activation quantization"),
        (QLayerConfig(input_tensors=QTensorConfig(round_method=RoundType.floor)), "activation rounding FloorSte"),
        (QLayerConfig(weight=QTensorConfig(symmetric=False, zero_point_type=ZeroPointType.float32)),
         "float32 zero point"),
    ],
    ids=["dynamic", "mx activations", "floor activations", "float zero point"],
)
def test_unexportable_formats_name_format_and_target(tmp_path, layer, needle):
    quant = ModelQuantizer(Config(layer, pre_quant_opt_config=[])).quantize_model(_mlp(), [torch.randn(8, 48)])
    with pytest.raises(ExportError) as info:
        export_onnx_qcdq(quant, torch.randn(2, 48), tmp_path / "m.onnx")
    assert needle in str(info.value) and "ONNX QCDQ for onnxruntime" in str(info.value)
    assert not (tmp_path / "m.onnx").exists()


def test_blocked_weights_need_opset_21(tmp_path):
    spec = QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=16, pad_groups=True)  # 40 / 8 inputs
    quant = ModelQuantizer(Config(QLayerConfig(weight=spec), pre_quant_opt_config=[])).quantize_model(_mlp())
    with pytest.raises(ExportError, match=r"int4 per-group g16 \(weight quantizer '0.weight_quant'\).*opset 13.*21"):
        export_onnx_qcdq(quant, torch.randn(2, 48), tmp_path / "m.onnx", opset=13)
    assert export_onnx_qcdq(quant, torch.randn(2, 48), tmp_path / "m.onnx", opset=21).opset == 21


def test_weight_rounding_exports(tmp_path):
    """Weights are written from Brevitas's codes, so any element rounding of weights exports exactly (``half_up``,
    FINN's ties-up rule, is for activations only: a ConfigError for weights, tests/export/onnx/test_ties_up.py)."""
    for method in (m for m in RoundType if m is not RoundType.half_up):
        spec = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, round_method=method)
        quant = ModelQuantizer(Config(QLayerConfig(weight=spec, input_tensors=QTensorConfig()),
                                      pre_quant_opt_config=[])).quantize_model(_mlp(), [torch.randn(8, 48)])
        report = export_onnx_qcdq(quant, torch.randn(2, 48), tmp_path / "m.onnx")
        assert report.max_abs_diff <= report.tolerance


def test_qonnx_rejects_per_group_naming_format_and_target(tmp_path):
    pytest.importorskip("qonnx")
    spec = QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4)
    quant = ModelQuantizer(Config(QLayerConfig(weight=spec), pre_quant_opt_config=[])).quantize_model(_mlp())
    with pytest.raises(ExportError, match=r"per-group / MX.*QONNX"):
        ModelExporter(tmp_path / "m.onnx").export_qonnx_model(quant, torch.randn(2, 48))


def test_blocked_int8_weights_with_int8_activations_on_token_inputs(tmp_path):
    """onnxruntime 1.31 fuses a blocked int8 DequantizeLinear + int8 activations into MatMulIntegerToFloat as if
    the scales were per channel and fails; create_ort_session disables its QDQ fusions for such files."""
    layer = QLayerConfig(weight=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8),
                         input_tensors=QTensorConfig())
    x = torch.randn(3, 5, 48)
    quant = ModelQuantizer(Config(layer, pre_quant_opt_config=[])).quantize_model(_mlp(), [x])
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert report.max_abs_diff <= report.tolerance and report.opset == 21


# ------------------------------------------------------------------------ dynamic activations


@pytest.mark.parametrize("per_token", [False, True], ids=["per-tensor", "per-token"])
@pytest.mark.parametrize("dtype", [None, Dtype.uint8], ids=["int8", "uint8"])
def test_dynamic_linear_inputs_export_to_integer_matmuls(tmp_path, per_token, dtype):
    scheme = {"qscheme": QSchemeType.per_channel} if per_token else {}
    spec = QTensorConfig(dtype=dtype, is_dynamic=True, **scheme)
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=spec),
                    pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(_mlp(), [torch.randn(4, 6, 48)])
    x = torch.randn(3, 6, 48) * 2 + 0.4  # (batch, tokens, features): scales per token differ
    report = export_onnx_qcdq(quant, x, tmp_path / "dyn.onnx")
    assert report.max_abs_diff <= report.tolerance  # PyTorch (float matmul of dequantized values) is the reference
    ops = [n.op_type for n in onnx.load(str(tmp_path / "dyn.onnx")).graph.node]
    assert ops.count("MatMulInteger") == sum(isinstance(m, torch.nn.Linear) for m in _mlp().modules())
    assert "MatMul" not in ops and ("DynamicQuantizeLinear" in ops) == (dtype is not None and not per_token)
    other = torch.randn(5, 6, 48) * 3  # another batch, other ranges: the scales are computed from it
    with torch.no_grad():
        expected = quant(other).numpy()
    assert np.abs(run_onnx(report.path, other)[0] - expected).max() <= 2 * report.tolerance


def test_fused_kernel_with_other_numerics_is_rejected(tmp_path):
    """onnxruntime 1.32 fuses MatMulInteger -> Cast -> Mul(row scale x column scale) into MatMulIntegerToFloat
    and computes wrong values for per-token scales; the exporter avoids that order, and the verification rejects
    a file written with it."""
    spec = QTensorConfig(is_dynamic=True, qscheme=QSchemeType.per_channel)
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=spec),
                    pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(_mlp(), [torch.randn(4, 6, 48)])
    x = torch.randn(3, 6, 48)
    report = export_onnx_qcdq(quant, x, tmp_path / "dyn.onnx")
    proto = onnx.load(str(report.path))
    for node in proto.graph.node:  # Mul(Mul(acc, w_scale), row_scale) -> Mul(acc, Mul(row_scale, w_scale))
        if node.op_type == "Mul" and node.name.endswith("input_quant/dequantized"):
            inner = next(n for n in proto.graph.node if n.output[0] == node.input[0])
            accumulated, weight_scale, row_scale = inner.input[0], inner.input[1], node.input[1]
            inner.input[:] = [row_scale, weight_scale]
            node.input[:] = [accumulated, inner.output[0]]
    onnx.save(proto, str(tmp_path / "fused.onnx"))
    with pytest.raises(ExportMismatchError, match="input_quant"):
        verify_onnx(quant, x, tmp_path / "fused.onnx")
