"""Tests of quark_brevitas.export: verified ONNX QCDQ export of Brevitas models for onnxruntime.

The models are built with Brevitas directly (no other quark_brevitas module is used), calibrated
on a few random batches, exported, and checked by inspecting the file with ``onnx`` and running
it with onnxruntime.
"""

from __future__ import annotations

import copy
import os
import pathlib
import sys
from typing import Any

import brevitas.nn as qnn
import numpy as np
import onnx
import pytest
import torch
from brevitas.graph.calibrate import calibration_mode
from brevitas.graph.quantize import layerwise_quantize
from brevitas.quant.float_quant_ocp import (
    Fp8e4m3OCPActPerTensorFloat,
    Fp8e4m3OCPWeightPerTensorFloat,
    Fp8e5m2OCPActPerTensorFloat,
    Fp8e5m2OCPWeightPerTensorFloat,
)
from brevitas.quant.scaled_int import (
    Int8ActPerTensorFloat,
    Int8WeightPerChannelFloat,
    Int8WeightPerTensorFloat,
    Int16Bias,
    Int32Bias,
)
from onnx import TensorProto
from torch import nn

from quark_brevitas.export import (
    ExportError,
    ExportMismatchError,
    ExportReport,
    export_onnx_qcdq,
    run_onnx,
    verify_onnx,
)
from quark_brevitas.export.onnx import qcdq as export_mod

IMG = (3, 8, 8)


def _calibrate(model: nn.Module, shape: tuple[int, ...], seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    with torch.no_grad(), calibration_mode(model):
        for _ in range(4):
            model(torch.randn(8, *shape, generator=gen))
    model.train()  # export must restore this
    return model


class ConvNet(nn.Module):
    """QuantIdentity -> QuantConv2d -> QuantReLU -> QuantLinear (optionally with output quant)."""

    def __init__(
        self,
        weight_quant: type,
        act_quant: type,
        bias_quant: type | None = None,
        output_quant: type | None = None,
        conv_weight_quant: type | None = None,
    ) -> None:
        super().__init__()
        keep_qt = bias_quant is not None  # quantized bias needs the input scale (QuantTensor)
        self.inp = qnn.QuantIdentity(act_quant=act_quant, return_quant_tensor=True)
        self.conv = qnn.QuantConv2d(
            3,
            8,
            3,
            weight_quant=conv_weight_quant or weight_quant,
            bias_quant=bias_quant,
            return_quant_tensor=keep_qt,
        )
        self.relu = qnn.QuantReLU(act_quant=act_quant, return_quant_tensor=True)
        self.fc = qnn.QuantLinear(
            8 * 6 * 6, 10, weight_quant=weight_quant, bias_quant=bias_quant, output_quant=output_quant
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(self.inp(x)))
        return self.fc(x.flatten(1))


def _conv_net(seed: int = 0, **kwargs: type | None) -> ConvNet:
    torch.manual_seed(seed)
    return _calibrate(ConvNet(**kwargs), IMG, seed)


def _x(batch: int = 4, seed: int = 1, shape: tuple[int, ...] = IMG) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def _torch_out(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(x).numpy()


def _inits(path: pathlib.Path) -> dict[str, TensorProto]:
    return {i.name: i for i in onnx.load(str(path)).graph.initializer}


def _weight_inits(path: pathlib.Path) -> list[TensorProto]:
    """Initializers with >= 2 dims: the (quantized) weight tensors."""
    return [i for i in _inits(path).values() if len(i.dims) >= 2]


def _operand_inits(path: pathlib.Path, op_type: str, index: int) -> list[TensorProto]:
    """Initializers feeding operand ``index`` of every ``op_type`` node, seen through a DequantizeLinear."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    found = []
    for node in graph.node:
        if node.op_type == op_type and len(node.input) > index:
            name = node.input[index]
            dq = producer.get(name)
            if dq is not None and dq.op_type == "DequantizeLinear":
                name = dq.input[0]
            found.append(inits[name])
    return found


# ------------------------------------------------------------------------------------ int8


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[ConvNet, ExportReport]:
    model = _conv_net(
        weight_quant=Int8WeightPerTensorFloat,
        conv_weight_quant=Int8WeightPerChannelFloat,
        act_quant=Int8ActPerTensorFloat,
        bias_quant=Int32Bias,
        output_quant=Int8ActPerTensorFloat,
    )
    out_dir = tmp_path_factory.mktemp("int8") / "not" / "yet" / "there"
    report = export_onnx_qcdq(model, _x(), out_dir / "w8a8.onnx")
    return model, report


def test_int8_w8a8_int32_bias_matches_pytorch(int8_export: tuple[ConvNet, ExportReport]) -> None:
    model, report = int8_export
    assert model.training, "training mode must be restored"
    assert report.opset == 13
    assert report.path.is_file()
    assert report.file_size == report.path.stat().st_size
    onnx_opset = {o.domain: o.version for o in onnx.load(str(report.path)).opset_import}[""]
    assert onnx_opset == 13

    # default tolerance = largest scale of the output quantizer of the last quantized op (+ eps)
    scale = float(model.fc.output_quant.scale())
    assert report.tolerance == pytest.approx(scale, rel=1e-3)
    assert "output quantizer of 'fc'" in report.tolerance_source
    assert 0.0 <= report.max_abs_diff <= report.tolerance

    # independent re-check on the example input and on a new batch of another size
    for x in (_x(), _x(batch=7, seed=5)):
        ort_out = run_onnx(report.path, x)
        assert len(ort_out) == 1 and ort_out[0].shape == (x.shape[0], 10)
        diff = float(np.abs(ort_out[0] - _torch_out(model, x)).max())
        assert diff <= report.tolerance
    model.train()

    assert report.weight_dtypes == ("INT8",)
    assert report.bias_dtypes == ("INT32",)
    assert report.formats == ("int32 bias", "int8 act", "int8 weight")
    assert report.n_quantize_nodes == 3  # input, relu and output activations; no weight Q nodes
    assert report.n_dequantize_nodes == 7  # + 2 weights + 2 biases
    assert report.input_names == ("input",) and report.output_names == ("output",)


def test_int8_weights_are_integer_and_file_is_small(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    float_model = nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)
    ).eval()
    x = _x(batch=2, shape=(256,))
    float_path = tmp_path / "float.onnx"
    torch.onnx.export(float_model, (x,), str(float_path), dynamo=False, opset_version=13)

    layer_kwargs = {
        "input_quant": Int8ActPerTensorFloat,
        "weight_quant": Int8WeightPerChannelFloat,
        "bias_quant": Int32Bias,
        "return_quant_tensor": False,
    }
    quant_model = layerwise_quantize(
        copy.deepcopy(float_model), compute_layer_map={nn.Linear: (qnn.QuantLinear, layer_kwargs)}
    )
    _calibrate(quant_model, (256,))
    report = export_onnx_qcdq(quant_model, x, tmp_path / "int8" / "model.onnx")

    weights = _weight_inits(report.path)
    assert len(weights) == 3
    assert all(w.data_type == TensorProto.INT8 and list(w.dims) == [256, 256] for w in weights)
    biases = _operand_inits(report.path, "Gemm", 2)
    assert [(b.data_type, list(b.dims)) for b in biases] == [(TensorProto.INT32, [256])] * 3
    assert [w.name for w in _operand_inits(report.path, "Gemm", 1)] == [w.name for w in weights]
    assert report.weight_dtypes == ("INT8",) and report.bias_dtypes == ("INT32",)

    ratio = report.file_size / float_path.stat().st_size
    assert 0.2 < ratio < 0.35, ratio
    assert report.max_abs_diff <= report.tolerance
    # no output quantizer on the last layer: tolerance is one 8-bit step of the output range
    ref = _torch_out(quant_model, x)
    assert report.tolerance == pytest.approx((ref.max() - ref.min()) / 255, rel=1e-3)


def test_file_is_clean_and_self_contained(int8_export: tuple[ConvNet, ExportReport]) -> None:
    _, report = int8_export
    model = onnx.load(str(report.path), load_external_data=False)
    init_names = {i.name for i in model.graph.initializer}
    assert [i.name for i in model.graph.input] == ["input"]
    assert not init_names & {i.name for i in model.graph.input}
    assert all(
        i.data_location == TensorProto.DEFAULT and not i.external_data for i in model.graph.initializer
    )
    # the (previously missing) output directory holds exactly the exported file
    assert os.listdir(report.path.parent) == ["w8a8.onnx"]
    # Brevitas' weight Clip nodes were folded into the int8 initializers
    assert report.n_folded_nodes == 2
    clips = [n for n in model.graph.node if n.op_type == "Clip"]
    assert not [c for c in clips if c.input[0] in init_names]
    # the one Clip left is QuantReLU's ReLU, moved behind its quantizer into the uint8 domain
    # (see test_export_speed_graph.py); it clips at the zero point, nothing else
    assert len(clips) == 1
    low = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == clips[0].input[1]))
    assert low.dtype == np.uint8 and int(low) == 128 and len(clips[0].input) == 2
    onnx.checker.check_model(model)


def test_exporting_twice_to_same_path_overwrites_without_leftovers(tmp_path: pathlib.Path) -> None:
    kwargs = {"weight_quant": Int8WeightPerTensorFloat, "act_quant": Int8ActPerTensorFloat}
    path = tmp_path / "m.onnx"
    first = export_onnx_qcdq(_conv_net(seed=0, **kwargs), _x(), path)
    second_model = _conv_net(seed=3, **kwargs)
    second = export_onnx_qcdq(second_model, _x(), path)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]
    # same architecture, same size: run_onnx must not serve a stale session of the first file
    assert first.file_size == second.file_size
    diff = np.abs(run_onnx(path, _x())[0] - _torch_out(second_model, _x())).max()
    assert diff <= second.tolerance


def test_int16_bias_is_stored_as_int32(tmp_path: pathlib.Path) -> None:
    model = _conv_net(
        weight_quant=Int8WeightPerChannelFloat,
        act_quant=Int8ActPerTensorFloat,
        bias_quant=Int16Bias,
    )
    report = export_onnx_qcdq(model, _x(), tmp_path / "b16.onnx")
    assert report.bias_dtypes == ("INT32",)
    assert "int16 bias" in report.formats
    assert report.max_abs_diff <= report.tolerance


# ------------------------------------------------------------------------------------ low bit / fp8


def test_4bit_per_channel_weights(tmp_path: pathlib.Path) -> None:
    model = _conv_net(
        weight_quant=Int8WeightPerChannelFloat.let(bit_width=4),
        act_quant=Int8ActPerTensorFloat,
        bias_quant=Int32Bias,
    )
    default = export_onnx_qcdq(model, _x(), tmp_path / "w4_default.onnx")
    assert default.opset == 13 and default.n_4bit_weights == 0  # W4A8 layers keep int8 codes: integer kernels
    report = export_onnx_qcdq(model, _x(), tmp_path / "w4.onnx", int4_weights=True)
    assert report.opset == 21  # INT4 initializers need opset 21
    assert report.formats == ("int32 bias", "int4 weight", "int8 act")
    assert report.n_4bit_weights == 2
    weights = _weight_inits(report.path)
    assert {w.data_type for w in weights} == {TensorProto.INT4}  # stored in 4 bits, not as int8
    for w in weights:
        values = onnx.numpy_helper.to_array(w)
        assert np.abs(values).max() == 7  # narrow-range 4 bit, per-channel max reaches the limit
        per_channel_scale = [i for i in _inits(report.path).values() if list(i.dims) == [w.dims[0]]]
        assert per_channel_scale, "per-channel scales expected"
    assert report.max_abs_diff <= report.tolerance
    diff = np.abs(run_onnx(report.path, _x(seed=9))[0] - _torch_out(model, _x(seed=9))).max()
    assert diff <= report.tolerance
    eight = _conv_net(weight_quant=Int8WeightPerChannelFloat, act_quant=Int8ActPerTensorFloat, bias_quant=Int32Bias)
    int8_report = export_onnx_qcdq(eight, _x(), tmp_path / "w8.onnx")
    w4_bytes = sum(len(w.raw_data) for w in weights)  # packed two codes per byte
    w8_bytes = sum(len(w.raw_data) for w in _weight_inits(int8_report.path))
    assert w4_bytes <= w8_bytes / 2 + 8 and report.file_size < int8_report.file_size


def test_4bit_weight_only_layers_are_stored_in_4_bits_by_default(tmp_path: pathlib.Path) -> None:
    from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
    from quark_brevitas.types import QSchemeType

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    config = Config(QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel)),
                    pre_quant_opt_config=[])
    model = ModelQuantizer(config).quantize_model(mlp)
    report = export_onnx_qcdq(model, torch.randn(4, 32), tmp_path / "w4.onnx", int4_kernel="dequantize")
    assert report.n_4bit_weights == 2 and report.opset == 21
    assert {w.data_type for w in _weight_inits(report.path)} == {TensorProto.INT4}
    assert report.max_abs_diff <= report.tolerance
    default = export_onnx_qcdq(model, torch.randn(4, 32), tmp_path / "w4_nbits.onnx")  # onnxruntime's 4-bit kernel
    assert default.weight_dtypes == ("UINT4",) and default.max_abs_diff <= default.tolerance
    ops = [n.op_type for n in onnx.load(str(default.path)).graph.node]
    assert ops.count("MatMulNBits") == 2 and "DequantizeLinear" not in ops


@pytest.mark.parametrize(
    ("weight_quant", "act_quant", "onnx_type", "fmt"),
    [
        (Fp8e4m3OCPWeightPerTensorFloat, Fp8e4m3OCPActPerTensorFloat, TensorProto.FLOAT8E4M3FN, "fp8_e4m3"),
        (Fp8e5m2OCPWeightPerTensorFloat, Fp8e5m2OCPActPerTensorFloat, TensorProto.FLOAT8E5M2, "fp8_e5m2"),
    ],
    ids=["e4m3", "e5m2"],
)
def test_fp8_export(
    tmp_path: pathlib.Path, weight_quant: type, act_quant: type, onnx_type: int, fmt: str
) -> None:
    model = _conv_net(weight_quant=weight_quant, act_quant=act_quant, output_quant=act_quant)

    with pytest.raises(ExportError, match=rf"{fmt}.*opset >= 19"):
        export_onnx_qcdq(model, _x(), tmp_path / "too_old.onnx", opset=13)

    report = export_onnx_qcdq(model, _x(), tmp_path / "fp8.onnx")
    assert report.opset == 19  # lowest opset >= 19 that works
    assert report.uses_float8
    assert model.training
    assert report.formats == (f"{fmt} (OCP) act", f"{fmt} (OCP) weight")
    weights = _weight_inits(report.path)
    assert len(weights) == 2 and {w.data_type for w in weights} == {onnx_type}
    assert report.weight_dtypes == (TensorProto.DataType.Name(onnx_type),)
    # the float32 weights Brevitas writes for fp8 are gone (folded), so are their Q nodes
    assert report.n_quantize_nodes == 3
    graph = onnx.load(str(report.path)).graph
    zero_points = {graph_init.data_type for graph_init in graph.initializer if not graph_init.dims}
    assert onnx_type in zero_points
    # fp8 output quantizer: tolerance is one step of the top binade (32 x scale e4m3, 8192 x e5m2)
    factor = 32 if fmt == "fp8_e4m3" else 8192
    scale = float(model.fc.output_quant.scale())
    assert report.tolerance == pytest.approx(factor * scale, rel=1e-3)
    assert report.max_abs_diff <= report.tolerance
    for x in (_x(), _x(batch=5, seed=11)):
        diff = float(np.abs(run_onnx(report.path, x)[0] - _torch_out(model, x)).max())
        assert diff <= scale  # in practice fp8 ORT == PyTorch to float rounding
    model.train()


# ------------------------------------------------------------------------------------ mismatch


def test_mismatch_detected_via_perturbed_onnx_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    model = _conv_net(weight_quant=Int8WeightPerTensorFloat, act_quant=Int8ActPerTensorFloat)
    real_run, real_run_proto = export_mod.run_onnx, export_mod.run_model_proto

    def perturbed(path: pathlib.Path, args: torch.Tensor) -> list[np.ndarray]:
        return [out + 0.5 for out in real_run(path, args)]

    def perturbed_proto(proto: Any, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: out + 0.5 for name, out in real_run_proto(proto, feed).items()}

    monkeypatch.setattr(export_mod, "run_onnx", perturbed)
    monkeypatch.setattr(export_mod, "run_model_proto", perturbed_proto)  # the runtime of the pinned check too
    with pytest.raises(ExportMismatchError) as info:
        export_onnx_qcdq(model, _x(), tmp_path / "bad.onnx")
    err = info.value
    assert err.max_abs_diff == pytest.approx(0.5, abs=1e-5)
    assert 0 < err.tolerance < 0.5
    assert "0.5" in str(err) and f"{err.tolerance:.6g}" in str(err)
    assert isinstance(err, ExportError) and isinstance(err, ValueError)
    assert model.training, "training mode restored on failure too"


def test_mismatch_detected_against_a_different_model(int8_export: tuple[ConvNet, ExportReport]) -> None:
    model, report = int8_export
    ok = verify_onnx(model, _x(), report.path)
    assert ok.max_abs_diff <= ok.tolerance
    assert ok.tolerance == pytest.approx(report.tolerance)

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.fc.weight.mul_(-1.0)
    with pytest.raises(ExportMismatchError, match="disagrees with PyTorch") as info:
        verify_onnx(other, _x(), report.path)
    assert info.value.max_abs_diff > info.value.tolerance
    assert f"{info.value.max_abs_diff:.6g}" in str(info.value)
    # a user tolerance wide enough accepts it
    loose = verify_onnx(other, _x(), report.path, tolerance=info.value.max_abs_diff + 1.0)
    assert loose.tolerance_source == "given by the caller"


# ------------------------------------------------------------------------------------ structure & errors


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = qnn.QuantIdentity(return_quant_tensor=True)
        self.a = qnn.QuantLinear(16, 4, output_quant=Int8ActPerTensorFloat, return_quant_tensor=True)
        self.b = qnn.QuantLinear(16, 2, bias=False)  # exported as DequantizeLinear -> Transpose -> MatMul

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.inp(x)
        return {"logits": self.a(h), "aux": (self.b(h), None)}


def test_dict_outputs_are_flattened_in_order(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = _calibrate(TwoHeads(), (16,))
    x = _x(shape=(16,))
    report = export_onnx_qcdq(model, x, tmp_path / "heads.onnx")
    assert report.output_names == ("logits", "aux.0")
    assert report.weight_dtypes == ("INT8",) and report.bias_dtypes == ("FLOAT",)  # bias not quantized
    assert not report.uses_float8
    logits, aux = run_onnx(report.path, x)
    model.eval()
    with torch.no_grad():
        ref = model(x)
    assert logits.shape == (4, 4) and aux.shape == (4, 2)
    assert np.abs(logits - ref["logits"].value.numpy()).max() <= report.tolerance
    assert np.abs(aux - ref["aux"][0].numpy()).max() <= report.tolerance


@pytest.mark.parametrize(
    ("bad_args", "culprit"),
    [
        ("not a tensor", "str"),
        ({"x": "not a tensor"}, "args\\['x'\\]"),  # dicts are keyword inputs: each value must be a tensor
        ([torch.zeros(1, *IMG), 3], "args\\[1\\]"),
    ],
    ids=["str", "dict", "list-with-int"],
)
def test_bad_args_raise(tmp_path: pathlib.Path, bad_args: object, culprit: str) -> None:
    model = ConvNet(weight_quant=Int8WeightPerTensorFloat, act_quant=Int8ActPerTensorFloat)
    target = tmp_path / "out" / "m.onnx"
    with pytest.raises(ExportError, match=culprit) as info:
        export_onnx_qcdq(model, bad_args, target)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert "torch.Tensor" in str(info.value)
    assert not target.parent.exists()


def test_unsupported_format_names_format_and_target(tmp_path: pathlib.Path) -> None:
    model = ConvNet(weight_quant=Int8WeightPerTensorFloat.let(bit_width=12), act_quant=Int8ActPerTensorFloat)
    with pytest.raises(ExportError, match=r"int12 \(weight quantizer 'conv.weight_quant'.*ONNX QCDQ"):
        export_onnx_qcdq(model, _x(), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_brevitas_failure_is_wrapped_and_model_stays_usable(tmp_path: pathlib.Path) -> None:
    model = _conv_net(weight_quant=Int8WeightPerChannelFloat, act_quant=Int8ActPerTensorFloat)
    before = _torch_out(model, _x())
    model.train()
    with pytest.raises(ExportError, match=r"opset 11.*[Oo]pset 13 is required for per-channel") as info:
        export_onnx_qcdq(model, _x(), tmp_path / "old.onnx", opset=11)
    assert "Brevitas could not export" in str(info.value)
    assert model.training
    assert os.listdir(tmp_path) == []
    # export mode was switched off again: the model computes as before and exports fine afterwards
    assert np.array_equal(_torch_out(model, _x()), before)
    report = export_onnx_qcdq(model, _x(), tmp_path / "ok.onnx")
    assert report.max_abs_diff <= report.tolerance


def test_missing_onnxoptimizer_is_explained_before_brevitas_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    model = ConvNet(weight_quant=Int8WeightPerTensorFloat, act_quant=Int8ActPerTensorFloat)
    monkeypatch.setitem(sys.modules, "onnxoptimizer", None)  # makes "import onnxoptimizer" fail
    with pytest.raises(ExportError, match="pip install onnxoptimizer"):
        export_onnx_qcdq(model, _x(), tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []
