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
  groups; see ``_INTEGER_KERNEL_REWRITES``. ``integer_kernels=False`` skips them. Layers whose
  activations are float (weight-only) or float8 stay unfused. onnxruntime rounds the float bias of
  a layer with quantized input and weight to int32 in order to fuse it; when that breaks the
  tolerance, the biases are moved into separate ``Add`` nodes and the file is verified again
  (see ``_move_float_biases_out``).
* **Clean file.** Initializers are not duplicated as graph inputs, nothing is stored as external
  data, and nothing but the ``.onnx`` file is written to the output directory (Brevitas and
  PyTorch work in a private temporary directory).
* **Verification.** See :func:`export_onnx_qcdq` for the tolerance rule; a disagreement raises
  :class:`ExportMismatchError`.

:func:`run_onnx` / :func:`create_ort_session` run such files in onnxruntime (CPU) with the
session settings they need. onnxruntime 1.31 mis-optimizes float8 QDQ graphs with its default
settings (it fuses float8 QDQ pairs into integer-only ``QLinear*`` kernels and drops a ``Relu``
in front of a float8 ``QuantizeLinear``), so for files containing float8 tensors these helpers
disable the QDQ fusions (``session.disable_quant_qdq``) and the ``ReluQuantRewrite`` rule.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import pathlib
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import onnx
import onnxruntime as ort
import torch
from brevitas.export import export_onnx_qcdq as _brevitas_export_onnx_qcdq
from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from brevitas.nn.mixin.base import QuantLayerMixin
from brevitas.proxy.float_parameter_quant import (
    BiasFloatQuantProxyFromInjector,
    WeightFloatQuantProxyFromInjectorBase,
)
from brevitas.proxy.float_runtime_quant import (
    ActFloatQuantProxyFromInjectorBase,
    DynamicActFloatQuantProxyFromInjector,
)
from brevitas.proxy.parameter_quant import BiasQuantProxyFromInjectorBase, WeightQuantProxyFromInjectorBase
from brevitas.proxy.quant_proxy import QuantProxyFromInjector
from brevitas.proxy.runtime_quant import (
    ActQuantProxyFromInjectorBase,
    DynamicActQuantProxyFromInjector,
    TruncQuantProxyFromInjector,
)
from brevitas.quant_tensor import QuantTensor
from onnx import TensorProto, numpy_helper
from torch import nn

from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export_blocked import (
    BLOCKED_OPSET,
    float_weights,
    insert_dequantize,
    needs_plan,
    plan_weights,
    weight_format,
)

__all__ = [
    "DEFAULT_INT_OPSET",
    "MAX_OPSET",
    "MIN_FLOAT8_OPSET",
    "ExportArgumentError",
    "ExportError",
    "ExportMismatchError",
    "ExportReport",
    "VerificationResult",
    "create_ort_session",
    "export_onnx_qcdq",
    "run_onnx",
    "verify_onnx",
]

logger = logging.getLogger(__name__)

#: Opset used for models whose quantizers are all integer.
DEFAULT_INT_OPSET = 13
#: Lowest opset with float8 QuantizeLinear/DequantizeLinear (ONNX and onnxruntime).
MIN_FLOAT8_OPSET = 19
#: Highest opset of the TorchScript ONNX exporter that Brevitas' QCDQ export relies on.
MAX_OPSET = 20
#: Opsets below this cannot express per-channel QuantizeLinear/DequantizeLinear (``axis``).
_MIN_OPSET = 10
#: A self-contained ONNX file is a single protobuf, limited to 2 GiB.
_PROTOBUF_LIMIT = 2**31 - 1
#: Relative epsilon added to every tolerance so that float rounding of an exact one-step
#: difference does not count as a mismatch.
_TOLERANCE_EPS = 1e-6

TensorArgs: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
PathLike: TypeAlias = str | os.PathLike[str]

_FLOAT8_ONNX_TYPES = frozenset(
    {
        TensorProto.FLOAT8E4M3FN,
        TensorProto.FLOAT8E4M3FNUZ,
        TensorProto.FLOAT8E5M2,
        TensorProto.FLOAT8E5M2FNUZ,
    }
)
_ONNX_TO_TORCH_QTYPE: dict[int, torch.dtype] = {
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.UINT16: torch.uint16,
    TensorProto.INT32: torch.int32,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}
_DYNAMIC_ACT_PROXIES = (DynamicActQuantProxyFromInjector, DynamicActFloatQuantProxyFromInjector)
_WEIGHT_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_BIAS_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm"})
_LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# onnxruntime rewrites that are wrong for float8 QDQ graphs (see module docstring).
_FLOAT8_DISABLED_ORT_OPTIMIZERS = ("ReluQuantRewrite",)
# MatMulNBits compute precision: 1 = float32 (see create_ort_session).
_MATMULNBITS_ACCURACY_LEVEL = "1"


# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


class ExportError(QuarkBrevitasError):
    """The model, the arguments or a quantization format cannot be exported as asked."""


class ExportArgumentError(ExportError, TypeError):
    """An argument has the wrong type (also a ``TypeError``)."""


class ExportMismatchError(ExportError):
    """The exported file disagrees with PyTorch by more than the tolerance.

    ``max_abs_diff``, ``tolerance`` and ``path`` carry the numbers of the message.
    """

    def __init__(self, message: str, *, max_abs_diff: float, tolerance: float, path: pathlib.Path) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.tolerance = tolerance
        self.path = path


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_onnx_qcdq` wrote and how well it matched PyTorch.

    Attributes:
        path: The written ``.onnx`` file (self-contained).
        opset: ONNX default-domain opset of the file.
        file_size: Size of the file in bytes.
        max_abs_diff: Largest ``|onnxruntime - PyTorch|`` over all outputs on the example args.
        tolerance: The tolerance ``max_abs_diff`` was checked against.
        tolerance_source: How ``tolerance`` was obtained (user value, output quantizer, range).
        formats: Quantization formats found in the model, e.g. ``"int8 weight"``.
        weight_dtypes: ONNX types of the initializers feeding the weight operand of
            Conv/ConvTranspose/Gemm/MatMul (directly or through DequantizeLinear), e.g. ``("INT8",)``.
        bias_dtypes: Same for the bias operand of Conv/ConvTranspose/Gemm, e.g. ``("INT32",)``.
        n_quantize_nodes: Number of ``QuantizeLinear`` nodes in the file.
        n_dequantize_nodes: Number of ``DequantizeLinear`` nodes in the file.
        n_folded_nodes: Constant ``QuantizeLinear``/``Clip`` nodes folded into initializers.
        float_initializer_bytes: Bytes held by floating-point initializers (scales, float layers).
        input_names: Graph input names, in the order of ``args``.
        output_names: Graph output names, in flattening order of the model's output.
        dynamic_batch: Whether dimension 0 of every input is symbolic (``"batch"``).
        uses_float8: Whether the file holds float8 tensors (opset >= 19; run it with
            :func:`create_ort_session` / :func:`run_onnx`, see the module docstring).
        rewrites: The integer-kernel rewrites applied, as ``(description, count)`` pairs, e.g.
            ``("ReLUs moved into the integer domain", 3)``; empty with ``integer_kernels=False``.
    """

    path: pathlib.Path
    opset: int
    file_size: int
    max_abs_diff: float
    tolerance: float
    tolerance_source: str = ""
    formats: tuple[str, ...] = ()
    weight_dtypes: tuple[str, ...] = ()
    bias_dtypes: tuple[str, ...] = ()
    n_quantize_nodes: int = 0
    n_dequantize_nodes: int = 0
    n_folded_nodes: int = 0
    float_initializer_bytes: int = 0
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    dynamic_batch: bool = True
    uses_float8: bool = False
    rewrites: tuple[tuple[str, int], ...] = ()


class VerificationResult(NamedTuple):
    """Outcome of comparing an ONNX file with its PyTorch model (see :func:`verify_onnx`)."""

    max_abs_diff: float
    tolerance: float
    tolerance_source: str
    per_output: tuple[tuple[str, float], ...]


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------


def _type_name(obj: object) -> str:
    return type(obj).__qualname__


def _normalize_args(args: object, *, allow_numpy: bool = False) -> tuple[Any, ...]:
    """Return ``args`` as a non-empty tuple of tensors, or raise :class:`ExportArgumentError`."""
    allowed: tuple[type, ...] = (torch.Tensor, np.ndarray) if allow_numpy else (torch.Tensor,)
    what = "a torch.Tensor or a tuple/list of torch.Tensor" + (" / numpy.ndarray" if allow_numpy else "")
    if isinstance(args, allowed):
        return (args,)
    if isinstance(args, (tuple, list)) and not isinstance(args, QuantTensor):
        if not args:
            raise ExportArgumentError(f"args must be {what}; got an empty {_type_name(args)}")
        for i, item in enumerate(args):
            if not isinstance(item, allowed):
                raise ExportArgumentError(
                    f"args[{i}] must be {what.split(' or ')[0]}; got {_type_name(item)}"
                )
        return tuple(args)
    raise ExportArgumentError(f"args must be {what}; got {_type_name(args)}")


def _input_names(n: int) -> tuple[str, ...]:
    return ("input",) if n == 1 else tuple(f"input_{i}" for i in range(n))


# --------------------------------------------------------------------------------------------
# Output flattening
# --------------------------------------------------------------------------------------------


def _flatten_outputs(obj: object, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Flatten a model output into ``(name, tensor)`` pairs in a deterministic order.

    Tensors and QuantTensors (their ``.value``) are leaves; tuples/lists are walked in order and
    mappings (dicts, Hugging Face ``ModelOutput``) in insertion order; ``None`` is skipped.
    Names are ``"output"`` for a bare tensor, ``"output_<i>"`` / ``"<key>"`` at top level and
    dotted paths below.
    """
    if isinstance(obj, QuantTensor):
        return [(path or "output", obj.value)]
    if isinstance(obj, torch.Tensor):
        return [(path or "output", obj)]
    if obj is None:
        return []
    if isinstance(obj, Mapping):
        out: list[tuple[str, torch.Tensor]] = []
        for key, value in obj.items():
            out.extend(_flatten_outputs(value, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(obj, (tuple, list)):
        out = []
        for i, value in enumerate(obj):
            out.extend(_flatten_outputs(value, f"{path}.{i}" if path else f"output_{i}"))
        return out
    raise ExportError(
        f"model output {path or '<root>'} is a {_type_name(obj)}; ONNX export supports tensors, "
        "QuantTensors and (nested) tuples, lists and dicts of them"
    )


def _unique_names(names: Sequence[str], taken: Sequence[str]) -> tuple[str, ...]:
    seen = set(taken)
    result = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            candidate, k = f"{name}_{k}", k + 1
        seen.add(candidate)
        result.append(candidate)
    return tuple(result)


class _FlatOutputs(nn.Module):
    """Export wrapper returning the model's outputs as a flat tuple (see ``_flatten_outputs``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t for _, t in _flatten_outputs(self.model(*args)))


# --------------------------------------------------------------------------------------------
# Quantizer inspection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Quantizer:
    name: str
    role: str  # weight | bias | act | trunc
    fmt: str
    is_float8: bool
    planned: bool = False  # a weight written by quark_brevitas.export_blocked (per-group, MX, fp6, fp4)


def _handled_proxy_types() -> frozenset[type]:
    types: set[type] = set()
    for handler in StdQCDQONNXManager.handlers:
        layer = handler.handled_layer
        types.update(layer if isinstance(layer, tuple) else (layer,))
    return frozenset(types)


def _role(proxy: QuantProxyFromInjector) -> str:
    if isinstance(proxy, WeightQuantProxyFromInjectorBase):
        return "weight"
    if isinstance(proxy, (BiasQuantProxyFromInjectorBase, BiasFloatQuantProxyFromInjector)):
        return "bias"
    if isinstance(proxy, TruncQuantProxyFromInjector):
        return "trunc"
    if isinstance(proxy, ActQuantProxyFromInjectorBase):
        return "act"
    return "other"


def _as_int(value: object) -> int | None:
    if value is None:
        return None
    try:
        return int(round(float(value)))  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return None


def _float8_name(proxy: Any) -> str:
    e = _as_int(proxy.exponent_bit_width())
    m = _as_int(proxy.mantissa_bit_width())
    if proxy.is_ocp:
        return f"fp8_e{e}m{m} (OCP)"
    if proxy.is_fnuz:
        return f"fp8_e{e}m{m} (FNUZ)"
    return f"fp{(e or 0) + (m or 0) + 1}_e{e}m{m}"


def _target(opset: int | str) -> str:
    return f"ONNX QCDQ for onnxruntime (opset {opset})"


def _inspect_quantizers(model: nn.Module) -> list[_Quantizer]:
    """List the enabled quantizers of ``model``; raise :class:`ExportError` for unexportable ones."""
    handled = _handled_proxy_types()
    found: list[_Quantizer] = []
    for name, proxy in model.named_modules():
        if not isinstance(proxy, QuantProxyFromInjector) or not proxy.is_quant_enabled:
            continue
        role = _role(proxy)
        where = f"{role} quantizer '{name}' ({_type_name(proxy)})"
        if role == "weight" and needs_plan(proxy):
            found.append(_Quantizer(name=name, role=role, fmt=weight_format(proxy), is_float8=False, planned=True))
            continue
        if role == "act" and (getattr(proxy, "is_groupwise", False) or isinstance(proxy, _DYNAMIC_ACT_PROXIES)):
            kind = "per-group / MX" if getattr(proxy, "is_groupwise", False) else "dynamic"
            raise ExportError(
                f"{kind} activation quantization ({where}) cannot be exported to {_target('any')}: its scales are "
                "computed from each input at run time, QuantizeLinear/DequantizeLinear take constant scales. "
                "Export with static per-tensor activations (is_dynamic None, qscheme per_tensor)"
            )
        rounding = _rounding_name(proxy)
        if role == "act" and rounding not in (None, "RoundSte"):
            raise ExportError(
                f"activation rounding {rounding} ({where}) cannot be exported to {_target('any')}: QuantizeLinear "
                "rounds half to even; use round_method half_even (or None) for activations to export"
            )
        if _has_float_zero_point(proxy):
            raise ExportError(
                f"float32 zero point ({where}) cannot be exported to {_target('any')}: QuantizeLinear/"
                "DequantizeLinear take integer zero points; use zero_point_type int32"
            )
        is_float = isinstance(
            proxy,
            (
                WeightFloatQuantProxyFromInjectorBase,
                ActFloatQuantProxyFromInjectorBase,
                BiasFloatQuantProxyFromInjector,
            ),
        )
        if is_float:
            fmt = _float8_name(proxy)
            if not (proxy.is_ocp or proxy.is_fnuz):
                raise ExportError(
                    f"{fmt} ({where}) cannot be exported to {_target('>= 19')}: only fp8 e4m3/e5m2 "
                    "in the OCP or FNUZ flavour map to ONNX float8 types"
                )
        else:
            # Bias proxies that need the input scale warn and fail outside a forward pass: read their
            # (static) bit width from the injector instead.
            if role == "bias":
                injector = proxy.quant_injector
                bit_width = _as_int(injector.bit_width if "bit_width" in injector else None)
            else:
                bit_width = _as_int(_safe_call(proxy, "bit_width"))
            signed = bool(proxy.is_signed) if proxy.is_signed is not None else True
            fmt = f"{'int' if signed else 'uint'}{bit_width if bit_width is not None else '?'}"
            if bit_width is not None and bit_width < 2:
                raise ExportError(f"{fmt} ({where}) cannot be exported to {_target('any')}: binary quant")
            limit = 32 if role == "bias" else 8
            if bit_width is not None and bit_width > limit:
                raise ExportError(
                    f"{fmt} ({where}) cannot be exported to {_target(DEFAULT_INT_OPSET)}: "
                    f"{role} quantization must be at most {limit} bits there"
                )
            if role == "bias" and not signed:
                raise ExportError(
                    f"{fmt} ({where}) cannot be exported to {_target('any')}: bias must be signed"
                )
        if type(proxy) not in handled:
            raise ExportError(
                f"{fmt} ({where}) cannot be exported to {_target('any')}: Brevitas has no QCDQ "
                "export handler for this quantizer type"
            )
        found.append(_Quantizer(name=name, role=role, fmt=fmt, is_float8=is_float))
    return found


def _rounding_name(proxy: Any) -> str | None:
    """The class name of the element rounding (``float_to_int_impl``) of ``proxy``, if it has one."""
    injector = getattr(proxy, "quant_injector", None)
    if injector is None or "float_to_int_impl" not in injector:
        return None
    impl = injector.float_to_int_impl
    return impl.__name__ if isinstance(impl, type) else type(impl).__name__


def _has_float_zero_point(proxy: Any) -> bool:
    injector = getattr(proxy, "quant_injector", None)
    return injector is not None and "quantize_zero_point" in injector and injector.quantize_zero_point is False


def _safe_call(obj: object, method: str) -> object:
    try:
        return getattr(obj, method)()
    except Exception:  # noqa: BLE001 - a missing value only weakens the pre-check
        logger.debug("could not query %s() of %s", method, _type_name(obj), exc_info=True)
        return None


# --------------------------------------------------------------------------------------------
# Reference outputs and tolerance
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reference:
    outputs: tuple[tuple[str, torch.Tensor], ...]
    last_quant_layer: str | None
    output_step: float | None
    output_step_source: str


def _float8_top_step(proxy: Any) -> float:
    """Spacing of the largest binade of the proxy's fp8 format, in units of its scale."""
    e = _as_int(proxy.exponent_bit_width())
    m = _as_int(proxy.mantissa_bit_width())
    dtype = {
        (4, 3, True): torch.float8_e4m3fn,
        (5, 2, True): torch.float8_e5m2,
        (4, 3, False): torch.float8_e4m3fnuz,
        (5, 2, False): torch.float8_e5m2fnuz,
    }[(e, m, bool(proxy.is_ocp))]
    max_value = float(torch.finfo(dtype).max)
    return float(2.0 ** (math.floor(math.log2(max_value)) - (m or 0)))


def _output_quantizer(layer: nn.Module) -> QuantProxyFromInjector | None:
    for attr in ("output_quant", "act_quant"):
        if hasattr(layer, attr):
            proxy = getattr(layer, attr)
            if isinstance(proxy, ActQuantProxyFromInjectorBase) and proxy.is_quant_enabled:
                return proxy
            return None
    return None


def _output_step(layer_name: str, layer: nn.Module) -> tuple[float | None, str]:
    proxy = _output_quantizer(layer)
    if proxy is None:
        return None, f"last quantized op '{layer_name}' has no output quantizer"
    scale = _safe_call(proxy, "scale")
    if not isinstance(scale, torch.Tensor):
        return None, f"output quantizer of '{layer_name}' has no static scale"
    step = float(scale.detach().abs().max())
    if isinstance(proxy, ActFloatQuantProxyFromInjectorBase):
        try:
            factor = _float8_top_step(proxy)
        except (KeyError, TypeError):
            return None, f"output quantizer of '{layer_name}' has an unknown float format"
        return (
            step * factor,
            f"one fp8 step (top binade, {factor:g} x scale) of the output quantizer of '{layer_name}'",
        )
    return step, f"largest scale of the output quantizer of '{layer_name}'"


def _reference(model: nn.Module, args: tuple[torch.Tensor, ...]) -> _Reference:
    """Run ``model`` (already in eval mode) on ``args`` and record what the tolerance needs."""
    order: list[str] = []
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLayerMixin)}
    hooks = [
        m.register_forward_hook(lambda _m, _i, _o, name=name: order.append(name))
        for name, m in layers.items()
    ]
    try:
        with torch.no_grad():
            output = model(*args)
    finally:
        for hook in hooks:
            hook.remove()
    named = _flatten_outputs(output)
    if not named:
        raise ExportError("the model returned no tensor output; nothing to export")
    last = order[-1] if order else None
    if last is None:
        step, source = None, "the model has no quantized op"
    else:
        step, source = _output_step(last, layers[last])
    return _Reference(
        outputs=tuple((n, t.detach()) for n, t in named),
        last_quant_layer=last,
        output_step=step,
        output_step_source=source,
    )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype != torch.float64:
        t = t.float()
    return t.numpy()


def _default_tolerance(ref: _Reference) -> tuple[float, str]:
    arrays = [_to_numpy(t).astype(np.float64).ravel() for _, t in ref.outputs]
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    finite = values[np.isfinite(values)]
    abs_max = float(np.abs(finite).max()) if finite.size else 0.0
    eps = _TOLERANCE_EPS * max(1.0, abs_max)
    if ref.output_step is not None:
        return ref.output_step + eps, ref.output_step_source
    span = float(finite.max() - finite.min()) if finite.size else 0.0
    reason = ref.output_step_source
    return span / 255.0 + eps, f"one 8-bit step (max - min) / 255 of the reference output ({reason})"


def _compare(
    ref: _Reference, onnx_outputs: Sequence[np.ndarray], path: pathlib.Path, tolerance: float | None
) -> VerificationResult:
    if tolerance is None:
        tol, source = _default_tolerance(ref)
    else:
        tol, source = tolerance, "given by the caller"
    if len(onnx_outputs) != len(ref.outputs):
        raise ExportMismatchError(
            f"ONNX file {path} has {len(onnx_outputs)} outputs but the PyTorch model has {len(ref.outputs)} "
            f"({', '.join(n for n, _ in ref.outputs)})",
            max_abs_diff=math.inf,
            tolerance=tol,
            path=path,
        )
    per_output: list[tuple[str, float]] = []
    for (name, expected), actual in zip(ref.outputs, onnx_outputs):
        exp = _to_numpy(expected)
        act = np.asarray(actual)
        if exp.shape != act.shape:
            raise ExportMismatchError(
                f"ONNX output '{name}' of {path} has shape {act.shape}, PyTorch gives {exp.shape}",
                max_abs_diff=math.inf,
                tolerance=tol,
                path=path,
            )
        diff = np.abs(act.astype(np.float64) - exp.astype(np.float64))
        both_nan = np.isnan(act.astype(np.float64)) & np.isnan(exp.astype(np.float64))
        diff = np.where(both_nan, 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        per_output.append((name, float(diff.max()) if diff.size else 0.0))
    max_diff = max(d for _, d in per_output)
    if not max_diff <= tol:
        worst = ", ".join(f"{n}: {d:.6g}" for n, d in per_output)
        raise ExportMismatchError(
            f"ONNX file {path} disagrees with PyTorch: max |onnxruntime - PyTorch| = {max_diff:.6g} > "
            f"tolerance {tol:.6g} ({source}); per output: {worst}. The file was kept for inspection.",
            max_abs_diff=max_diff,
            tolerance=tol,
            path=path,
        )
    return VerificationResult(max_diff, tol, source, tuple(per_output))


# --------------------------------------------------------------------------------------------
# onnxruntime
# --------------------------------------------------------------------------------------------


_SESSION_CACHE: collections.OrderedDict[str, tuple[tuple[int, int, int], ort.InferenceSession]] = (
    collections.OrderedDict()
)
_SESSION_CACHE_SIZE = 4
_SESSION_LOCK = threading.Lock()


def _model_uses_float8(model: onnx.ModelProto) -> bool:
    if any(init.data_type in _FLOAT8_ONNX_TYPES for init in model.graph.initializer):
        return True
    infos = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    return any(vi.type.tensor_type.elem_type in _FLOAT8_ONNX_TYPES for vi in infos)


def _has_blocked_8bit_weights(model: onnx.ModelProto) -> bool:
    """Whether a blocked ``DequantizeLinear`` reads 8-bit integer codes: onnxruntime 1.31 fuses it with an
    int8 activation into ``MatMulIntegerToFloat`` as if the scales were per channel, and fails at run time."""
    eight_bit = {init.name for init in model.graph.initializer
                 if init.data_type in (TensorProto.INT8, TensorProto.UINT8)}
    return any(node.op_type == "DequantizeLinear" and node.input[0] in eight_bit and _attr(node, "block_size", 0)
               for node in model.graph.node)


def create_ort_session(path: PathLike) -> ort.InferenceSession:
    """Create a CPU onnxruntime session for an ONNX file written by :func:`export_onnx_qcdq`.

    For files with float8 tensors the onnxruntime QDQ fusions and the ``ReluQuantRewrite`` rule
    are disabled: with them onnxruntime 1.31 either rejects the graph (float8 fed to integer
    ``QLinearConv``/``QGemm``) or silently removes a ``Relu`` in front of a float8
    ``QuantizeLinear``. The same holds for files with blocked 8-bit weights (MXINT8, int5-8 per
    group): onnxruntime fuses them with int8 activations into ``MatMulIntegerToFloat`` as if their
    scales were per channel and fails at run time. Integer files use onnxruntime's default (fully
    optimized) settings, except that the ``MatMulNBits`` kernels onnxruntime makes of weight-only
    ``DequantizeLinear -> MatMul`` run in float32 (accuracy level 1) rather than on int8-quantized
    activations (its default, level 4).
    """
    file = pathlib.Path(path)
    if not file.is_file():
        raise ExportError(f"ONNX file {file} does not exist")
    options = ort.SessionOptions()
    # onnxruntime fuses DequantizeLinear (blocked int4/int8) -> MatMul into MatMulNBits, by default at
    # accuracy level 4, which quantizes the activations to int8 on the fly: not what the file says.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", _MATMULNBITS_ACCURACY_LEVEL)
    disabled: list[str] = []
    header = onnx.load(str(file), load_external_data=False)
    if _model_uses_float8(header) or _has_blocked_8bit_weights(header):
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        disabled = list(_FLOAT8_DISABLED_ORT_OPTIMIZERS)
    try:
        return ort.InferenceSession(
            str(file), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
        )
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime (CPU) cannot load {file}: {exc}") from exc


def _cached_session(path: PathLike) -> ort.InferenceSession:
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


def _forget_session(path: pathlib.Path) -> None:
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


def _feed_array(value: torch.Tensor | np.ndarray, ort_type: str) -> np.ndarray:
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


def run_onnx(path: PathLike | ort.InferenceSession, args: TensorArgs | np.ndarray) -> list[np.ndarray]:
    """Run an ONNX file with onnxruntime (CPU) on ``args`` and return its outputs.

    ``args`` is a tensor (or numpy array) or a tuple/list of them, fed positionally to the graph
    inputs. ``path`` may also be a session from :func:`create_ort_session`; for a file path the
    session is cached (keyed by path, mtime, size and inode) so evaluation loops stay cheap.
    Outputs come back in graph order, which for files of :func:`export_onnx_qcdq` is the
    flattening order of the model's output.
    """
    inputs = _normalize_args(args, allow_numpy=True)
    session = path if isinstance(path, ort.InferenceSession) else _cached_session(path)
    graph_inputs = session.get_inputs()
    if len(graph_inputs) != len(inputs):
        names = ", ".join(i.name for i in graph_inputs)
        raise ExportArgumentError(
            f"the ONNX graph takes {len(graph_inputs)} inputs ({names}); got {len(inputs)}"
        )
    feed = {gi.name: _feed_array(x, gi.type) for gi, x in zip(graph_inputs, inputs)}
    try:
        outputs = session.run(None, feed)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime failed to run the ONNX graph: {exc}") from exc
    return [np.asarray(o) for o in outputs]


# --------------------------------------------------------------------------------------------
# ONNX post-processing
# --------------------------------------------------------------------------------------------


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(onnx.helper.get_attribute_value(a))
    return default


def _axis_view(values: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    if values.ndim == 0:
        return values
    if ndim == 0:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return values.reshape(shape)


def _fold_quantize(node: onnx.NodeProto, inits: Mapping[str, TensorProto]) -> TensorProto | None:
    """Evaluate ``QuantizeLinear`` of a constant (ONNX semantics, round-half-to-even)."""
    if _attr(node, "block_size", 0) != 0 or _attr(node, "saturate", 1) != 1:
        return None
    x_proto, s_proto = inits[node.input[0]], inits[node.input[1]]
    zp_proto = inits[node.input[2]] if len(node.input) > 2 and node.input[2] else None
    out_type = zp_proto.data_type if zp_proto is not None else TensorProto.UINT8
    dtype = _ONNX_TO_TORCH_QTYPE.get(out_type)
    if dtype is None:
        return None
    x = torch.from_numpy(np.asarray(numpy_helper.to_array(x_proto), dtype=np.float32).copy())
    scale = torch.from_numpy(np.asarray(numpy_helper.to_array(s_proto), dtype=np.float32).copy())
    zp = (
        torch.from_numpy(np.asarray(numpy_helper.to_array(zp_proto)).astype(np.float32))
        if zp_proto is not None
        else torch.zeros(())
    )
    axis = _attr(node, "axis", 1)
    scale = _axis_view(scale, x.ndim, axis)
    zp = _axis_view(zp, x.ndim, axis)
    q = x / scale
    if dtype.is_floating_point:
        if bool((zp != 0).any()):
            return None
        limit = float(torch.finfo(dtype).max)
        q = q.clamp(-limit, limit).to(dtype)
        raw = q.contiguous().view(torch.uint8).numpy().tobytes()
        return onnx.helper.make_tensor(node.output[0], out_type, list(q.shape), raw, raw=True)
    info = torch.iinfo(dtype)
    q = (torch.round(q) + zp).clamp(info.min, info.max).to(dtype)
    return numpy_helper.from_array(q.numpy(), name=node.output[0])


def _fold_clip(node: onnx.NodeProto, inits: Mapping[str, TensorProto]) -> TensorProto | None:
    """Evaluate ``Clip`` of a constant integer tensor (Brevitas' narrow-range/low-bit weight clip)."""
    if node.attribute:
        return None
    data = numpy_helper.to_array(inits[node.input[0]])
    if not np.issubdtype(data.dtype, np.integer):
        return None
    low = numpy_helper.to_array(inits[node.input[1]]) if len(node.input) > 1 and node.input[1] else None
    high = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
    clipped = np.clip(data, low, high).astype(data.dtype)
    return numpy_helper.from_array(clipped, name=node.output[0])


def _fold_constant_quantization(graph: onnx.GraphProto) -> int:
    """Fold ``QuantizeLinear``/integer ``Clip`` nodes whose inputs are all initializers."""
    folded = 0
    changed = True
    while changed:
        changed = False
        inits = {init.name: init for init in graph.initializer}
        for node in list(graph.node):
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "Clip"):
                continue
            if not node.input or any(name and name not in inits for name in node.input):
                continue
            fold = _fold_quantize if node.op_type == "QuantizeLinear" else _fold_clip
            tensor = fold(node, inits)
            if tensor is None:
                continue
            graph.node.remove(node)
            graph.initializer.append(tensor)
            inits[tensor.name] = tensor
            folded += 1
            changed = True
    return folded


def _used_names(graph: onnx.GraphProto, used: set[str]) -> set[str]:
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _used_names(attribute.g, used)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _used_names(sub, used)
    return used


def _clean_graph(graph: onnx.GraphProto) -> None:
    """Drop unused initializers and initializers duplicated as graph inputs."""
    used = _used_names(graph, {o.name for o in graph.output})
    keep = [init for init in graph.initializer if init.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)
    init_names = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if len(inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(inputs)


def _operand_dtypes(graph: onnx.GraphProto, consumers: frozenset[str], index: int) -> tuple[str, ...]:
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    found: set[str] = set()
    for node in graph.node:
        if node.op_type not in consumers or len(node.input) <= index or not node.input[index]:
            continue
        name = node.input[index]
        producer = producers.get(name)
        # bias-free Linear layers come out as DequantizeLinear -> Transpose -> MatMul
        while producer is not None and producer.op_type in _LAYOUT_OPS:
            name = producer.input[0]
            producer = producers.get(name)
        if producer is not None and producer.op_type == "DequantizeLinear":
            name = producer.input[0]
        if name in inits:
            found.add(TensorProto.DataType.Name(inits[name].data_type))
    return tuple(sorted(found))


# --------------------------------------------------------------------------------------------
# Rewrites for onnxruntime's integer kernels
# --------------------------------------------------------------------------------------------
#
# onnxruntime executes a QDQ graph with integer kernels only where its QDQ fusions find complete
# ``DequantizeLinear -> op [-> QuantizeLinear]`` groups (QGemm, QLinearConv, QLinearMatMul,
# MatMulIntegerToFloat, integer MaxPool, ...). An op left outside such a group runs in float32
# and, worse, dequantizes its int8 weight on every call, which makes the "quantized" model slower
# than the float one. Brevitas' QCDQ graph breaks these groups in a few ways; each rewrite below
# repairs one of them. Every rewrite is exact -- the rewritten graph computes the same values as
# the original on every input, argued in its docstring. Activations are only touched where their
# QuantizeLinear/DequantizeLinear are 8-bit integer with constant scalar (per-tensor) scale and
# zero point (sub-8-bit formats are stored as int8, so they qualify); weights and biases only
# where they are constant integer initializers; float8 tensors are never touched. The exporter
# still verifies the rewritten file against PyTorch.

#: Rewrites need integer Clip and MaxPool (opset >= 12); applied from the default int opset up.
_MIN_REWRITE_OPSET = DEFAULT_INT_OPSET
_MAX_REWRITE_ROUNDS = 8
_INT8_RANGE: dict[int, tuple[int, int]] = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255)}
_NUMPY_INT8 = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8}
#: Ops that commute with an (increasing) per-tensor quantize/dequantize: they only move, copy or
#: select elements (MaxPool selects the largest, and Q/DQ preserve order).
_ORDER_PRESERVING_OPS = frozenset({"Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})


class _QParams(NamedTuple):
    """Constant scalar scale / zero point of an 8-bit integer QuantizeLinear or DequantizeLinear."""

    scale: float
    zero_point: int
    onnx_type: int  # TensorProto.INT8 or TensorProto.UINT8

    @property
    def low(self) -> int:
        return _INT8_RANGE[self.onnx_type][0]


class _GraphIndex:
    """Producers, consumers and initializers of a graph; rebuilt for every rewrite round."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {init.name: init for init in graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
        self.names = set(self.inits) | {i.name for i in graph.input} | {o.name for o in graph.output}
        for node in graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
            self.names.update(node.input)
            self.names.update(node.output)
        self.graph_outputs = {o.name for o in graph.output}

    def const(self, name: str) -> np.ndarray | None:
        init = self.inits.get(name) if name else None
        return None if init is None else numpy_helper.to_array(init)

    def sole_consumer(self, name: str) -> onnx.NodeProto | None:
        """The only node reading ``name`` (``None`` if several, none, or a graph output)."""
        users = self.consumers.get(name, [])
        if name in self.graph_outputs or len(users) != 1:
            return None
        return users[0]

    def fresh_name(self, hint: str) -> str:
        name, k = hint, 1
        while name in self.names:
            name, k = f"{hint}_{k}", k + 1
        self.names.add(name)
        return name

    def add_initializer(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh_name(hint)
        init = numpy_helper.from_array(np.asarray(array), name=name)
        self.graph.initializer.append(init)
        self.inits[name] = init
        return name


def _qparams(index: _GraphIndex, node: onnx.NodeProto) -> _QParams | None:
    """Per-tensor 8-bit integer parameters of a Q/DQ node with constant scale and zero point."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return None
    if len(node.input) < 3 or not node.input[2]:
        return None
    scale, zero_point = index.const(node.input[1]), index.const(node.input[2])
    if scale is None or zero_point is None or scale.ndim != 0 or zero_point.ndim != 0:
        return None
    onnx_type = index.inits[node.input[2]].data_type
    value = float(scale)
    if onnx_type not in _INT8_RANGE or not (math.isfinite(value) and value > 0):
        return None
    return _QParams(value, int(zero_point), onnx_type)


def _is_activation_q(index: _GraphIndex, node: onnx.NodeProto) -> _QParams | None:
    """Parameters of a QuantizeLinear of a run-time tensor, for 8-bit integer per-tensor Q."""
    if node.op_type != "QuantizeLinear" or node.input[0] in index.inits:
        return None
    return _qparams(index, node)


def _single_output(node: onnx.NodeProto) -> bool:
    return sum(1 for name in node.output if name) == 1


def _transpose_weights_offline(index: _GraphIndex) -> int:
    """``DequantizeLinear(W) -> Transpose`` becomes ``DequantizeLinear(W transposed)``.

    Bias-free Linear layers come out of Brevitas as ``DQ(W) -> Transpose -> MatMul``; a transpose
    between the DQ and the MatMul hides the MatMul from QDQ fusions (onnxruntime happens to undo
    it with its transpose optimizer, other runtimes do not). Dequantization is elementwise, so
    transposing the integer initializer and remapping a per-channel ``axis`` through ``perm``
    gives identical values.
    """
    count = 0
    for node in list(index.graph.node):
        if node.op_type != "Transpose":
            continue
        dq = index.producer.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or index.sole_consumer(dq.output[0]) is not node:
            continue
        weight = index.inits.get(dq.input[0])
        if weight is None or weight.data_type not in _INT8_RANGE:
            continue
        scale = index.const(dq.input[1])
        if scale is None or scale.ndim > 1 or _attr(dq, "block_size", 0):
            continue
        values = numpy_helper.to_array(weight)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None) or list(
            reversed(range(values.ndim))
        )
        new_attrs = [a for a in dq.attribute if a.name != "axis"]
        if scale.ndim == 1:
            axis = perm.index(_attr(dq, "axis", 1) % values.ndim)
            new_attrs.append(onnx.helper.make_attribute("axis", axis))
        dq.input[0] = index.add_initializer(np.ascontiguousarray(values.transpose(perm)), f"{weight.name}_transposed")
        del dq.attribute[:]
        dq.attribute.extend(new_attrs)
        dq.output[0] = node.output[0]
        index.graph.node.remove(node)
        count += 1
    return count


def _fold_unfusable_bias(index: _GraphIndex) -> int:
    """Dequantize offline an int32 bias whose scale is not input scale x weight scale.

    onnxruntime's QGemm/QLinearConv fusions add the int32 bias of ``DQ(bias)`` straight into the
    integer accumulator, i.e. they assume ``bias_scale == input_scale * weight_scale`` and a zero
    bias zero point without checking. Brevitas' ``Int*Bias`` quantizers satisfy this exactly
    (the scale is that very float32 product); for any other bias quantizer the fused kernel would
    be wrong, so such a bias is stored as the float32 values its DequantizeLinear produces
    (``(b - zp) * scale``, evaluated as onnxruntime does), which keeps the numbers and leaves the
    layer unfused.
    """
    count = 0
    for node in list(index.graph.node):
        if node.op_type not in _BIAS_CONSUMERS or len(node.input) < 3 or not node.input[2]:
            continue
        bias_dq = index.producer.get(node.input[2])
        if bias_dq is None or bias_dq.op_type != "DequantizeLinear":
            continue
        values = index.const(bias_dq.input[0])
        if values is None or index.inits[bias_dq.input[0]].data_type != TensorProto.INT32:
            continue
        scale = index.const(bias_dq.input[1])
        zero_point = index.const(bias_dq.input[2]) if len(bias_dq.input) > 2 and bias_dq.input[2] else np.zeros(())
        if scale is None or zero_point is None:
            continue
        if _bias_scale_matches(index, node, scale) and not np.any(zero_point):
            continue
        if index.sole_consumer(bias_dq.output[0]) is not node:
            continue
        shift = values.astype(np.int64) - zero_point.astype(np.int64)
        folded = shift.astype(np.float32) * scale.astype(np.float32)
        node.input[2] = index.add_initializer(folded.astype(np.float32), f"{bias_dq.input[0]}_float")
        index.graph.node.remove(bias_dq)
        count += 1
    return count


def _bias_scale_matches(index: _GraphIndex, node: onnx.NodeProto, bias_scale: np.ndarray) -> bool:
    scales = []
    for operand in node.input[:2]:
        dq = index.producer.get(operand)
        scale = index.const(dq.input[1]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if scale is None:
            return True  # not a fusable group: onnxruntime runs the bias DequantizeLinear itself
        scales.append(scale.astype(np.float32).reshape(-1))
    expected = scales[0] * scales[1]
    actual = bias_scale.astype(np.float32).reshape(-1)
    try:
        return bool(np.array_equal(*np.broadcast_arrays(expected, actual)))
    except ValueError:
        return False


def _hoist_quantize(index: _GraphIndex) -> int:
    """``op -> QuantizeLinear`` becomes ``QuantizeLinear -> op`` for layout ops and pooled Convs.

    A Brevitas activation quantizer sits where the next quantized layer starts, e.g. after
    ``Conv -> Relu -> MaxPool -> Flatten``, so the Conv's output never reaches a QuantizeLinear and
    cannot become a QLinearConv. Moving the quantizer up next to the producer is exact: layout
    ops only move or copy elements, and MaxPool picks maxima, which commutes with the
    non-decreasing per-tensor quantization (``Q(max(a, b)) == max(Q(a), Q(b))``). The moved ops
    then run on 8-bit integers. MaxPool is only crossed when a Conv (optionally followed by a
    Relu) feeds it: onnxruntime's integer MaxPool is fast in the NHWC layout it uses after
    QLinearConv, and ~30x slower than float MaxPool anywhere else.
    """
    count = 0
    for q in list(index.graph.node):
        if _is_activation_q(index, q) is None:
            continue
        op = index.producer.get(q.input[0])
        if op is None or op.op_type not in _ORDER_PRESERVING_OPS or not _single_output(op):
            continue
        if index.sole_consumer(op.output[0]) is not q or op.input[0] in index.inits:
            continue
        if op.op_type == "MaxPool" and not _conv_output(index, op.input[0]):
            continue
        moved = index.fresh_name(f"{op.input[0]}_quantized")
        q.input[0], op.input[0] = op.input[0], moved
        op.output[0], q.output[0] = q.output[0], moved
        count += 1
    return count


def _conv_output(index: _GraphIndex, name: str) -> bool:
    """Whether ``name`` is computed by a Conv, possibly through one Relu."""
    producer = index.producer.get(name)
    if producer is not None and producer.op_type == "Relu":
        producer = index.producer.get(producer.input[0])
    return producer is not None and producer.op_type == "Conv"


def _sink_dequantize(index: _GraphIndex) -> int:
    """``DequantizeLinear -> layout op`` becomes ``layout op -> DequantizeLinear``.

    The mirror image of :func:`_hoist_quantize`: a ``Flatten`` or ``Reshape`` between an
    activation's DequantizeLinear and the Gemm that reads it hides the Gemm from QDQ fusion.
    Exact because dequantization is elementwise and layout ops only move elements.
    """
    count = 0
    for dq in list(index.graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] in index.inits or _qparams(index, dq) is None:
            continue
        op = index.sole_consumer(dq.output[0])
        if op is None or op.op_type not in _LAYOUT_OPS or not _single_output(op):
            continue
        if op.input[0] != dq.output[0] or dq.output[0] in op.input[1:]:
            continue
        moved = index.fresh_name(f"{op.output[0]}_quantized")
        op.input[0], dq.input[0] = dq.input[0], moved
        op.output[0], dq.output[0] = moved, op.output[0]
        count += 1
    return count


def _integer_relu(index: _GraphIndex) -> int:
    """``Relu -> QuantizeLinear`` becomes ``QuantizeLinear -> Clip(min=zero point)``.

    onnxruntime only fuses ``op -> Relu -> Q`` when the Relu is redundant, i.e. when the zero
    point is the lowest code; with Brevitas' signed symmetric activations (zero point 0) it fuses
    nothing and the whole layer runs in float. Quantization is non-decreasing and ``Q(0)`` is the
    zero point, so ``Q(max(x, 0)) == max(Q(x), zp)`` exactly: the ReLU becomes an integer Clip
    after the quantizer (merged into a Brevitas low-bit Clip that is already there), or disappears
    when the zero point is the lowest code.
    """
    count = 0
    for relu in list(index.graph.node):
        if relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
            continue
        q = index.sole_consumer(relu.output[0])
        params = _is_activation_q(index, q) if q is not None else None
        if params is None:
            continue
        q.input[0] = relu.input[0]
        index.graph.node.remove(relu)
        count += 1
        if params.zero_point <= params.low:
            continue
        if _raise_clip_minimum(index, q, params):
            continue
        quantized = index.fresh_name(f"{q.output[0]}_before_relu")
        relu_clip = onnx.helper.make_node(
            "Clip", [quantized, q.input[2]], [q.output[0]], name=index.fresh_name(f"{relu.name or 'Relu'}_integer")
        )
        q.output[0] = quantized
        index.graph.node.append(relu_clip)
    return count


def _raise_clip_minimum(index: _GraphIndex, q: onnx.NodeProto, params: _QParams) -> bool:
    """Raise the lower bound of the Clip (if any) that alone reads ``q`` to ``q``'s zero point."""
    clip = index.sole_consumer(q.output[0])
    if clip is None or clip.op_type != "Clip" or clip.attribute or clip.input[0] != q.output[0]:
        return False
    low = index.const(clip.input[1]) if len(clip.input) > 1 else None
    if low is None:
        return False
    value = np.array(max(int(low), params.zero_point), dtype=_NUMPY_INT8[params.onnx_type])
    clip.input[1] = index.add_initializer(value, f"{q.output[0]}_relu_min")
    return True


def _drop_noop_integer_clips(index: _GraphIndex) -> int:
    """Remove integer Clips whose bounds include the whole range of their 8-bit type."""
    count = 0
    for clip in list(index.graph.node):
        if clip.op_type != "Clip" or clip.attribute or clip.output[0] in index.graph_outputs:
            continue
        if not _integer_clip_bounds(index, clip):
            continue
        bounds = [name for name in clip.input[1:3] if name]
        type_low, type_high = _INT8_RANGE[index.inits[bounds[0]].data_type]
        low = index.const(clip.input[1]) if len(clip.input) > 1 else None
        high = index.const(clip.input[2]) if len(clip.input) > 2 else None
        if (low is not None and int(low) > type_low) or (high is not None and int(high) < type_high):
            continue
        for user in index.consumers.get(clip.output[0], []):
            for i, name in enumerate(user.input):
                if name == clip.output[0]:
                    user.input[i] = clip.input[0]
        index.graph.node.remove(clip)
        count += 1
    return count


def _sink_integer_clips(index: _GraphIndex) -> int:
    """``integer Clip -> MaxPool`` becomes ``MaxPool -> Clip``.

    Keeps MaxPool right behind the QLinearConv, where onnxruntime runs it in NHWC
    (``NhwcMaxPool``); with a Clip in between it falls back to its slow NCHW integer MaxPool.
    Clip is non-decreasing, so it commutes with taking maxima; it also runs on 4x fewer values.
    """
    count = 0
    for clip in list(index.graph.node):
        if clip.op_type != "Clip" or clip.attribute or not _integer_clip_bounds(index, clip):
            continue
        pool = index.sole_consumer(clip.output[0])
        if pool is None or pool.op_type != "MaxPool" or not _single_output(pool) or pool.input[0] != clip.output[0]:
            continue
        pool.input[0], clip.input[0] = clip.input[0], clip.output[0]
        pool.output[0], clip.output[0] = clip.output[0], pool.output[0]
        count += 1
    return count


def _integer_clip_bounds(index: _GraphIndex, clip: onnx.NodeProto) -> bool:
    """Whether the Clip has constant 8-bit integer bounds (so its data is an 8-bit tensor)."""
    bounds = [name for name in clip.input[1:3] if name]
    return bool(bounds) and all(
        name in index.inits and index.inits[name].data_type in _INT8_RANGE for name in bounds
    )


def _int8_activation_tree(index: _GraphIndex, q: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Nodes reading the int8 output of ``q`` (through Clips and layout ops) down to its DQs.

    ``None`` if any reader is something else (or the tensor is a graph output), because then the
    int8 tensor cannot be switched to uint8 without changing that reader.
    """
    tree: list[onnx.NodeProto] = []
    pending = [q.output[0]]
    while pending:
        name = pending.pop()
        if name in index.graph_outputs:
            return None
        for user in index.consumers.get(name, []):
            if user.input[0] != name or name in user.input[1:]:
                return None
            if user.op_type == "DequantizeLinear":
                params = _qparams(index, user)
                if params is None or params.onnx_type != TensorProto.INT8:
                    return None
            elif user.op_type == "Clip" and not user.attribute:
                if any(n and (n not in index.inits or index.inits[n].data_type != TensorProto.INT8)
                       for n in user.input[1:3]):
                    return None
                pending.append(user.output[0])
            elif user.op_type in _ORDER_PRESERVING_OPS and _single_output(user):
                pending.append(user.output[0])
            else:
                return None
            tree.append(user)
    return tree


def _unsigned_activations(index: _GraphIndex) -> int:
    """Store int8 activations as uint8 with the zero point shifted by 128.

    onnxruntime's x86 integer kernels take uint8 activations (U8S8); it converts int8
    ``Q -> DQ`` pairs itself, but only adjacent pairs, so an integer Clip in between leaves
    mismatched types and no fusion. Shifting every code, zero point and Clip bound of one
    activation by +128 is exact: ``clamp(round(x / s) + zp, -128, 127) + 128 ==
    clamp(round(x / s) + zp + 128, 0, 255)`` and dequantization only sees ``q - zp``. Weights
    stay int8.
    """
    count = 0
    shifted: dict[str, str] = {}

    def shift(name: str) -> str:
        if name not in shifted:
            value = index.const(name).astype(np.int16) + 128
            shifted[name] = index.add_initializer(value.astype(np.uint8), f"{name}_uint8")
        return shifted[name]

    for q in list(index.graph.node):
        params = _is_activation_q(index, q)
        if params is None or params.onnx_type != TensorProto.INT8:
            continue
        tree = _int8_activation_tree(index, q)
        if tree is None:
            continue
        q.input[2] = shift(q.input[2])
        for node in tree:
            if node.op_type == "DequantizeLinear":
                node.input[2] = shift(node.input[2])
            elif node.op_type == "Clip":
                for i in (1, 2):
                    if len(node.input) > i and node.input[i]:
                        node.input[i] = shift(node.input[i])
        count += 1
    return count


def _drop_zero_bias_zero_points(index: _GraphIndex) -> int:
    """Drop all-zero zero points of constant int32 DequantizeLinear inputs (they are the default)."""
    count = 0
    for dq in index.graph.node:
        if dq.op_type != "DequantizeLinear" or len(dq.input) < 3 or not dq.input[2]:
            continue
        init = index.inits.get(dq.input[0])
        zero_point = index.const(dq.input[2])
        if init is None or init.data_type != TensorProto.INT32 or zero_point is None or np.any(zero_point):
            continue
        del dq.input[2]
        count += 1
    return count


_FLOAT_BIAS_REWRITE = "float biases moved out of quantized layers"


def _move_float_biases_out(model: onnx.ModelProto) -> int:
    """``Gemm/Conv(DQ(x), DQ(W), float b)`` becomes ``Gemm/Conv(DQ(x), DQ(W)) + b``.

    onnxruntime quantizes such a float bias itself (``WeightBiasQuantization``: int32 with scale
    input scale x weight scale) so that it can fuse the layer, which rounds the bias; for low bit
    widths that can move the output by more than the tolerance. Not applied by default (usually
    the rounding is harmless and the fused layer fast), but when the verification fails: as a
    separate Add the bias keeps its exact float value, a Gemm still becomes a QGemm (with float
    output) and a Conv stays unfused.
    """
    index = _GraphIndex(model.graph)
    count = 0
    for node in list(model.graph.node):
        if node.op_type not in ("Gemm", "Conv") or len(node.input) < 3 or not node.input[2]:
            continue
        bias = index.inits.get(node.input[2])
        producers = [index.producer.get(name) for name in node.input[:2]]
        if bias is None or bias.data_type != TensorProto.FLOAT:
            continue
        if any(p is None or p.op_type != "DequantizeLinear" for p in producers):
            continue
        values = numpy_helper.to_array(bias)
        if node.op_type == "Gemm":
            if any(a.name == "beta" and a.f != 1.0 for a in node.attribute):
                continue
        else:
            weight_rank = len(index.inits[producers[1].input[0]].dims) if producers[1].input[0] in index.inits else 0
            if weight_rank < 3 or values.ndim != 1:
                continue
            values = values.reshape(-1, *[1] * (weight_rank - 2))  # broadcast over N, C, spatial
        without_bias = index.fresh_name(f"{node.output[0]}_without_bias")
        add = onnx.helper.make_node(
            "Add",
            [without_bias, index.add_initializer(values.astype(np.float32), f"{node.input[2]}_broadcast")],
            [node.output[0]],
            name=index.fresh_name(f"{node.name or node.op_type}_bias"),
        )
        del node.input[2]
        node.output[0] = without_bias
        model.graph.node.append(add)
        count += 1
    if count:
        _topological_sort(model.graph)
        _clean_graph(model.graph)
    return count


_INTEGER_KERNEL_REWRITES: tuple[tuple[str, Callable[[_GraphIndex], int]], ...] = (
    ("weight transposes done offline", _transpose_weights_offline),
    ("biases dequantized offline (scale is not input x weight scale)", _fold_unfusable_bias),
    ("quantizers moved above layout ops and MaxPool", _hoist_quantize),
    ("dequantizers moved below layout ops", _sink_dequantize),
    ("ReLUs moved into the integer domain", _integer_relu),
    ("no-op integer Clips removed", _drop_noop_integer_clips),
    ("integer Clips moved below MaxPool", _sink_integer_clips),
    ("int8 activations stored as uint8", _unsigned_activations),
    ("zero bias zero points dropped", _drop_zero_bias_zero_points),
)


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for node in graph.node for a in node.attribute
    )


def _topological_sort(graph: onnx.GraphProto) -> None:
    """Order nodes topologically, keeping the existing order wherever it is already valid."""
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        for source in {producer[name] for name in node.input if name in producer}:
            waiting[i] += 1
            dependents[source].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):  # pragma: no cover - rewrites never create cycles
        raise ExportError("internal error: the rewritten ONNX graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def _rewrite_for_integer_kernels(model: onnx.ModelProto) -> tuple[tuple[str, int], ...]:
    """Apply the rewrites above until none applies; returns ``(description, count)`` pairs.

    One rewrite can enable another (a ReLU moved behind its quantizer lets the quantizer move on
    up), so the whole sequence is repeated until a round changes nothing. No rewrite undoes
    another, so this ends after a few rounds; graphs with control flow are left alone.
    """
    graph = model.graph
    if _opset_of(model) < _MIN_REWRITE_OPSET or _has_subgraphs(graph):
        return ()
    totals = dict.fromkeys((description for description, _ in _INTEGER_KERNEL_REWRITES), 0)
    for _ in range(_MAX_REWRITE_ROUNDS):
        changed = 0
        for description, rewrite in _INTEGER_KERNEL_REWRITES:
            while applied := rewrite(_GraphIndex(graph)):
                totals[description] += applied
                changed += applied
        if not changed:
            break
    _topological_sort(graph)
    done = tuple((description, n) for description, n in totals.items() if n)
    for description, n in done:
        logger.debug("integer-kernel rewrite: %s (%d)", description, n)
    return done


def _postprocess(model: onnx.ModelProto, *, integer_kernels: bool) -> tuple[int, tuple[tuple[str, int], ...]]:
    folded = _fold_constant_quantization(model.graph)
    rewrites = _rewrite_for_integer_kernels(model) if integer_kernels else ()
    _clean_graph(model.graph)
    return folded, rewrites


def _opset_of(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ExportError("exported ONNX model declares no default-domain opset")


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _candidate_opsets(opset: int | None, quantizers: Sequence[_Quantizer]) -> list[int]:
    """The opsets to try Brevitas's export at; files with planned weights are then converted to opset 21."""
    float8 = [q for q in quantizers if q.is_float8]
    planned = [q for q in quantizers if q.planned]
    if opset is not None and planned and not (isinstance(opset, bool) or not isinstance(opset, int)):
        if opset != BLOCKED_OPSET:
            q = planned[0]
            raise ExportError(
                f"{q.fmt} ({q.role} quantizer '{q.name}') cannot be exported to {_target(opset)}: its weights are "
                f"written with DequantizeLinear on int4/int16/blocked scales, which need opset {BLOCKED_OPSET}; "
                f"use opset={BLOCKED_OPSET} or None"
            )
        opset = None
    if opset is not None:
        if isinstance(opset, bool) or not isinstance(opset, int):
            raise ExportArgumentError(f"opset must be an int or None; got {_type_name(opset)}")
        if not _MIN_OPSET <= opset <= MAX_OPSET:
            raise ExportError(
                f"opset {opset} is not supported by {_target(opset)}: Brevitas' TorchScript QCDQ export "
                f"handles opsets {_MIN_OPSET}..{MAX_OPSET}"
            )
        if float8 and opset < MIN_FLOAT8_OPSET:
            q = float8[0]
            raise ExportError(
                f"{q.fmt} ({q.role} quantizer '{q.name}') cannot be exported to {_target(opset)}: "
                f"float8 QuantizeLinear/DequantizeLinear need opset >= {MIN_FLOAT8_OPSET}"
            )
        return [opset]
    if float8:
        return list(range(MIN_FLOAT8_OPSET, MAX_OPSET + 1))
    return [DEFAULT_INT_OPSET]


def _validate_tolerance(tolerance: float | None) -> float | None:
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ExportArgumentError(f"tolerance must be a float or None; got {_type_name(tolerance)}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ExportError(f"tolerance must be a finite number >= 0; got {tolerance}")
    return float(tolerance)


def _reset_export_state(model: nn.Module) -> None:
    """Best-effort cleanup after a failed Brevitas export (export mode must not leak)."""
    try:
        StdQCDQONNXManager.set_export_mode(model, enabled=False)
    except Exception:  # noqa: BLE001 - cleanup must not mask the original error
        logger.debug("could not reset Brevitas export mode", exc_info=True)
    for module in model.modules():
        if hasattr(module, "cache_inference_quant_act_backup"):
            module.cache_inference_quant_act = module.cache_inference_quant_act_backup
            del module.cache_inference_quant_act_backup


def _brevitas_export(
    wrapped: nn.Module,
    args: tuple[torch.Tensor, ...],
    target: pathlib.Path,
    *,
    opset: int,
    weight_q_node: bool,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    dynamic_batch: bool,
) -> onnx.ModelProto:
    dynamic_axes = (
        {name: {0: "batch"} for name, arg in zip(input_names, args) if arg.ndim > 0}
        if dynamic_batch
        else None
    )
    try:
        _brevitas_export_onnx_qcdq(
            wrapped,
            args=args[0] if len(args) == 1 else args,
            export_path=str(target),
            dynamo=False,
            opset_version=opset,
            export_weight_q_node=weight_q_node,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            keep_initializers_as_inputs=False,
        )
    except Exception as exc:
        _reset_export_state(wrapped)
        raise ExportError(
            f"Brevitas could not export the model to {_target(opset)}: {type(exc).__name__}: {exc}"
        ) from exc
    return onnx.load(str(target))


def _save(proto: onnx.ModelProto, path: pathlib.Path) -> None:
    try:
        onnx.save_model(proto, str(path), save_as_external_data=False)
    except ValueError as exc:
        raise ExportError(
            f"the exported model does not fit in a self-contained ONNX file (2 GiB protobuf limit): {exc}"
        ) from exc
    _forget_session(path)


def export_onnx_qcdq(
    model: nn.Module,
    args: TensorArgs,
    path: PathLike,
    *,
    opset: int | None = None,
    tolerance: float | None = None,
    dynamic_batch: bool = True,
    integer_kernels: bool = True,
) -> ExportReport:
    """Export a Brevitas-quantized model to a verified, self-contained ONNX QCDQ file.

    Args:
        model: The (calibrated) Brevitas-quantized model. It is run in eval mode under
            ``torch.no_grad()``; its training mode is restored afterwards.
        args: Example input: a tensor or a tuple/list of tensors (positional model inputs).
        path: Output ``.onnx`` file; its parent directory is created if missing. Only this file
            is written there.
        opset: ONNX opset. Default: 13 for integer-only models, the lowest opset >= 19 that
            exports and loads in onnxruntime when any float8 quantizer is present.
        tolerance: Largest accepted ``|onnxruntime - PyTorch|``. Default: one quantization step
            of the output, i.e.

            * if the last quantized op executed by the model (a Brevitas ``QuantLayer``) has an
              enabled output quantizer (``output_quant``, or ``act_quant`` of QuantReLU /
              QuantIdentity / ...): the largest scale of that quantizer; for an fp8 output
              quantizer one step of the format's top binade (scale x 32 for e4m3, x 8192 for
              e5m2), the largest spacing between its representable values;
            * otherwise one 8-bit step of the reference output's range,
              ``(max - min) / 255`` over all (flattened) reference outputs;

            plus an epsilon of ``1e-6 * max(1, max |reference|)``.
        dynamic_batch: Make dimension 0 of every input symbolic (``"batch"``), so the file runs
            on other batch sizes than the example's.
        integer_kernels: Apply the exact graph rewrites that let onnxruntime run the 8-bit integer
            layers with its integer kernels (QGemm, QLinearConv, ...; see the module docstring;
            opset >= 13, graphs with control flow are left alone). ``False`` keeps the graph as
            Brevitas writes it (constant folding only). Either way the file is verified.

    Returns:
        An :class:`ExportReport` with the file's path, opset, size, the verified difference and
        what the file stores.

    Raises:
        ExportArgumentError: ``args`` (or another argument) has the wrong type.
        ExportError: A quantization format or opset cannot be exported, Brevitas or onnxruntime
            fail on the model.
        ExportMismatchError: onnxruntime disagrees with PyTorch by more than ``tolerance``
            (the file is kept for inspection).

    Outputs (tensors, QuantTensors, nested tuples/lists/dicts, Hugging Face ``ModelOutput``)
    are flattened in a deterministic order -- sequences in order, mappings in insertion order,
    ``None`` skipped -- and become the graph outputs in that order.
    """
    if not isinstance(model, nn.Module):
        raise ExportArgumentError(f"model must be a torch.nn.Module; got {_type_name(model)}")
    example = _normalize_args(args)
    if not isinstance(path, (str, os.PathLike)):
        raise ExportArgumentError(f"path must be a str or os.PathLike; got {_type_name(path)}")
    out_path = pathlib.Path(path)
    if out_path.is_dir():
        raise ExportError(f"path {out_path} is a directory; give the .onnx file to write")
    tol = _validate_tolerance(tolerance)

    was_training = model.training
    model.eval()
    try:
        quantizers = _inspect_quantizers(model)
        opsets = _candidate_opsets(opset, quantizers)
        weight_q_node = any(q.is_float8 and q.role == "weight" for q in quantizers)
        reference = _reference(model, example)
        try:
            plans = plan_weights(model, [q.name for q in quantizers if q.planned])
        except QuarkBrevitasError as exc:
            raise ExportError(f"cannot export to {_target(BLOCKED_OPSET)}: {exc}") from exc
        input_names = _input_names(len(example))
        raw_names = [n for n, _ in reference.outputs]
        output_names = _unique_names(raw_names, input_names)
        single_tensor = len(raw_names) == 1 and raw_names[0] == "output"
        wrapped = model if single_tensor else _FlatOutputs(model)

        out_dir = out_path.parent
        before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
        errors: list[str] = []
        chosen: tuple[int, onnx.ModelProto, int, tuple[tuple[str, int], ...]] | None = None
        with tempfile.TemporaryDirectory(prefix="quark_brevitas_export_") as tmp:
            for candidate in opsets:
                try:
                    with float_weights(plans):
                        proto = _brevitas_export(
                            wrapped,
                            example,
                            pathlib.Path(tmp) / f"brevitas_opset{candidate}.onnx",
                            opset=candidate,
                            weight_q_node=weight_q_node,
                            input_names=input_names,
                            output_names=output_names,
                            dynamic_batch=dynamic_batch,
                        )
                    folded, rewrites = _postprocess(proto, integer_kernels=integer_kernels)
                    if plans:
                        try:
                            proto = insert_dequantize(proto, plans)
                        except QuarkBrevitasError as exc:
                            raise ExportError(str(exc)) from exc
                        _clean_graph(proto.graph)
                    if len(opsets) > 1:  # "lowest working opset": onnxruntime must accept the file
                        staged = pathlib.Path(tmp) / f"staged_opset{candidate}.onnx"
                        onnx.save_model(proto, str(staged))
                        create_ort_session(staged)
                except ExportError as exc:
                    errors.append(f"opset {candidate}: {exc}")
                    logger.debug("export attempt at opset %d failed: %s", candidate, exc)
                    continue
                chosen = (candidate, proto, folded, rewrites)
                break
        if chosen is None:
            formats = sorted({q.fmt for q in quantizers}) or ["float"]
            raise ExportError(
                f"cannot export {', '.join(formats)} to {_target('/'.join(map(str, opsets)))}: "
                + "; ".join(errors)
            )
        chosen_opset, proto, folded, rewrites = chosen
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as exc:
            logger.warning("onnx.checker reports a problem with %s: %s", out_path, exc)
        out_dir.mkdir(parents=True, exist_ok=True)
        _save(proto, out_path)
        stray = sorted(set(os.listdir(out_dir)) - before - {out_path.name})
        if stray:
            logger.warning(
                "files appeared in %s during export (not written by this export): %s", out_dir, stray
            )

        try:
            result = _compare(reference, run_onnx(out_path, example), out_path, tol)
        except ExportMismatchError as exc:
            moved = _move_float_biases_out(proto) if integer_kernels else 0
            if not moved:
                raise
            logger.info("%s; retrying with the float biases of %d quantized layers outside them", exc, moved)
            rewrites = (*rewrites, (_FLOAT_BIAS_REWRITE, moved))
            _save(proto, out_path)
            result = _compare(reference, run_onnx(out_path, example), out_path, tol)
    finally:
        model.train(was_training)

    graph = proto.graph
    float_types = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
    report = ExportReport(
        path=out_path,
        opset=_opset_of(proto),
        file_size=out_path.stat().st_size,
        max_abs_diff=result.max_abs_diff,
        tolerance=result.tolerance,
        tolerance_source=result.tolerance_source,
        formats=tuple(sorted({f"{q.fmt} {q.role}" for q in quantizers})),
        weight_dtypes=_operand_dtypes(graph, _WEIGHT_CONSUMERS, 1),
        bias_dtypes=_operand_dtypes(graph, _BIAS_CONSUMERS, 2),
        n_quantize_nodes=sum(n.op_type == "QuantizeLinear" for n in graph.node),
        n_dequantize_nodes=sum(n.op_type == "DequantizeLinear" for n in graph.node),
        n_folded_nodes=folded,
        rewrites=rewrites,
        float_initializer_bytes=sum(
            numpy_helper.to_array(i).nbytes for i in graph.initializer if i.data_type in float_types
        ),
        input_names=tuple(i.name for i in graph.input),
        output_names=tuple(o.name for o in graph.output),
        dynamic_batch=dynamic_batch,
        uses_float8=_model_uses_float8(proto),
    )
    logger.info(
        "exported %s (opset %d, %d bytes, weights %s): max |ORT - PyTorch| = %.3g <= %.3g",
        out_path,
        report.opset,
        report.file_size,
        ",".join(report.weight_dtypes) or "-",
        report.max_abs_diff,
        report.tolerance,
    )
    if chosen_opset != report.opset and not plans:  # pragma: no cover - defensive, torch writes what it is asked
        logger.warning("asked for opset %d, file declares %d", chosen_opset, report.opset)
    return report


def verify_onnx(
    model: nn.Module, args: TensorArgs, path: PathLike, *, tolerance: float | None = None
) -> VerificationResult:
    """Compare an ONNX file with ``model`` on ``args`` (same rules as :func:`export_onnx_qcdq`).

    Raises :class:`ExportMismatchError` when ``|onnxruntime - PyTorch|`` exceeds the tolerance.
    The model's training mode is restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise ExportArgumentError(f"model must be a torch.nn.Module; got {_type_name(model)}")
    example = _normalize_args(args)
    tol = _validate_tolerance(tolerance)
    was_training = model.training
    model.eval()
    try:
        reference = _reference(model, example)
    finally:
        model.train(was_training)
    file = pathlib.Path(path)
    return _compare(reference, run_onnx(file, example), file, tol)
