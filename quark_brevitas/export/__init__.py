"""Verified ONNX QCDQ export of Brevitas-quantized models for onnxruntime.

:func:`export_onnx_qcdq` turns a Brevitas-quantized ``torch.nn.Module`` into a self-contained
ONNX file in the QCDQ style (``QuantizeLinear`` -> ``Clip`` -> ``DequantizeLinear`` around every
quantized tensor) that onnxruntime runs on CPU, and proves it: the file is executed with
onnxruntime on the example inputs and compared with the PyTorch model before the function
returns an :class:`ExportReport`.

What the function guarantees on top of ``brevitas.export.export_onnx_qcdq``:

* **Opset.** 13 for integer-only models; for models containing float8 (fp8 e4m3 / e5m2, OCP or
  FNUZ) quantizers the lowest opset >= 19 that exports and loads in onnxruntime (float8
  ``QuantizeLinear``/``DequantizeLinear`` need opset 19). Formats without an ONNX/onnxruntime
  equivalent (e.g. > 8-bit weights or activations, group-wise/MX, fp4/fp6) raise
  :class:`ExportError` naming the quantizer, the format and the target.
* **Integer storage.** Quantized weights are stored as int8/uint8 (or float8) initializers, never
  as float32: integer weights come straight from Brevitas, float8 weights (which Brevitas can only
  emit as ``QuantizeLinear(float weight)``) are constant-folded to float8 initializers, and the
  ``Clip`` Brevitas places on constant integer weights is folded too.
* **Integer kernels.** Brevitas' graph as written makes onnxruntime run most int8 layers in float,
  dequantizing the weights on every call (slower than the float model): its QDQ fusions reject a
  ``Gemm``/``Conv`` whose output goes through a non-redundant ``Relu`` before the next quantizer
  (Brevitas' signed activations have zero point 0), a ``Conv`` followed by ``Relu -> MaxPool``
  before its quantizer and a ``Flatten`` between a dequantizer and its ``Gemm``; and its own
  int8 -> uint8 activation conversion only handles adjacent Q/DQ pairs, so an integer ``Clip``
  in between leaves mismatched types that no fusion accepts. Exact graph rewrites (ReLU as an
  integer Clip after the quantizer, quantizers moved above layout ops/MaxPool and dequantizers
  below them, activations stored as uint8 with the zero point shifted by 128, weights transposed
  offline, ...) give onnxruntime complete QGemm/QLinearConv/QLinearMatMul/MatMulIntegerToFloat
  groups; see :mod:`quark_brevitas.export.onnx.passes.kernels`. ``integer_kernels=False`` skips them. Layers whose
  activations are float (weight-only) or float8 stay unfused. onnxruntime rounds the float bias of
  a layer with quantized input and weight to int32 in order to fuse it; when that breaks the
  tolerance, the biases are moved into separate ``Add`` nodes and the file is verified again
  (see :mod:`quark_brevitas.export.onnx.passes.float_bias`).
* **Clean file.** Initializers are not duplicated as graph inputs, nothing is stored as external
  data, and nothing but the ``.onnx`` file is written to the output directory (Brevitas and
  PyTorch work in a private temporary directory).
* **Verification.** See :func:`export_onnx_qcdq` for the tolerance rule; a disagreement raises
  :class:`ExportMismatchError`. Deep models whose outputs differ by propagated rounding flips are accepted only
  through the pinned check (every activation quantizer pinned to PyTorch's codes,
  :mod:`~quark_brevitas.export.onnx.pinned`).
* **Hugging Face models.** Example inputs may be a tokenizer's dict (graph inputs named after its keys, dynamic
  batch and sequence axes), SDPA attention exports at opset 14, decoder LMs without their cache or, with
  ``past_key_values=True``, with their key/value cache as graph inputs and outputs
  (:mod:`~quark_brevitas.export.onnx.kv`).
* **Dynamic int8 inputs** of Linear layers are written as their quantization and ``MatMulInteger``
  (:mod:`~quark_brevitas.export.onnx.dynamic`); 4-bit weights of weight-only layers as ``INT4``/``UINT4``.
* **Weight-only Linear layers** (int4 per group, int4/int8 per channel) become onnxruntime's ``MatMulNBits``
  (com.microsoft) holding the same codes, scales and zero points, with ``accuracy_level`` 1 (float32) in the node
  so that a default session computes what PyTorch computes, and decoding reads the packed weights directly
  (:mod:`~quark_brevitas.export.onnx.passes.nbits`); ``int4_kernel="dequantize"`` keeps the standard opset-21 form.

:func:`run_onnx` / :func:`create_ort_session` run such files in onnxruntime (CPU) with the
session settings they need: none, except for blocked 8-bit weights with quantized inputs and for
``int4_kernel="dequantize"`` files with weight-only MatMuls. Float8 files need none: onnxruntime's
default session drops a ``Relu`` in front of a float8 ``QuantizeLinear`` (``ReluQuantRewrite``), so the
exporter writes such a Relu as ``Max(x, 0)`` (:mod:`~quark_brevitas.export.onnx.passes.float8`) and the file
is right in ``onnxruntime.InferenceSession(path)``.

The package is split by target (``onnx/``, ``hf/``, ``gguf/``) and concept:
:mod:`~quark_brevitas.export.errors` (exceptions),
:mod:`~quark_brevitas.export.args` (argument checks), :mod:`~quark_brevitas.export.onnx.orchestrate` (the one
export procedure every format runs through), :mod:`~quark_brevitas.export.onnx.inspect` (quantizer inspection,
format checks, opset choice), :mod:`~quark_brevitas.export.onnx.runtime` (onnxruntime sessions),
:mod:`~quark_brevitas.export.onnx.verify` (reference outputs, tolerance, comparison),
:mod:`~quark_brevitas.export.onnx.passes` (ONNX graph passes), :mod:`~quark_brevitas.export.onnx.onnx_types` (ONNX
element types), :mod:`~quark_brevitas.export.onnx.summary` (what a written file stores),
:mod:`~quark_brevitas.export.onnx.pinned` (the pinned verification), :mod:`~quark_brevitas.export.onnx.dynamic` (dynamic
activations), :mod:`~quark_brevitas.export.hf.models` (Hugging Face checkpoints on the export side),
:mod:`~quark_brevitas.export.onnx.kv` (decoders with past key/values as graph inputs/outputs),
:mod:`~quark_brevitas.export.onnx.qcdq` (the QCDQ format), :mod:`~quark_brevitas.export.onnx.blocked` (per-group/MX/
fp6/fp4 weights in ONNX), :mod:`~quark_brevitas.export.onnx.qonnx` (the QONNX format),
:mod:`~quark_brevitas.export.hf.checkpoints` (Hugging Face checkpoints in the compressed-tensors format, and the writer
of every Hugging Face format), :mod:`~quark_brevitas.export.hf.quark` (AMD Quark's format) and
:mod:`~quark_brevitas.export.hf.folder` (what those formats share). This package
re-exports the public API only (imported on first use); the helpers are public names of those internal modules.
:mod:`~quark_brevitas.export.registry` is the table of formats (name, writers, extra, layout) the command line,
:class:`~quark_brevitas.api.ModelExporter` and the documentation read.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name -> the submodule that defines it. Imported on first use (PEP 562), so that
#: ``quark_brevitas.export.registry`` (the table of formats the command line's ``--help`` reads) loads without
#: onnx, onnxruntime, torch or Brevitas.
_PUBLIC: dict[str, str] = {
    "DEFAULT_INT_OPSET": "onnx.inspect",
    "MAX_OPSET": "onnx.inspect",
    "MIN_FLOAT8_OPSET": "onnx.inspect",
    "ExportArgumentError": "errors",
    "ExportError": "errors",
    "ExportMismatchError": "errors",
    "ExportReport": "onnx.qcdq",
    "FinnFinding": "onnx.finn_readiness",
    "QONNXExportReport": "onnx.qonnx",
    "VerificationResult": "onnx.verify",
    "create_ort_session": "onnx.runtime",
    "export_onnx_qcdq": "onnx.qcdq",
    "export_gguf": "gguf",
    "export_qonnx": "onnx.qonnx",
    "export_safetensors": "hf.checkpoints",
    "finn_readiness": "onnx.finn_readiness",
    "run_onnx": "onnx.runtime",
    "run_qonnx": "onnx.qonnx",
    "verify_onnx": "onnx.verify",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name imported from its submodule on first use (and kept); a submodule by its name."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
