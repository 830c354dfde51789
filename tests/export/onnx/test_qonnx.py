"""Tests of quark_brevitas.export.onnx.qonnx: QONNX files written by Brevitas and executed by the qonnx package.

Done-when check: the QONNX export of the digits CNN (integer and fp8 formats) executes in qonnx and
matches PyTorch, as the ONNX QCDQ export does in onnxruntime.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from quark_brevitas import Config, Container, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig, QuantType
from quark_brevitas.cli.digits import example_input
from quark_brevitas.export import ExportArgumentError, ExportError, ExportMismatchError
from quark_brevitas.export.onnx import qonnx as export_qonnx_mod
from quark_brevitas.export.onnx.qonnx import QONNX_DOMAIN, export_qonnx, max_runtime_ir_version, run_qonnx
from quark_brevitas.extras import MissingExtraError
from quark_brevitas.types import QSchemeType, ScaleType


def _fp(e: int, m: int) -> QTensorConfig:
    return QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=e, mantissa_bit_width=m,
                         bit_width=1 + e + m)


INT_BIAS = QTensorConfig(bit_width=32)
LAYERS = {
    "w8a8": QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), output_tensors=QTensorConfig(),
                         bias=INT_BIAS),
    "w4pc_asym_a8": QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, symmetric=False),
                                 input_tensors=QTensorConfig(symmetric=False), bias=INT_BIAS),
    "w3_pof2_a6": QLayerConfig(weight=QTensorConfig(bit_width=3, scale_type=ScaleType.pof2),
                               input_tensors=QTensorConfig(bit_width=6, scale_type=ScaleType.pof2)),
    "fp8_e4m3": QLayerConfig(weight=_fp(4, 3), input_tensors=_fp(4, 3), output_tensors=_fp(4, 3)),
    "fp8_e5m2": QLayerConfig(weight=_fp(5, 2), input_tensors=_fp(5, 2)),
    "fp6_e3m2": QLayerConfig(weight=_fp(3, 2), input_tensors=_fp(3, 2)),
}
# Quantized tensors per layer: weight and input always; output and bias where the config has them.
NODES_PER_LAYER = {"w8a8": 4, "w4pc_asym_a8": 3, "w3_pof2_a6": 2, "fp8_e4m3": 3, "fp8_e5m2": 2, "fp6_e3m2": 2}



@pytest.mark.parametrize("name", sorted(LAYERS))
def test_digits_qonnx_executes_and_matches_pytorch(digits_model, digits_data, tmp_path: Path, name: str) -> None:
    quant = ModelQuantizer(Config(global_quant_config=LAYERS[name])).quantize_model(digits_model, digits_data.calib)
    example = example_input(digits_data)
    path = tmp_path / "digits_qonnx.onnx"
    report = ModelExporter(path).export_qonnx_model(quant, example)
    assert report.max_abs_diff <= report.tolerance
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_qonnx.onnx"]
    assert report.file_size == path.stat().st_size and report.input_shapes == ((8, 1, 8, 8),)
    op = "FloatQuant" if name.startswith("fp") else "Quant"
    assert report.quant_nodes == {op: 4 * NODES_PER_LAYER[name]}

    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["global_in"] and not any(i.name == "global_in" for i in graph.initializer)
    weight_quantizers = [n for n in graph.node if n.domain == QONNX_DOMAIN and n.input[0] in
                         {i.name for i in graph.initializer if len(i.dims) >= 2}]
    assert len(weight_quantizers) == 4  # the weight quantizers stay in the graph (also FloatQuant)

    # Other test images (same static batch size): qonnx and PyTorch agree on every prediction.
    images = digits_data.test.dataset.tensors[0][8:40]
    diffs, agree = [], 0
    for batch in images.split(8):
        with torch.no_grad():
            expected = quant(batch).numpy()
        actual = run_qonnx(path, batch)[0]
        diffs.append(float(np.abs(actual - expected).max()))
        agree += int((actual.argmax(1) == expected.argmax(1)).sum())
    assert max(diffs) <= report.tolerance
    assert agree == 32


def test_multiple_inputs_and_outputs(tmp_path: Path) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 4)
            self.b = nn.Linear(5, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"left": self.a(x), "right": self.b(y)}

    torch.manual_seed(0)
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(),
                                                     output_tensors=QTensorConfig()), pre_quant_opt_config=[])
    args = (torch.randn(2, 6), torch.randn(2, 5))
    quant = ModelQuantizer(config).quantize_model(TwoHeads(), [(args,)])  # (inputs, target) convention
    report = export_qonnx(quant, args, tmp_path / "two.onnx")
    assert len(report.input_names) == 2 and len(report.output_names) == 2
    outputs = run_qonnx(tmp_path / "two.onnx", args)
    with torch.no_grad():
        expected = quant(*args)
    assert np.abs(outputs[0] - expected["left"].numpy()).max() <= report.tolerance
    assert np.abs(outputs[1] - expected["right"].numpy()).max() <= report.tolerance


@pytest.fixture(scope="module")
def small_quant() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()))
    x = torch.randn(4, 2, 6, 6)
    return ModelQuantizer(config).quantize_model(model, [x]), x


def test_mismatch_is_reported_and_file_kept(small_quant, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = small_quant
    real = export_qonnx_mod.run_qonnx
    monkeypatch.setattr(export_qonnx_mod, "run_qonnx", lambda path, args: [o + 1.0 for o in real(path, args)])
    with pytest.raises(ExportMismatchError, match=r"max \|qonnx - PyTorch\| = 1 > tolerance") as info:
        export_qonnx(model, x, tmp_path / "m.onnx")
    assert info.value.max_abs_diff == pytest.approx(1.0) and (tmp_path / "m.rejected.onnx").is_file()
    assert not (tmp_path / "m.onnx").exists() and "m.rejected.onnx" in str(info.value)  # never under its name


def test_wrong_input_shape_and_arguments(small_quant, tmp_path: Path) -> None:
    model, x = small_quant
    export_qonnx(model, x, tmp_path / "s.onnx")
    with pytest.raises(ExportArgumentError, match=r"static shape \(4, 2, 6, 6\)"):
        run_qonnx(tmp_path / "s.onnx", x[:1])
    with pytest.raises(ExportArgumentError, match="args must be"):
        export_qonnx(model, "x", tmp_path / "t.onnx")
    with pytest.raises(ExportError, match="opset must be an integer in 11..20"):
        export_qonnx(model, x, tmp_path / "t.onnx", opset=9)
    with pytest.raises(ExportError, match="is a directory"):
        export_qonnx(model, x, tmp_path)
    assert model.training is False


def test_missing_qonnx_is_explained(small_quant, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = small_quant
    for name in ("qonnx.core", "qonnx.core.modelwrapper", "qonnx.core.onnx_exec"):
        monkeypatch.setitem(sys.modules, name, None)  # makes "import qonnx.core..." fail, also after earlier imports
    with pytest.raises(MissingExtraError, match=r'pip install "quark_brevitas\[qonnx\]"'):
        export_qonnx(model, x, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_ir_version_workaround_is_needed_and_scoped(small_quant, tmp_path: Path) -> None:
    """qonnx's one-node models get the installed onnx's IR version; onnxruntime may only read older ones."""
    from qonnx.core import onnx_exec
    from qonnx.core.modelwrapper import ModelWrapper

    model, x = small_quant
    export_qonnx(model, x, tmp_path / "s.onnx")
    limit = max_runtime_ir_version()
    assert 7 <= limit <= onnx.IR_VERSION
    original = onnx_exec.qonnx_make_model
    assert run_qonnx(tmp_path / "s.onnx", x)[0].shape == (4, 3)
    assert onnx_exec.qonnx_make_model is original  # restored after the run
    if limit == onnx.IR_VERSION:
        pytest.skip("the installed onnxruntime reads the installed onnx's IR version; no workaround needed")
    wrapper = ModelWrapper(str(tmp_path / "s.onnx"))
    with pytest.raises(Exception, match="IR version"):  # what users of plain qonnx hit with these versions
        onnx_exec.execute_onnx(wrapper, {wrapper.graph.input[0].name: x.numpy()})


def test_container_provides_the_qonnx_exporter(small_quant, tmp_path: Path) -> None:
    model, x = small_quant
    assert Container().qonnx_exporter() is export_qonnx  # the default provider
    calls = []

    def recording_exporter(m: nn.Module, args: torch.Tensor, path: Path):
        calls.append((m, path))
        return export_qonnx(m, args, path)

    container = Container()
    container.qonnx_exporter.override(recording_exporter)
    path = tmp_path / "c.onnx"
    report = ModelExporter(path, container=container).export_qonnx_model(model, x)
    assert calls == [(model, path)]
    # The report describes the file the container's exporter wrote, and qonnx runs that file like PyTorch.
    assert report.file_size == path.stat().st_size and report.input_shapes == ((4, 2, 6, 6),)
    assert report.quant_nodes == {"Quant": 4}  # weight and input of the Conv2d and of the Linear
    assert sorted(n.op_type for n in onnx.load(str(path)).graph.node if n.domain == QONNX_DOMAIN) == ["Quant"] * 4
    with torch.no_grad():
        expected = model(x).numpy()
    assert report.max_abs_diff <= report.tolerance
    assert np.abs(run_qonnx(path, x)[0] - expected).max() <= report.tolerance
