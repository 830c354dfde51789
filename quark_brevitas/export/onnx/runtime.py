"""Running exported ONNX files in onnxruntime (CPU).

:func:`create_ort_session` opens a file with the session settings it needs (float8 files with onnxruntime's
default options: the exporter writes them so that its rewrites keep them right, see
:mod:`quark_brevitas.export.onnx.passes.float8`), :func:`run_onnx` feeds
it tensors or arrays, and a small thread-safe cache keeps recently used sessions keyed by the file's
identity so that repeated verification does not reload them.
"""

from __future__ import annotations

import collections
import pathlib
import tempfile
import threading
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto

from quark_brevitas.export.args import PathLike, TensorArgs, normalize_args
from quark_brevitas.export.errors import ExportArgumentError, ExportError
from quark_brevitas.export.onnx.passes.graph import attr

# --------------------------------------------------------------------------------------------
# onnxruntime
# --------------------------------------------------------------------------------------------


_SESSION_CACHE: collections.OrderedDict[str, tuple[tuple[int, int, int], ort.InferenceSession]] = (
    collections.OrderedDict()
)
_SESSION_CACHE_SIZE = 4
_SESSION_LOCK = threading.Lock()
_INTEGER_CODES = frozenset({TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT8})


def _has_blocked_8bit_weights(model: onnx.ModelProto) -> bool:
    """Whether a blocked ``DequantizeLinear`` reads 8-bit integer codes: onnxruntime 1.31 fuses it with an
    int8 activation into ``MatMulIntegerToFloat`` as if the scales were per channel, and fails at run time."""
    eight_bit = {init.name for init in model.graph.initializer
                 if init.data_type in (TensorProto.INT8, TensorProto.UINT8)}
    return any(node.op_type == "DequantizeLinear" and node.input[0] in eight_bit and attr(node, "block_size", 0)
               for node in model.graph.node)


#: accuracy level of the MatMulNBits onnxruntime fuses out of a weight-only DequantizeLinear -> MatMul: 1 = float32.
_FUSED_MATMULNBITS_ACCURACY_LEVEL = "1"


def has_weight_only_dequantize_matmul(model: onnx.ModelProto) -> bool:
    """Whether a constant integer weight's ``DequantizeLinear`` feeds a ``MatMul`` whose input is float (a
    weight-only layer in the ``int4_kernel="dequantize"`` form): onnxruntime's default session fuses that into a
    ``MatMulNBits`` at accuracy level 4, int8 activations on the fly, which is not what the file says."""
    ints = {init.name for init in model.graph.initializer if init.data_type in _INTEGER_CODES}
    producers = {out: node for node in model.graph.node for out in node.output}
    weights = {node.output[0] for node in model.graph.node
               if node.op_type == "DequantizeLinear" and node.input[0] in ints}
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in weights:
            source = producers.get(node.input[0])
            if source is None or source.op_type != "DequantizeLinear":
                return True
    return False


def create_ort_session(path: PathLike) -> ort.InferenceSession:
    """Create a CPU onnxruntime session for an ONNX file written by :func:`export_onnx_qcdq`.

    Files with float8 tensors run with onnxruntime's default options, as users open them: the one
    rewrite that broke them (``ReluQuantRewrite`` dropping a ``Relu`` in front of a float8
    ``QuantizeLinear``) no longer matches the exported graph (:mod:`quark_brevitas.export.onnx.passes.float8`).
    Files with blocked 8-bit weights (MXINT8, int5-8 per group) get the QDQ fusions disabled:
    onnxruntime fuses them with int8 activations into ``MatMulIntegerToFloat`` as if their
    scales were per channel and fails at run time. Every other file of the default export runs with
    onnxruntime's default (fully optimized) settings: a file must be right as users open it, so weight-only
    Linear layers are ``MatMulNBits`` nodes that carry their ``accuracy_level`` (1, float32;
    :mod:`quark_brevitas.export.onnx.passes.nbits`). Only files written with ``int4_kernel="dequantize"`` (standard
    ONNX, for other runtimes) that hold weight-only ``DequantizeLinear -> MatMul`` layers are opened with
    ``session.qdq_matmulnbits_accuracy_level=1``, because onnxruntime would otherwise fuse them at level 4
    (:func:`has_weight_only_dequantize_matmul`); users of such files in onnxruntime must set it too.
    """
    file = pathlib.Path(path)
    if not file.is_file():
        raise ExportError(f"ONNX file {file} does not exist")
    options = ort.SessionOptions()
    header = onnx.load(str(file), load_external_data=False)
    if _has_blocked_8bit_weights(header):
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if has_weight_only_dequantize_matmul(header):
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", _FUSED_MATMULNBITS_ACCURACY_LEVEL)
    try:
        return ort.InferenceSession(
            str(file), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime (CPU) cannot load {file}: {exc}") from exc


def cached_session(path: PathLike) -> ort.InferenceSession:
    """One onnxruntime session per file (path, size and modification time), shared by the checks and decoders that
    run the same file many times: building a session costs more than a small model's run."""
    file = pathlib.Path(path).resolve()
    try:
        stat = file.stat()
    except OSError as exc:
        raise ExportError(f"ONNX file {file} does not exist") from exc
    key = str(file)
    stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    with _SESSION_LOCK:
        hit = _SESSION_CACHE.get(key)
        if hit is not None and hit[0] == stamp:
            _SESSION_CACHE.move_to_end(key)
            return hit[1]
    session = create_ort_session(file)
    with _SESSION_LOCK:
        _SESSION_CACHE[key] = (stamp, session)
        _SESSION_CACHE.move_to_end(key)
        while len(_SESSION_CACHE) > _SESSION_CACHE_SIZE:
            _SESSION_CACHE.popitem(last=False)
    return session


def forget_session(path: pathlib.Path) -> None:
    """Drop the cached session of ``path`` (the exporter calls it after rewriting the file)."""
    with _SESSION_LOCK:
        _SESSION_CACHE.pop(str(path.resolve()), None)


_ORT_NUMPY_TYPES: dict[str, type] = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def feed_array(value: torch.Tensor | np.ndarray, ort_type: str) -> np.ndarray:
    """Convert an input to numpy, casting within the same kind (float/int) to the graph's type."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        array = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    else:
        array = np.asarray(value)
    target = _ORT_NUMPY_TYPES.get(ort_type)
    if target is not None and array.dtype != target and array.dtype.kind == np.dtype(target).kind:
        array = array.astype(target)
    return array


def run_onnx(path: PathLike | ort.InferenceSession,
             args: TensorArgs | np.ndarray | Mapping[str, torch.Tensor | np.ndarray]) -> list[np.ndarray]:
    """Run an ONNX file with onnxruntime (CPU) on ``args`` and return its outputs.

    ``args`` is a tensor (or numpy array) or a tuple/list of them, fed positionally to the graph
    inputs, or a mapping fed by graph input name (a tokenizer's output for a file exported from a
    dict; keys the graph does not take, e.g. ``token_type_ids`` of a model that ignores them, are
    an error). ``path`` may also be a session from :func:`create_ort_session`; for a file path the
    session is cached (keyed by path, mtime, size and inode) so evaluation loops stay cheap.
    Outputs come back in graph order, which for files of :func:`export_onnx_qcdq` is the
    flattening order of the model's output.
    """
    session = path if isinstance(path, ort.InferenceSession) else cached_session(path)
    graph_inputs = session.get_inputs()
    names = ", ".join(i.name for i in graph_inputs)
    if isinstance(args, Mapping):
        given = {k: v for k, v in args.items() if v is not None}
        missing = [gi.name for gi in graph_inputs if gi.name not in given]
        extra = [k for k in given if k not in {gi.name for gi in graph_inputs}]
        if missing or extra:
            raise ExportArgumentError(f"the ONNX graph takes inputs {names}; got {', '.join(given)}")
        feed = {gi.name: feed_array(given[gi.name], gi.type) for gi in graph_inputs}
    else:
        inputs = normalize_args(args, allow_numpy=True)
        if len(graph_inputs) != len(inputs):
            raise ExportArgumentError(
                f"the ONNX graph takes {len(graph_inputs)} inputs ({names}); got {len(inputs)}"
            )
        feed = {gi.name: feed_array(x, gi.type) for gi, x in zip(graph_inputs, inputs)}
    try:
        outputs = session.run(None, feed)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime failed to run the ONNX graph: {exc}") from exc
    return [np.asarray(o) for o in outputs]


def run_model_proto(proto: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run an in-memory model (a variant of an exported file, e.g. with extra outputs) in onnxruntime with the
    session settings of :func:`create_ort_session`; outputs by name."""
    with tempfile.TemporaryDirectory(prefix="quark_brevitas_run_") as tmp:
        file = pathlib.Path(tmp) / "model.onnx"
        onnx.save_model(proto, str(file), save_as_external_data=False)
        session = create_ort_session(file)
    inputs = {gi.name: gi.type for gi in session.get_inputs()}
    try:
        outputs = session.run(None, {name: feed_array(value, inputs[name]) for name, value in feed.items()})
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime failed to run the ONNX graph: {exc}") from exc
    return {o.name: np.asarray(v) for o, v in zip(session.get_outputs(), outputs)}
