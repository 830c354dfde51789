"""The ``dtype`` short form of a QuantizationSpec: which fields each element dtype implies, and the
one-line description of a spec.

Quark lets a spec say ``dtype=int4`` or ``dtype=mx, mx_element_dtype=fp4`` instead of spelling out
``quant_type``, ``bit_width``, exponent and mantissa widths (and, for MX, the block granularity).
This module is the one table of what each short form means (:data:`DTYPE_FIELDS`, the MX tables,
:data:`REJECTED_DTYPES` with the reason each unsupported member is refused) and the function that
spells it out (:func:`resolve_dtype`). It sits below the config dataclasses and the translation
table, which both use it, so it takes a spec by shape (its fields and :func:`dataclasses.replace`)
instead of importing :class:`quark_brevitas.config.QuantizationSpec`.
"""

from __future__ import annotations

import functools
from contextlib import suppress
from dataclasses import fields, replace
from typing import Any, TypeAlias

from quark_brevitas.errors import ConfigError
from quark_brevitas.types import Dtype, QSchemeType, QuantType, RoundType, ScaleType, ZeroPointType

__all__ = [
    "DTYPE_FIELDS",
    "MX_BLOCK_SIZE",
    "MX_ELEMENT_DTYPES",
    "MX_FIELDS",
    "REJECTED_DTYPES",
    "Spec",
    "describe",
    "resolve_dtype",
    "spec_defaults",
]

#: A :class:`quark_brevitas.config.QuantizationSpec`. The modules below config take it by shape: naming
#: the class would mean importing config, which imports them.
Spec: TypeAlias = Any

_INT, _FLOAT = QuantType.int_quant, QuantType.float_quant

#: The fields each element dtype implies.
DTYPE_FIELDS: dict[Dtype, dict[str, Any]] = {
    Dtype.int8: {"quant_type": _INT, "bit_width": 8},
    Dtype.int4: {"quant_type": _INT, "bit_width": 4},
    Dtype.uint8: {"quant_type": _INT, "bit_width": 8, "symmetric": False},
    Dtype.uint4: {"quant_type": _INT, "bit_width": 4, "symmetric": False},
    Dtype.fp8_e4m3: {"quant_type": _FLOAT, "bit_width": 8, "exponent_bit_width": 4, "mantissa_bit_width": 3},
    Dtype.fp8_e5m2: {"quant_type": _FLOAT, "bit_width": 8, "exponent_bit_width": 5, "mantissa_bit_width": 2},
    Dtype.fp6_e3m2: {"quant_type": _FLOAT, "bit_width": 6, "exponent_bit_width": 3, "mantissa_bit_width": 2},
    Dtype.fp6_e2m3: {"quant_type": _FLOAT, "bit_width": 6, "exponent_bit_width": 2, "mantissa_bit_width": 3},
    Dtype.fp4: {"quant_type": _FLOAT, "bit_width": 4, "exponent_bit_width": 2, "mantissa_bit_width": 1},
}

#: Element formats of OCP MX (``dtype=mx``), and what ``mx`` itself implies besides them.
MX_ELEMENT_DTYPES = (Dtype.int8, Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp4)
MX_BLOCK_SIZE = 32
MX_FIELDS: dict[str, Any] = {"qscheme": QSchemeType.per_group, "group_size": MX_BLOCK_SIZE,
                             "scale_type": ScaleType.pof2, "symmetric": True}

#: Dtype members that are not quantization formats quark_brevitas can honour, and why.
REJECTED_DTYPES: dict[Dtype, str] = {
    Dtype.bfloat16: "bfloat16 is a plain cast, not a quantizer with a scale: Brevitas has none. Cast the "
    "model (model.to(torch.bfloat16)) or keep the tensor in float (spec None)",
    Dtype.float16: "float16 is a plain cast, not a quantizer with a scale: Brevitas has none. Cast the model "
    "(model.half()) or keep the tensor in float (spec None)",
    Dtype.mx6: "mx6 (shared micro-exponents: 2-element sub-blocks with a 1-bit micro-exponent under an 8-bit "
    "block exponent) has no Brevitas quantizer and cannot be composed from one; use dtype=mx with "
    "mx_element_dtype fp6_e3m2 or fp6_e2m3 (OCP MXFP6)",
    Dtype.mx9: "mx9 (shared micro-exponents: 2-element sub-blocks with a 1-bit micro-exponent under an 8-bit "
    "block exponent) has no Brevitas quantizer and cannot be composed from one; use dtype=mx with "
    "mx_element_dtype int8 (OCP MXINT8) or fp8_e4m3 (MXFP8)",
}


def spec_defaults(spec: Spec) -> dict[str, Any]:
    """The field defaults of the spec's class: a field still at its default is "not set" by the user."""
    return _defaults(type(spec))


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls)}


def resolve_dtype(spec: Spec, path: str = "") -> Spec:
    """Spell out the ``dtype`` short form: each field the dtype implies is set, unless the spec already
    sets it to something else (a field that differs from its default), which is a :class:`ConfigError`.

    ``dtype=mx`` also implies ``qscheme=per_group``, ``group_size=32``, ``scale_type=pof2`` and
    ``symmetric=True``, plus the fields of ``mx_element_dtype``. ``dtype`` itself is kept, so the
    resolved spec still says where it came from. Specs without ``dtype`` are returned unchanged
    (``mx_element_dtype`` without ``dtype=mx`` is an error).
    """
    prefix = f"{path}." if path else ""
    dtype, element = spec.dtype, spec.mx_element_dtype
    if element is not None and dtype is not Dtype.mx:
        raise ConfigError(f"{prefix}mx_element_dtype", "only used with dtype=mx; set dtype=Dtype.mx or remove it")
    if dtype is None:
        return spec
    if not isinstance(dtype, Dtype):  # an unverified spec: the tables below are keyed by members
        raise ConfigError(f"{prefix}dtype", f"must be a Dtype or None; allowed: {[d.name for d in Dtype]}")
    if dtype in REJECTED_DTYPES:
        raise ConfigError(f"{prefix}dtype", f"{dtype.name} is not supported: {REJECTED_DTYPES[dtype]}")
    implied: dict[str, Any]
    if dtype is Dtype.mx:
        if element not in MX_ELEMENT_DTYPES:
            raise ConfigError(f"{prefix}mx_element_dtype", f"dtype=mx needs an MX element format; got "
                              f"{getattr(element, 'name', element)!r}; allowed: {[d.name for d in MX_ELEMENT_DTYPES]}")
        implied = {**DTYPE_FIELDS[element], **MX_FIELDS}
        what = f"dtype=mx with mx_element_dtype={element.name}"
    else:
        implied = DTYPE_FIELDS[dtype]
        what = f"dtype={dtype.name}"
    defaults = spec_defaults(spec)
    changes: dict[str, Any] = {}
    for name, value in implied.items():
        current = getattr(spec, name)
        if current == value:
            continue
        if current != defaults[name]:
            shown = getattr(current, "name", current)
            raise ConfigError(f"{prefix}{name}", f"{what} means {name}={getattr(value, 'name', value)!r}, but "
                              f"{name} is {shown!r}; leave {name} at its default or make it agree")
        changes[name] = value
    return replace(spec, **changes) if changes else spec


def describe(spec: Spec) -> str:
    """A one-line human summary such as ``int8 per_channel sym stats`` or ``mxfp4_e2m1 g32`` (the short
    form is spelled out first when it can be; a contradicting spec is described as written)."""
    with suppress(ConfigError):
        spec = resolve_dtype(spec)
    if spec.quant_type is QuantType.float_quant:
        kind = f"fp{spec.bit_width}_e{spec.exponent_bit_width}m{spec.mantissa_bit_width}"
    else:
        kind = f"int{spec.bit_width}"
    if spec.dtype is Dtype.mx:
        return f"mx{kind} g{spec.group_size}" + (f" {spec.round_method.name}" if spec.round_method else "")
    sym = "sym" if spec.symmetric else "asym"
    scheme = spec.qscheme.value + (f" g{spec.group_size}" if spec.qscheme is QSchemeType.per_group else "")
    extras = [] if spec.scale_type is ScaleType.float else [spec.scale_type.value]
    if spec.is_dynamic:
        extras.append("dynamic")
    if spec.round_method is not None and spec.round_method is not RoundType.half_even:
        extras.append(spec.round_method.name)
    if spec.zero_point_type is ZeroPointType.float32:
        extras.append("float_zp")
    if spec.percentile is not None:
        extras.append(f"p{spec.percentile:g}")
    return " ".join([kind, scheme, sym, spec.param_type.value, *extras])
