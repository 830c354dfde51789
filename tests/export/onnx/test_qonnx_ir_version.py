"""The QONNX IR-version workaround, forced: qonnx runs the standard nodes of a QONNX graph as one-node
onnxruntime models stamped with the installed onnx's IR version; an onnxruntime that reads only older
versions refuses them, so ``run_qonnx`` restamps them with the newest version the runtime reads.

On a machine whose onnxruntime reads the installed onnx's IR version the workaround never runs (see the
skip in tests/export/onnx/test_qonnx.py). Here onnxruntime is replaced by a wrapper that refuses anything newer than
``onnx.IR_VERSION - 1``, exactly as an older onnxruntime does, and otherwise runs the real one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.export.onnx import qonnx as export_qonnx_mod
from quark_brevitas.export.onnx.qonnx import QONNXExportReport, export_qonnx, max_runtime_ir_version, run_qonnx

OLD_IR = onnx.IR_VERSION - 1


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, torch.Tensor, Path, QONNXExportReport]:
    """A small quantized Conv + Linear model and its QONNX file, written with the real onnxruntime."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()))
    x = torch.randn(4, 2, 6, 6)
    quant = ModelQuantizer(config).quantize_model(model, [x])
    path = tmp_path_factory.mktemp("qonnx_ir") / "small.onnx"
    return quant, x, path, export_qonnx(quant, x, path)


def _spy_runtime(monkeypatch: pytest.MonkeyPatch, newest_ir: int | None) -> list[onnx.ModelProto]:
    """Replace ``onnxruntime.InferenceSession`` by one that records every model it is given and, like an
    onnxruntime built for ``newest_ir``, refuses newer IR versions (``None``: accepts all). The cached
    probe of :func:`max_runtime_ir_version` is cleared so that it probes this runtime."""
    real = onnxruntime.InferenceSession
    seen: list[onnx.ModelProto] = []

    def session(model: Any, *args: Any, **kwargs: Any) -> onnxruntime.InferenceSession:
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        seen.append(proto)
        if newest_ir is not None and proto.ir_version > newest_ir:
            raise RuntimeError(f"Unsupported model IR version: {proto.ir_version}, max supported IR version: "
                               f"{newest_ir}")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    max_runtime_ir_version.cache_clear()
    return seen


@pytest.fixture(autouse=True)
def fresh_probe() -> Iterator[None]:
    """No other test sees a probe result cached against a replaced onnxruntime."""
    yield
    max_runtime_ir_version.cache_clear()


def _node_models(seen: list[onnx.ModelProto]) -> list[onnx.ModelProto]:
    """qonnx's one-node models (the probe's Identity model left out)."""
    return [m for m in seen if m.graph.name != "ir_probe"]


def test_probe_finds_the_older_runtimes_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    _spy_runtime(monkeypatch, OLD_IR)
    assert max_runtime_ir_version() == OLD_IR < onnx.IR_VERSION


def test_node_models_are_stamped_with_the_runtimes_version_and_run(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    from qonnx.core import onnx_exec
    from qonnx.core.modelwrapper import ModelWrapper

    quant, x, path, report = exported
    seen = _spy_runtime(monkeypatch, OLD_IR)
    original = onnx_exec.qonnx_make_model
    outputs = run_qonnx(path, x)
    nodes = _node_models(seen)
    assert sorted(m.graph.node[0].op_type for m in nodes) == ["Conv", "Flatten", "Gemm", "Relu"]
    assert [m.ir_version for m in nodes] == [OLD_IR] * 4
    with torch.no_grad():
        expected = quant(x).numpy()
    assert np.abs(outputs[0] - expected).max() <= report.tolerance
    assert onnx_exec.qonnx_make_model is original  # restored after the run

    # Without the workaround, qonnx's own models (the installed onnx's IR version) are refused.
    wrapper = ModelWrapper(str(path))
    with pytest.raises(Exception, match="IR version"):
        onnx_exec.execute_onnx(wrapper, {wrapper.graph.input[0].name: x.numpy()})
    assert _node_models(seen)[-1].ir_version == onnx.IR_VERSION


def test_export_is_verified_with_the_older_runtime(exported, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    quant, x, _, _ = exported
    seen = _spy_runtime(monkeypatch, OLD_IR)
    report = export_qonnx(quant, x, tmp_path / "old_runtime.onnx")
    assert report.max_abs_diff <= report.tolerance and report.quant_nodes == {"Quant": 4}
    assert {m.ir_version for m in _node_models(seen)} == {OLD_IR}


def test_node_models_are_left_alone_when_the_runtime_reads_onnxs_version(exported,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    quant, x, path, _ = exported
    seen = _spy_runtime(monkeypatch, None)
    monkeypatch.setattr(export_qonnx_mod, "max_runtime_ir_version", lambda: onnx.IR_VERSION)
    run_qonnx(path, x)
    assert [m.ir_version for m in _node_models(seen)] == [onnx.IR_VERSION] * 4
