"""How one layer is quantized: :class:`QuantizationSpec` (alias ``QTensorConfig``: one tensor) and
:class:`QuantizationConfig` (alias ``QLayerConfig``: the four tensors of a layer), with the ``dtype``
short form spelled out (:func:`resolve_dtype`, applying the table of :mod:`quark_brevitas.config.formats`).

These classes sit below the algorithm configs (which check that an algorithm's restated weight spec agrees
with the config's) and below :class:`~quark_brevitas.config.model_config.Config` (which holds both), so
every module above can name them in its annotations. :class:`QuantHierarchy` is what an algorithm's check
reads of the Config it belongs to: a Protocol rather than Config itself because Config names the algorithm
classes in its own annotations, so the algorithm module cannot import it without a cycle.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol

from quark_brevitas.config.enums import (
    DeviceType,
    Dtype,
    ParamType,
    QSchemeType,
    QuantType,
    RoundType,
    ScaleType,
    ZeroPointType,
)
from quark_brevitas.config.formats import (
    DTYPE_FIELDS,
    MX_ELEMENT_DTYPES,
    MX_FIELDS,
    OBSERVER_FIELDS,
    REJECTED_DTYPES,
    REJECTED_OBSERVERS,
)
from quark_brevitas.errors import ConfigError

__all__ = [
    "TENSOR_ROLES",
    "QLayerConfig",
    "QTensorConfig",
    "QuantHierarchy",
    "QuantizationConfig",
    "QuantizationSpec",
    "FULL_RANGE_MAX_BITS",
    "describe",
    "narrow_range_of",
    "resolve_dtype",
    "spec_defaults",
]


@dataclass(eq=True, frozen=True)
class QuantizationSpec:
    """How one tensor (weight, input, output or bias) is quantized.

    The defaults give 8-bit symmetric per-tensor integer quantization with a float scale found from
    statistics, so ``QuantizationSpec()`` is usable as is. The first eight fields are those of Quark's
    Brevitas extension, in its order; the fields after them are Quark's general ``QuantizationSpec``
    fields (``None``: not specified).

    - ``qscheme``: granularity: ``per_tensor``, ``per_channel`` (weights; dynamic activations: one scale
      per token) or ``per_group`` (``group_size`` consecutive input channels share a scale).
    - ``symmetric``: zero point in the middle of the integer range (True) or fitted to min/max (False).
    - ``scale_type``: ``float`` or ``pof2`` (power-of-two, exponent rounded up) scales, ``pof2_round``
      (power-of-two, exponent rounded to nearest: Quark's power-of-two observers' rule; per tensor and per
      channel); ``per_group`` with ``pof2`` is the OCP MX shared-exponent rule; ``float16`` (integer weights): every
      scale is a float16 number, as GGUF stores it (asymmetric: with ``11 - bit_width`` significant bits, so that
      ``scale * zero_point`` is one too);
      ``gguf_k`` (integer weights per group of 16 / 32 with a K-quant's bits): per 256 input channels, integer
      multiples of one float16 number, as GGUF's K-quants Q2_K .. Q6_K store them (asymmetric uint2 / uint4 /
      uint5: a minimum per group too, multiples of a second float16 number, llama.cpp's Q2_K / Q4_K / Q5_K);
      ``gguf_0`` (int4 / int5 symmetric weights
      per group of 32): a signed float16 scale per group, the group's largest-magnitude weight on the most
      negative code, as llama.cpp's quantizer fills GGUF Q4_0 / Q5_0.
    - ``quant_type``: ``int_quant`` or ``float_quant`` (then give exponent and mantissa widths).
    - ``param_type``: ``stats`` or ``mse``.
    - ``bit_width``: total bits of the quantized value (sign included for float formats).
    - ``exponent_bit_width`` / ``mantissa_bit_width``: float formats only.
    - ``dtype``: short form for the element format (``int4``, ``uint8``, ``fp8_e5m2``, ``fp4``, ``mx`` with
      ``mx_element_dtype``, ...): fields left at their defaults take the dtype's values, fields that
      contradict it are an error. ``uint4``/``uint8`` mean asymmetric (unsigned codes and a zero point).
    - ``group_size``: elements per group for ``per_group`` (32 for MX).
    - ``ch_axis``: Quark's channel axis, optional: 0 (output channels) for ``per_channel`` weights, 1 or -1 (input
      channels; -1 is Quark 0.13's spelling) for ``per_group`` weights; Brevitas uses the equivalent axis of
      transposed convolutions.
    - ``round_method``: element rounding: ``half_even`` (the default), ``floor`` or ``round`` (half away
      from zero).
    - ``is_dynamic``: activations only: scales computed from each input at run time (per tensor, per token
      with ``per_channel``, per group) instead of calibrated.
    - ``zero_point_type``: asymmetric int only: ``int32`` (integer zero point, the default) or ``float32``.
    - ``mx_element_dtype``: the element format of ``dtype=mx``: ``int8``, ``fp8_e4m3``, ``fp8_e5m2``,
      ``fp6_e3m2``, ``fp6_e2m3`` or ``fp4``.
    - ``percentile``: static int activations with ``stats``: the percentile of the calibration data mapped to
      the top of the range (default 99.999; 100 = max).
    - ``observer_cls``: Quark's observer class (or its name), accepted where it says something these fields can
      honour (:data:`~quark_brevitas.config.formats.OBSERVER_FIELDS`): its granularity, ``param_type`` (min-max
      and percentile: ``stats``, a min-max observer calibrating static activations on the maximum; MSE: ``mse``)
      and power-of-two scales; a field set otherwise contradicts it (ConfigError), an observer without an
      equivalent is refused with the reason.
    - ``narrow_range``: symmetric integer weights only: ``True`` uses the codes ``-(2^(b-1)-1)..2^(b-1)-1``
      with ``scale = max|w| / (2^(b-1)-1)`` (int3: -3..3, 7 codes); ``False`` the full two's-complement
      range ``-2^(b-1)..2^(b-1)-1`` with Quark's ``scale = max|w| / (2^(b-1) - 1/2)`` (int3: -4..3, 8 codes);
      ``None``: the default for the bit width (:func:`narrow_range_of`: full range at 2-4 bits, narrow above, see
      :data:`FULL_RANGE_MAX_BITS`).
    - ``pad_groups``: ``per_group`` weights only, for a layer whose input channels are no multiple of
      ``group_size`` (or fewer than it): ``True`` pads its last group; ``False`` refuses it; ``None`` (default)
      follows Quark 0.13: MX formats pad (as Quark's MX quantizer does), integer and float groups are a
      :class:`ConfigError` in ``plan()`` naming the layer, before calibration (padding silently costs evaluation
      time and memory). A run that pads logs the layers it pads.
    """

    #: Written to files only when set. A file without it gets the default of the reading release: 2-4 bit symmetric
    #: weights written before the full range became their default read as full range now.
    omitted_when_none: ClassVar[tuple[str, ...]] = ("narrow_range", "pad_groups")

    qscheme: QSchemeType = QSchemeType.per_tensor
    symmetric: bool = True
    scale_type: ScaleType = ScaleType.float
    quant_type: QuantType = QuantType.int_quant
    param_type: ParamType = ParamType.stats
    bit_width: int = 8
    exponent_bit_width: int | None = None
    mantissa_bit_width: int | None = None
    dtype: Dtype | None = None
    group_size: int | None = None
    ch_axis: int | None = None
    round_method: RoundType | None = None
    is_dynamic: bool | None = None
    zero_point_type: ZeroPointType | None = None
    mx_element_dtype: Dtype | None = None
    percentile: float | None = None
    observer_cls: str | None = None
    narrow_range: bool | None = None
    pad_groups: bool | None = None

    def __post_init__(self) -> None:
        # Quark passes the observer class itself; it is kept by name (plain, serialisable data without torch).
        if isinstance(self.observer_cls, type):
            object.__setattr__(self, "observer_cls", self.observer_cls.__name__)

    def resolved(self, path: str = "") -> QuantizationSpec:
        """This spec with its ``dtype`` short form spelled out in the other fields (see :func:`resolve_dtype`)."""
        return resolve_dtype(self, path)

    def short(self) -> str:
        """A one-line human summary such as ``int8 per_channel sym stats`` or ``mxfp4_e2m1 g32``."""
        return describe(self)


@dataclass(eq=True)
class QuantizationConfig:
    """Which tensors of a layer are quantized, and how.

    ``None`` in ``global_quant_config`` means: left in float. In a ``layer_type_quant_config`` or
    ``layer_quant_config`` entry it means: as the next level up says (layer name, then layer type,
    then global), as in Quark's hierarchy.
    """

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None
    #: Quark's deployment target (``DeviceType``): ``cpu`` (or ``None``) is what this library produces (models
    #: and exports that run on any torch device and on onnxruntime's CPU provider); ``ipu`` is refused (its
    #: constraints are Quark's own).
    target_device: DeviceType | None = None



#: Symmetric integer weights of at most this many bits use the full two's-complement range unless the spec says
#: otherwise (``narrow_range=None``). Measured on the real MiniLM by ``benchmarks/llm_lowbit.py`` (README, Number
#: formats, 2026-11-26): at 2, 3 and 4 bits the full range is better in 10 of 12 cases (per channel and per group,
#: round to nearest and GPTQConfig), ties int4 per-channel GPTQ and loses int3 per-channel GPTQ (0.806 against
#: 0.832: set ``narrow_range=True`` there). Wider weights (the extra code is worth little there) and all activations
#: (which this does not apply to) keep the symmetric range.
FULL_RANGE_MAX_BITS = 4


def narrow_range_of(spec: QuantizationSpec) -> bool:
    """Whether a symmetric integer weight spec leaves its most negative code unused: ``spec.narrow_range`` when
    set, otherwise narrow above :data:`FULL_RANGE_MAX_BITS` bits and full range at or below it. The bit width is
    read after the ``dtype`` short form is spelled out: ``QuantizationSpec(dtype=Dtype.int4)`` still has the
    default ``bit_width=8`` in its field, and must get the 4-bit default grid."""
    if spec.narrow_range is not None:
        return spec.narrow_range
    return spec.resolved().bit_width > FULL_RANGE_MAX_BITS


# Quark's Brevitas extension exports both names for the same classes.
QTensorConfig = QuantizationSpec
QLayerConfig = QuantizationConfig

#: The tensors of a layer, in field order: ``input_tensors``, ``output_tensors``, ``weight``, ``bias``.
TENSOR_ROLES = ("input_tensors", "output_tensors", "weight", "bias")


class QuantHierarchy(Protocol):
    """The three levels of a :class:`~quark_brevitas.config.model_config.Config` (Quark's hierarchy), as the
    algorithm checks read them: global, per layer type (keys: type names) and per layer name."""

    @property
    def global_quant_config(self) -> QuantizationConfig: ...

    @property
    def layer_type_quant_config(self) -> Mapping[Any, QuantizationConfig]: ...

    @property
    def layer_quant_config(self) -> Mapping[Any, QuantizationConfig]: ...


# ===================================================================== the dtype short form
def spec_defaults(spec: QuantizationSpec) -> dict[str, Any]:
    """The field defaults of the spec's class: a field still at its default is "not set" by the user."""
    return _defaults(type(spec))


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls)}


def resolve_dtype(spec: QuantizationSpec, path: str = "") -> QuantizationSpec:
    """Spell out the ``dtype`` short form: each field the dtype implies is set, unless the spec already
    sets it to something else (a field that differs from its default), which is a :class:`ConfigError`.

    ``dtype=mx`` also implies ``qscheme=per_group``, ``group_size=32``, ``scale_type=pof2`` and
    ``symmetric=True``, plus the fields of ``mx_element_dtype``. ``dtype`` itself is kept, so the
    resolved spec still says where it came from. Specs without ``dtype`` are returned unchanged
    (``mx_element_dtype`` without ``dtype=mx`` is an error).
    """
    prefix = f"{path}." if path else ""
    spec = _resolve_observer(spec, prefix)
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


def _resolve_observer(spec: QuantizationSpec, prefix: str) -> QuantizationSpec:
    """Spell out Quark's ``observer_cls`` in the fields it implies (as the dtype short form is): a field still at
    its default takes the observer's value, a field set to something else is a :class:`ConfigError` naming both."""
    name = spec.observer_cls
    if name is None:
        return spec
    if name in REJECTED_OBSERVERS:
        raise ConfigError(f"{prefix}observer_cls", f"{name} is not supported: {REJECTED_OBSERVERS[name]}")
    if name not in OBSERVER_FIELDS:
        raise ConfigError(f"{prefix}observer_cls", f"{name!r} is not one of Quark's observers this library can "
                                                   f"honour; allowed: {sorted(OBSERVER_FIELDS)} (or leave it None "
                                                   "and choose param_type)")
    defaults = spec_defaults(spec)
    changes: dict[str, Any] = {}
    for field_name, value in OBSERVER_FIELDS[name].items():
        current = getattr(spec, field_name)
        if current == value:
            continue
        if current != defaults[field_name]:
            raise ConfigError(f"{prefix}{field_name}", f"observer_cls={name} means {field_name}="
                              f"{getattr(value, 'name', value)}, but {field_name} is "
                              f"{getattr(current, 'name', current)}; remove observer_cls or make them agree")
        changes[field_name] = value
    return replace(spec, **changes) if changes else spec


def describe(spec: QuantizationSpec) -> str:
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
    if spec.narrow_range is not None:
        extras.append("narrow" if spec.narrow_range else "full_range")
    return " ".join([kind, scheme, sym, spec.param_type.value, *extras])
