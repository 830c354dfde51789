"""Verified QONNX export: Brevitas's ``Quant`` / ``FloatQuant`` graph, executed by the ``qonnx`` package.

QONNX (the format of FINN and hls4ml) keeps every quantizer as one custom node carrying scale, zero
point and bit width (``Quant``), or scale and exponent/mantissa widths (``FloatQuant``), so any bit
width from 2 to 8 bits and any minifloat (fp8 e4m3/e5m2, fp6, fp4) can be expressed, which ONNX
QCDQ cannot. onnxruntime cannot run those nodes; the ``qonnx`` package can (node by node, its own
kernels for the custom ops and onnxruntime for the standard ones). So :func:`export_qonnx` checks
the written file the way a FINN user would run it: with ``qonnx.core.onnx_exec.execute_onnx``
against the PyTorch model, with the same tolerance rule as the QCDQ export (one output
quantization step, see :func:`quark_brevitas.export.export_onnx_qcdq`).

What is added on top of ``brevitas.export.export_qonnx``:

* **Clean file.** The graph is cleaned as ``qonnx.util.cleanup`` does (shapes inferred, constants
  folded, readable names ``global_in``/``global_out``, no initializers as graph inputs), except
  that weight ``FloatQuant`` nodes are *kept*: qonnx's own cleanup would fold them into plain
  float initializers and lose the fp8 annotation. Only the ``.onnx`` file is written to the output
  directory.
* **Static shapes.** qonnx executes graphs with fixed tensor shapes, so the file has the example
  input's shapes (batch included).
* **Float weights.** As QONNX intends, each weight is stored in float32 in front of its ``Quant`` /
  ``FloatQuant`` node, which carries the format (FINN folds them when it builds hardware); the
  integer codes themselves come from :func:`quark_brevitas.export.intweights.integer_weights`.
* **Version workaround.** qonnx runs each standard node in onnxruntime through a one-node model
  that ``onnx.helper.make_model`` stamps with the installed onnx's newest IR version; onnxruntime
  may support only an older one (onnx 1.23 writes IR 14, onnxruntime 1.31 reads up to 13). While
  the check runs, those one-node models are stamped with the newest IR version the installed
  onnxruntime accepts (found once by probing), so users need no pins or patches of their own.
"""

from __future__ import annotations

import collections
import functools
import logging
import pathlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from brevitas.export import export_qonnx as _brevitas_export_qonnx
from brevitas.export.onnx.qonnx.manager import QONNXManager
from torch import nn

from quark_brevitas.brevitas_adapter import export_handler_proxy_types, is_groupwise, iter_quantizers
from quark_brevitas.export.args import Example, PathLike, TensorArgs, normalize_args, type_name
from quark_brevitas.export.errors import ExportArgumentError, ExportError, ExportMismatchError
from quark_brevitas.export.onnx.inspect import DEFAULT_INT_OPSET
from quark_brevitas.export.onnx.orchestrate import ExportFormat, GraphNames, brevitas_export, export_verified
from quark_brevitas.export.onnx.ties_up import fold_bias_quants, rewrite_ties_up
from quark_brevitas.export.onnx.verify import VerificationResult
from quark_brevitas.extras import require

__all__ = ["QONNX_DOMAIN", "QONNXExportReport", "export_qonnx", "run_qonnx"]

logger = logging.getLogger(__name__)

#: Domain of QONNX's custom quantization nodes.
QONNX_DOMAIN = "qonnx.custom_op.general"
_QUANT_OPS = ("Quant", "BipolarQuant", "FloatQuant", "Trunc")
_TARGET = "QONNX (qonnx custom ops, executed by the qonnx package)"
_PATCH_LOCK = threading.Lock()


@dataclass(frozen=True)
class QONNXExportReport:
    """What :func:`export_qonnx` wrote and how well qonnx's execution matched PyTorch.

    Attributes:
        path: The written ``.onnx`` file (self-contained, static shapes).
        opset: ONNX default-domain opset of the file.
        file_size: Size of the file in bytes.
        max_abs_diff: Largest ``|qonnx - PyTorch|`` over all outputs on the example args.
        tolerance: The tolerance ``max_abs_diff`` was checked against.
        tolerance_source: How ``tolerance`` was obtained.
        quant_nodes: Number of QONNX nodes per op type, e.g. ``{"Quant": 9}``.
        input_names: Graph input names, in the order of ``args``.
        output_names: Graph output names, in flattening order of the model's output.
        input_shapes: The (static) shapes of the graph inputs.
    """

    path: pathlib.Path
    opset: int
    file_size: int
    max_abs_diff: float
    tolerance: float
    tolerance_source: str
    quant_nodes: dict[str, int]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]


def _import_qonnx() -> Any:
    return require("qonnx.core.modelwrapper", "QONNX export")


def _check_quantizers(model: nn.Module) -> None:
    """Raise :class:`ExportError` for enabled quantizers Brevitas cannot write as QONNX nodes."""
    handled = export_handler_proxy_types(QONNXManager)
    for site in iter_quantizers(model):
        proxy = site.proxy
        where = f"{site.kind} quantizer '{site.name}' ({type_name(proxy)})"
        if is_groupwise(proxy):
            raise ExportError(f"per-group / MX quantization ({where}) cannot be exported to {_TARGET}: "
                              "Brevitas writes QONNX Quant nodes with per-tensor or per-channel scales only")
        if type(proxy) not in handled:
            raise ExportError(f"{where} cannot be exported to {_TARGET}: Brevitas has no QONNX export "
                              "handler for this quantizer type")


# --------------------------------------------------------------------------------------------
# qonnx / onnxruntime IR version workaround
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def max_runtime_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads (probed with a one-node model)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "ir_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    for version in range(onnx.IR_VERSION, 6, -1):
        probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_INT_OPSET)],
                                  ir_version=version)
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - any refusal means "not this version"
            continue
        return version
    raise ExportError("the installed onnxruntime loads no ONNX IR version between 7 and "
                      f"{onnx.IR_VERSION}; QONNX files cannot be checked")


@contextmanager
def _runtime_compatible_node_models() -> Iterator[None]:
    """Make qonnx stamp its one-node onnxruntime models with an IR version onnxruntime accepts."""
    onnx_exec = require("qonnx.core.onnx_exec", "checking a QONNX file")

    original = getattr(onnx_exec, "qonnx_make_model", None)
    limit = max_runtime_ir_version()
    if original is None or limit >= onnx.IR_VERSION:
        yield
        return

    def make_model(*args: Any, **kwargs: Any) -> onnx.ModelProto:
        model = original(*args, **kwargs)
        model.ir_version = min(model.ir_version, limit)
        return model

    with _PATCH_LOCK:
        onnx_exec.qonnx_make_model = make_model
        try:
            yield
        finally:
            onnx_exec.qonnx_make_model = original


# --------------------------------------------------------------------------------------------
# Running QONNX files
# --------------------------------------------------------------------------------------------


def _cleanup(model: Any) -> Any:
    """qonnx's cleanup, keeping every quantization node (also weight FloatQuant) in the graph."""
    from qonnx.transformation.fold_constants import FoldConstants
    from qonnx.transformation.general import (
        GiveReadableTensorNames,
        GiveUniqueNodeNames,
        GiveUniqueParameterTensors,
        RemoveStaticGraphInputs,
        RemoveUnusedTensors,
    )
    from qonnx.transformation.infer_shapes import InferShapes

    from quark_brevitas.export.onnx.empty_inputs import name_empty_inputs

    for node in model.graph.node:  # older Brevitas versions wrote another domain
        if node.op_type in _QUANT_OPS:
            node.domain = QONNX_DOMAIN
    name_empty_inputs(model.graph)  # qonnx's (and FINN's) executor needs a shape for every input
    for transform in (InferShapes(), GiveUniqueParameterTensors(),
                      FoldConstants(exclude_op_types=[*_QUANT_OPS, "QuantizeLinear", "DequantizeLinear"]),
                      RemoveUnusedTensors(), RemoveStaticGraphInputs(), GiveUniqueNodeNames(),
                      GiveReadableTensorNames()):
        model = model.transform(transform)
    return model


def run_qonnx(path: PathLike | Any, args: TensorArgs | np.ndarray) -> list[np.ndarray]:
    """Execute a QONNX file (or a qonnx ``ModelWrapper``) with the qonnx package; outputs in graph order.

    ``args`` are the positional inputs (tensors or numpy arrays) with exactly the file's static shapes.
    """
    modelwrapper = _import_qonnx()
    from qonnx.core.onnx_exec import execute_onnx

    model = path if isinstance(path, modelwrapper.ModelWrapper) else modelwrapper.ModelWrapper(str(path))
    inputs = normalize_args(args, allow_numpy=True)
    names = [i.name for i in model.graph.input]
    if len(inputs) != len(names):
        raise ExportArgumentError(f"the QONNX graph has {len(names)} inputs ({', '.join(names)}); got {len(inputs)}")
    feed = {}
    for name, value in zip(names, inputs):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        expected = tuple(model.get_tensor_shape(name))
        if tuple(array.shape) != expected:
            raise ExportArgumentError(f"input '{name}' has shape {tuple(array.shape)}; the QONNX file was exported "
                                      f"with the static shape {expected}")
        feed[name] = array
    with _runtime_compatible_node_models():
        try:
            outputs = execute_onnx(model, feed)
        except Exception as exc:
            raise ExportError(f"qonnx could not execute {path}: {type(exc).__name__}: {exc}") from exc
    return [np.asarray(outputs[o.name]) for o in model.graph.output]


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


class QONNXFormat(ExportFormat[QONNXExportReport]):
    """The QONNX steps of one :func:`export_qonnx` call (see :class:`ExportFormat` for the order)."""

    temp_prefix = "quark_brevitas_qonnx_"

    def __init__(self, *, opset: int) -> None:
        self.opset = opset
        self.modelwrapper: Any = None
        self.cleaned: Any = None

    def check_options(self) -> None:
        opset = self.opset
        if isinstance(opset, bool) or not isinstance(opset, int) or not 11 <= opset <= 20:
            raise ExportError(f"opset must be an integer in 11..20 for {_TARGET}; got {opset!r}")

    def require_tools(self) -> None:
        self.modelwrapper = _import_qonnx()

    def inspect(self, model: nn.Module) -> None:
        _check_quantizers(model)

    def require_opset(self, opset: int) -> None:
        if opset > self.opset:
            logger.info("the model calls scaled_dot_product_attention: QONNX export at opset %d instead of %d",
                        opset, self.opset)
            self.opset = opset

    def write(self, model: nn.Module, example: Example, names: GraphNames,
              workdir: pathlib.Path) -> onnx.ModelProto:
        raw_path = workdir / "brevitas_qonnx.onnx"
        brevitas_export(_brevitas_export_qonnx, QONNXManager, model, example.tensors, raw_path, opset=self.opset,
                        names=names, where=f"{_TARGET} at opset {self.opset}")
        try:
            self.cleaned = _cleanup(self.modelwrapper.ModelWrapper(str(raw_path)))
        except Exception as exc:
            raise ExportError(f"qonnx could not clean up the exported graph: {type(exc).__name__}: {exc}") from exc
        if rewrite_ties_up(self.cleaned.model):  # FINN's exact arithmetic (finn_w4a4 / finn_w2a2): its bias form too
            from qonnx.transformation.general import RemoveUnusedTensors
            from qonnx.transformation.infer_shapes import InferShapes

            fold_bias_quants(self.cleaned.model)
            self.cleaned = self.cleaned.transform(RemoveUnusedTensors()).transform(InferShapes())
        return self.cleaned.model

    def run(self, path: pathlib.Path, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        return run_qonnx(path, args)

    def explain(self, mismatch: ExportMismatchError) -> ExportMismatchError:
        return ExportMismatchError(
            f"QONNX file {mismatch.path} disagrees with PyTorch when executed by qonnx: max |qonnx - PyTorch| = "
            f"{mismatch.max_abs_diff:.6g} > tolerance {mismatch.tolerance:.6g}. The file was kept for inspection.",
            max_abs_diff=mismatch.max_abs_diff, tolerance=mismatch.tolerance, path=mismatch.path,
        )

    def report(self, proto: onnx.ModelProto, path: pathlib.Path, result: VerificationResult,
               names: GraphNames) -> QONNXExportReport:
        graph = proto.graph
        counts = collections.Counter(n.op_type for n in graph.node if n.domain == QONNX_DOMAIN)
        report = QONNXExportReport(
            path=path,
            opset=next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), self.opset),
            file_size=path.stat().st_size,
            max_abs_diff=result.max_abs_diff,
            tolerance=result.tolerance,
            tolerance_source=result.tolerance_source,
            quant_nodes=dict(sorted(counts.items())),
            input_names=tuple(i.name for i in graph.input),
            output_names=tuple(o.name for o in graph.output),
            input_shapes=tuple(tuple(self.cleaned.get_tensor_shape(i.name)) for i in graph.input),
        )
        logger.info("exported %s (QONNX, opset %d, %d bytes, %s): max |qonnx - PyTorch| = %.3g <= %.3g",
                    path, report.opset, report.file_size,
                    ", ".join(f"{v} {k}" for k, v in report.quant_nodes.items()) or "no quant nodes",
                    report.max_abs_diff, report.tolerance)
        return report


def export_qonnx(
    model: nn.Module,
    args: TensorArgs,
    path: PathLike,
    *,
    opset: int = DEFAULT_INT_OPSET,
    tolerance: float | None = None,
) -> QONNXExportReport:
    """Export a Brevitas-quantized model to a QONNX file and check it with the qonnx package.

    Args:
        model: The (calibrated) Brevitas-quantized model; run in eval mode without gradients, its
            training mode is restored afterwards.
        args: Example input: a tensor or a tuple/list of tensors. Its shapes become the file's
            (static) input shapes.
        path: Output ``.onnx`` file; its parent directory is created if missing.
        opset: ONNX opset of the standard nodes (default 13).
        tolerance: Largest accepted ``|qonnx - PyTorch|``; default one quantization step of the
            output, as for :func:`quark_brevitas.export.export_onnx_qcdq`.

    Raises:
        ExportArgumentError: an argument has the wrong type.
        ExportError: a quantizer cannot be written as QONNX, qonnx (or onnxoptimizer, which Brevitas's
            exporter needs) is missing, or qonnx cannot run the file.
        ExportMismatchError: qonnx's result differs from PyTorch's by more than the tolerance (the
            file is kept for inspection).
    """
    return export_verified(QONNXFormat(opset=opset), model, args, path, tolerance)
