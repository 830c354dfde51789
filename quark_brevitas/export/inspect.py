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
from torch import nn

from quark_brevitas.export.args import _type_name
from quark_brevitas.export.blocked import (
    BLOCKED_OPSET,
    needs_plan,
    weight_format,
)
from quark_brevitas.export.errors import ExportArgumentError, ExportError

logger = logging.getLogger(__name__)

#: Opset used for models whose quantizers are all integer.
DEFAULT_INT_OPSET = 13
#: Lowest opset with float8 QuantizeLinear/DequantizeLinear (ONNX and onnxruntime).
MIN_FLOAT8_OPSET = 19
#: Highest opset of the TorchScript ONNX exporter that Brevitas' QCDQ export relies on.
MAX_OPSET = 20
#: Opsets below this cannot express per-channel QuantizeLinear/DequantizeLinear (``axis``).
_MIN_OPSET = 10


_DYNAMIC_ACT_PROXIES = (DynamicActQuantProxyFromInjector, DynamicActFloatQuantProxyFromInjector)


# --------------------------------------------------------------------------------------------
# Quantizer inspection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Quantizer:
    name: str
    role: str  # weight | bias | act | trunc
    fmt: str
    is_float8: bool
    planned: bool = False  # a weight written by quark_brevitas.export.blocked (per-group, MX, fp6, fp4)


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
