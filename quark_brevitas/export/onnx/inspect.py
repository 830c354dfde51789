"""Quantizer inspection, format checks and opset choice for the QCDQ export.

Walks a Brevitas model's quantization proxies, names each quantizer's format and role, rejects formats
without an ONNX/onnxruntime equivalent with an :class:`~quark_brevitas.export.ExportError` naming the
quantizer, the format and the target, and picks the opsets to try (13 for integer-only models, 19..20
for float8, the blocked-weights opset for planned weights).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from torch import nn

from quark_brevitas.brevitas_adapter import (
    export_handler_proxy_types,
    injector_value,
    is_dynamic_activation,
    is_float_quantizer,
    is_groupwise,
    iter_quantizers,
)
from quark_brevitas.export.args import type_name
from quark_brevitas.export.errors import ExportArgumentError, ExportError
from quark_brevitas.export.onnx.blocked import (
    BLOCKED_OPSET,
    needs_plan,
    weight_format,
)
from quark_brevitas.export.onnx.dynamic import is_exportable_dynamic

logger = logging.getLogger(__name__)

#: Opset used for models whose quantizers are all integer.
DEFAULT_INT_OPSET = 13
#: Lowest opset with float8 QuantizeLinear/DequantizeLinear (ONNX and onnxruntime).
MIN_FLOAT8_OPSET = 19
#: Highest opset of the TorchScript ONNX exporter that Brevitas' QCDQ export relies on.
MAX_OPSET = 20
#: Opsets below this cannot express per-channel QuantizeLinear/DequantizeLinear (``axis``).
_MIN_OPSET = 10
_MISSING = object()


# --------------------------------------------------------------------------------------------
# Quantizer inspection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantizer:
    """An enabled quantizer of the model as the QCDQ export writes it: where it is and in which format."""

    name: str
    role: str  # weight | bias | act | trunc
    fmt: str
    is_float8: bool
    planned: bool = False  # a weight written by quark_brevitas.export.onnx.blocked (per-group, MX, fp6, fp4)
    dynamic: bool = False  # a Linear input quantized at run time, written by quark_brevitas.export.onnx.dynamic


def as_int(value: object) -> int | None:
    """``value`` (a number or a 0-d tensor) rounded to an int; ``None`` if it is missing or not a number."""
    if value is None:
        return None
    try:
        return int(round(float(value)))  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return None


def _float8_name(proxy: Any) -> str:
    e = as_int(proxy.exponent_bit_width())
    m = as_int(proxy.mantissa_bit_width())
    if proxy.is_ocp:
        return f"fp8_e{e}m{m} (OCP)"
    if proxy.is_fnuz:
        return f"fp8_e{e}m{m} (FNUZ)"
    return f"fp{(e or 0) + (m or 0) + 1}_e{e}m{m}"


def target(opset: int | str) -> str:
    """How error messages name the QCDQ export at ``opset``."""
    return f"ONNX QCDQ for onnxruntime (opset {opset})"


def inspect_quantizers(model: nn.Module) -> list[Quantizer]:
    """List the enabled quantizers of ``model``; raise :class:`ExportError` for unexportable ones."""
    handled = export_handler_proxy_types(StdQCDQONNXManager)
    found: list[Quantizer] = []
    for site in iter_quantizers(model):
        name, proxy, role = site.name, site.proxy, site.kind
        where = f"{role} quantizer '{name}' ({type_name(proxy)})"
        if role == "weight" and needs_plan(proxy):
            found.append(Quantizer(name=name, role=role, fmt=weight_format(proxy), is_float8=False, planned=True))
            continue
        if role == "act" and is_exportable_dynamic(site.layer, site.attribute, proxy):
            fmt = f"{'int8' if proxy.is_signed else 'uint8'} dynamic"
            found.append(Quantizer(name=name, role=role, fmt=fmt, is_float8=False, dynamic=True))
            continue
        if role == "act" and (is_groupwise(proxy) or is_dynamic_activation(proxy)):
            kind = "per-group / MX" if is_groupwise(proxy) else "dynamic"
            raise ExportError(
                f"{kind} activation quantization ({where}) cannot be exported to {target('any')}: its scales are "
                "computed from each input at run time, QuantizeLinear/DequantizeLinear take constant scales; "
                "dynamic activations are exported for the 8-bit integer inputs of Linear layers only (per tensor "
                "or per token; per group: symmetric int8 in groups of the Linear's int4 per-group weight, inside "
                "onnxruntime's MatMulNBits). Export with static per-tensor activations (is_dynamic None, "
                "qscheme per_tensor) or one of those"
            )
        rounding = _rounding_name(proxy)
        if role == "act" and rounding not in (None, "RoundSte"):
            raise ExportError(
                f"activation rounding {rounding} ({where}) cannot be exported to {target('any')}: QuantizeLinear "
                "rounds half to even; use round_method half_even (or None) for activations to export"
            )
        if injector_value(proxy, "quantize_zero_point") is False:
            raise ExportError(
                f"float32 zero point ({where}) cannot be exported to {target('any')}: QuantizeLinear/"
                "DequantizeLinear take integer zero points; use zero_point_type int32"
            )
        is_float = is_float_quantizer(proxy)
        if is_float:
            fmt = _float8_name(proxy)
            if not (proxy.is_ocp or proxy.is_fnuz):
                raise ExportError(
                    f"{fmt} ({where}) cannot be exported to {target('>= 19')}: only fp8 e4m3/e5m2 "
                    "in the OCP or FNUZ flavour map to ONNX float8 types"
                )
        else:
            fmt = _integer_format(proxy, role, where)
        if type(proxy) not in handled:
            raise ExportError(
                f"{fmt} ({where}) cannot be exported to {target('any')}: Brevitas has no QCDQ "
                "export handler for this quantizer type"
            )
        found.append(Quantizer(name=name, role=role, fmt=fmt, is_float8=is_float))
    return found


def _integer_format(proxy: Any, role: str, where: str) -> str:
    """The name of an integer quantizer's format (``int8``, ``uint4``); :class:`ExportError` if QCDQ cannot
    hold it."""
    # Bias proxies that need the input scale warn and fail outside a forward pass: read their
    # (static) bit width from the injector instead.
    static = injector_value(proxy, "bit_width") if role == "bias" else safe_call(proxy, "bit_width")
    bit_width = as_int(static)
    signed = bool(proxy.is_signed) if proxy.is_signed is not None else True
    fmt = f"{'int' if signed else 'uint'}{bit_width if bit_width is not None else '?'}"
    if bit_width is not None and bit_width < 2:
        raise ExportError(f"{fmt} ({where}) cannot be exported to {target('any')}: binary quant")
    limit = 32 if role == "bias" else 8
    if bit_width is not None and bit_width > limit:
        raise ExportError(
            f"{fmt} ({where}) cannot be exported to {target(DEFAULT_INT_OPSET)}: "
            f"{role} quantization must be at most {limit} bits there"
        )
    if role == "bias" and not signed:
        raise ExportError(
            f"{fmt} ({where}) cannot be exported to {target('any')}: bias must be signed"
        )
    return fmt


def _rounding_name(proxy: Any) -> str | None:
    """The class name of the element rounding (``float_to_int_impl``) of ``proxy``, if it has one."""
    impl = injector_value(proxy, "float_to_int_impl", _MISSING)
    if impl is _MISSING:
        return None
    return impl.__name__ if isinstance(impl, type) else type(impl).__name__


def safe_call(obj: object, method: str) -> object:
    """``obj.method()``, or ``None`` if it fails (a value a proxy cannot give outside a forward pass)."""
    try:
        return getattr(obj, method)()
    except Exception:  # noqa: BLE001 - a missing value only weakens the pre-check
        logger.debug("could not query %s() of %s", method, type_name(obj), exc_info=True)
        return None


# --------------------------------------------------------------------------------------------
# Opset choice
# --------------------------------------------------------------------------------------------


def candidate_opsets(opset: int | None, quantizers: Sequence[Quantizer]) -> list[int]:
    """The opsets to try Brevitas's export at; files with planned weights are then converted to opset 21."""
    float8 = [q for q in quantizers if q.is_float8]
    planned = [q for q in quantizers if q.planned]
    if opset is not None and planned and not (isinstance(opset, bool) or not isinstance(opset, int)):
        if opset != BLOCKED_OPSET:
            q = planned[0]
            raise ExportError(
                f"{q.fmt} ({q.role} quantizer '{q.name}') cannot be exported to {target(opset)}: its weights are "
                f"written with DequantizeLinear on int4/int16/blocked scales, which need opset {BLOCKED_OPSET}; "
                f"use opset={BLOCKED_OPSET} or None"
            )
        opset = None
    if opset is not None:
        if isinstance(opset, bool) or not isinstance(opset, int):
            raise ExportArgumentError(f"opset must be an int or None; got {type_name(opset)}")
        if not _MIN_OPSET <= opset <= MAX_OPSET:
            raise ExportError(
                f"opset {opset} is not supported by {target(opset)}: Brevitas' TorchScript QCDQ export "
                f"handles opsets {_MIN_OPSET}..{MAX_OPSET}"
            )
        if float8 and opset < MIN_FLOAT8_OPSET:
            q = float8[0]
            raise ExportError(
                f"{q.fmt} ({q.role} quantizer '{q.name}') cannot be exported to {target(opset)}: "
                f"float8 QuantizeLinear/DequantizeLinear need opset >= {MIN_FLOAT8_OPSET}"
            )
        return [opset]
    if float8:
        return list(range(MIN_FLOAT8_OPSET, MAX_OPSET + 1))
    return [DEFAULT_INT_OPSET]


def raise_opsets(opsets: Sequence[int], minimum: int, *, requested: int | None) -> list[int]:
    """``opsets`` without those below ``minimum`` (an operation of the model needs it, e.g.
    ``scaled_dot_product_attention``: 14); :class:`ExportError` if the caller asked for a lower opset."""
    if not minimum or all(o >= minimum for o in opsets):
        return list(opsets)
    if requested is not None:
        raise ExportError(
            f"the model calls an operation (scaled_dot_product_attention) that exports to ONNX only from opset "
            f"{minimum} on; opset {requested} was asked for: use opset={minimum} or None"
        )
    kept = [o for o in opsets if o >= minimum]
    return kept or [minimum]
