"""The one translation table: a QuantizationSpec and a tensor role -> a Brevitas quant injector.

Every supported combination of (role, quant type, param type, scheme, symmetry) maps to the closest
existing Brevitas quantizer class in ``_TABLE``; bit widths, scale type, rounding, zero-point type and
percentile are applied with ``.let(...)``. Anything not in the table is rejected by :func:`verify_spec`
at config time with a message saying what is supported — there are no silent fallbacks. A spec's
``dtype`` short form is spelled out first (:func:`quark_brevitas.config.resolve_dtype`).

The *scheme* column refines ``qscheme``: ``per_group`` with float scales, ``mx`` (``per_group`` with
``scale_type=pof2``: one power-of-two scale per block chosen by the OCP MX rule, shared exponent
``floor(log2(max|block|)) - emax(element)``), and for activations ``dynamic_per_tensor`` /
``dynamic_per_token`` (``is_dynamic=True``). Per-group activations are always dynamic.

Weight quantizers use ``ScalingImplType.PARAMETER_FROM_STATS`` (and a parameter zero point for
asymmetric weights): the scale is computed once from the float weight and then kept as a
parameter. Brevitas's default per-call ``STATS`` weight scaling recomputes the scale from whatever
the weight currently is, which would let GPTQ/GPFQ's updated weights silently move their own grid;
a parameter scale is also what QAT needs to learn.

Brevitas's MX integer quantizers divide the block's power-of-two threshold by ``2^(b-1)`` (128 at 8
bits), which clips about half of every block; the OCP MX rule divides by ``2^(b-2)`` (MXINT8: elements
are int8 with an implicit scale of 2^-6). ``IntScaling`` with a narrow range gives that divisor once the
threshold is floored to a power of two, so the MX int rows use it (elements in [-(2^(b-1)-1), 2^(b-1)-1],
the symmetric MXINT8 range).
"""

from __future__ import annotations

from dataclasses import is_dataclass
from typing import Any

import torch
from brevitas.core.function_wrapper.ops_ste import CeilSte, FloorSte, RoundSte
from brevitas.core.restrict_val import RestrictValueType
from brevitas.core.scaling import IntScaling, ScalingImplType
from brevitas.core.stats import AbsMinMax, NegativeMinOrZero, NegativePercentileOrZero, PercentileInterval, StatsOp
from brevitas.core.zero_point import ParameterFromStatsFromParameterZeroPoint
from brevitas.inject.enum import ScalingPerOutputType
from brevitas.proxy.groupwise_float_parameter_quant import GroupwiseWeightFloatQuantProxyFromInjector
from brevitas.quant import mx_quant_ocp as bq_mx
from brevitas.quant import scaled_int as bq_int
from brevitas.quant import shifted_scaled_int as bq_shifted
from brevitas.quant.base import MSEAsymmetricScaleSubInjector
from brevitas.quant.float_quant_ocp import (
    FpOCPActPerTensorFloat,
    FpOCPActPerTensorFloatMSE,
    FpOCPWeightPerChannelFloat,
    FpOCPWeightPerChannelFloatMSE,
    FpOCPWeightPerTensorFloat,
    FpOCPWeightPerTensorFloatMSE,
)
from torch import nn

from quark_brevitas.brevitas_adapter import generative_quantizers as bq_gen
from quark_brevitas.dtypes import Spec as QuantizationSpec
from quark_brevitas.dtypes import spec_defaults
from quark_brevitas.errors import ConfigError
from quark_brevitas.serialization import check_fields
from quark_brevitas.types import ParamType, QSchemeType, QuantType, RoundType, ScaleType, ZeroPointType

P = ParamType
INT = QuantType.int_quant
FLOAT = QuantType.float_quant
_GROUP = {"scaling_per_output_type": ScalingPerOutputType.GROUP}
_OCP_MX_INT = {"int_scaling_impl": IntScaling, "narrow_range": True}


def _per_token_shape(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """One dynamic scale per vector along the last dimension (per token), broadcast over that dimension."""
    return scale.view(*shape[:-1], 1)


# Symmetric dynamic int activations: scale = max|x| / (2^(b-1) - 1), codes in +-(2^(b-1) - 1) (Brevitas's
# default for activations divides by 2^(b-1) and clips +max|x| to (2^(b-1) - 1) / 2^(b-1) of itself).
_NARROW = {"narrow_range": True}
_PER_TOKEN = {"dynamic_scaling_broadcastable_fn": _per_token_shape, "permute_dims": None, "stats_reduce_dim": 1}


class _ZeroInclusiveRange(nn.Module):
    """The asymmetric range ``max(hi, 0) - min(lo, 0)`` as a Brevitas scaling statistic.

    Brevitas's interval statistics (``AbsMinMax``, ``PercentileInterval``) widen ``lo`` to <= 0 but not
    ``hi`` to >= 0, so an all-negative row or activation gets the range ``hi - lo`` and a grid that stops
    short of its minimum (the zero point saturates at ``2^b - 1``). Widening ``hi`` to 0 makes the range
    at least ``-min(lo, 0)``, which is Brevitas's own zero-point statistic (``NegativeMinOrZero``,
    ``NegativePercentileOrZero``, same rank): the larger of the two is the definition's range, and it is
    Brevitas's interval itself (bit for bit) whenever ``hi >= 0``.
    """

    def __init__(self, interval: nn.Module, negative_low: nn.Module) -> None:
        super().__init__()
        self.interval = interval
        self.negative_low = negative_low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(self.interval(x), -self.negative_low(x))


class ZeroInclusiveMinMax(_ZeroInclusiveRange):
    """``max(max(x), 0) - min(min(x), 0)`` from ``AbsMinMax`` and ``NegativeMinOrZero`` (see the base class);
    the constructor takes what the injector gives ``AbsMinMax``."""

    def __init__(self, stats_reduce_dim: int | None = None, keepdim: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(AbsMinMax(stats_reduce_dim, keepdim, dtype, device),
                         NegativeMinOrZero(stats_reduce_dim, dtype, device, keepdim))


class ZeroInclusivePercentileInterval(_ZeroInclusiveRange):
    """The percentile interval widened to contain 0 at both ends, from ``PercentileInterval`` and
    ``NegativePercentileOrZero`` (see the base class); the constructor takes what the injector gives
    ``PercentileInterval``."""

    def __init__(self, low_percentile_q: float, high_percentile_q: float, stats_reduce_dim: int | None = None,
                 keepdim: bool = False, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        interval = PercentileInterval(low_percentile_q, high_percentile_q, stats_reduce_dim, keepdim, dtype, device)
        super().__init__(interval, NegativePercentileOrZero(low_percentile_q, stats_reduce_dim, dtype, device, keepdim))


# Asymmetric int rows: the range statistic widened to contain zero (min/max, percentile interval, and the
# initial range of the MSE scale search, which only looks below it).
_ZERO_MIN_MAX = {"scaling_stats_impl": ZeroInclusiveMinMax}
_ZERO_PERCENTILE = {"scaling_stats_impl": ZeroInclusivePercentileInterval}
_ZERO_MSE = {"mse_scale": MSEAsymmetricScaleSubInjector.let(mse_init_op=ZeroInclusiveMinMax)}

# Schemes (the refined qscheme column of the table).
PER_TENSOR, PER_CHANNEL, PER_GROUP, MX = "per_tensor", "per_channel", "per_group", "mx"
DYNAMIC_PER_TENSOR, DYNAMIC_PER_TOKEN = "dynamic_per_tensor", "dynamic_per_token"

# (kind, quant type, param type, scheme, symmetric) -> Brevitas base quantizer.
_TABLE: dict[tuple[str, QuantType, ParamType, str, bool], type] = {
    # integer weights (narrow range, signed when symmetric, unsigned + zero point when not)
    ("weight", INT, P.stats, PER_TENSOR, True): bq_int.Int8WeightPerTensorFloat,
    ("weight", INT, P.stats, PER_CHANNEL, True): bq_int.Int8WeightPerChannelFloat,
    ("weight", INT, P.mse, PER_TENSOR, True): bq_int.Int8WeightPerTensorFloatMSE,
    ("weight", INT, P.mse, PER_CHANNEL, True): bq_int.Int8WeightPerChannelFloatMSE,
    ("weight", INT, P.stats, PER_TENSOR, False): bq_shifted.ShiftedUint8WeightPerTensorFloat.let(**_ZERO_MIN_MAX),
    ("weight", INT, P.stats, PER_CHANNEL, False): bq_shifted.ShiftedUint8WeightPerChannelFloat.let(**_ZERO_MIN_MAX),
    ("weight", INT, P.mse, PER_TENSOR, False): bq_shifted.ShiftedUint8WeightPerTensorFloatMSE.let(**_ZERO_MSE),
    ("weight", INT, P.mse, PER_CHANNEL, False): bq_shifted.ShiftedUint8WeightPerChannelFloatMSE.let(**_ZERO_MSE),
    # integer weights per group of input channels (float scale per group)
    ("weight", INT, P.stats, PER_GROUP, True): bq_gen.IntWeightSymmetricGroupQuant,
    ("weight", INT, P.mse, PER_GROUP, True): bq_gen.IntWeightSymmetricGroupQuantMSE,
    ("weight", INT, P.stats, PER_GROUP, False): bq_shifted.ShiftedUint8WeightGroupQuantFloat.let(**_ZERO_MIN_MAX),
    ("weight", INT, P.mse, PER_GROUP, False): bq_gen.ShiftedUint8WeightGroupQuantFloatMSE.let(**_ZERO_MSE),
    # integer activations (per tensor; percentile statistics or MSE, collected during calibration)
    ("act", INT, P.stats, PER_TENSOR, True): bq_int.Int8ActPerTensorFloat,
    ("act", INT, P.mse, PER_TENSOR, True): bq_int.Int8ActPerTensorFloatMSE,
    ("act", INT, P.stats, PER_TENSOR, False): bq_shifted.ShiftedUint8ActPerTensorFloat.let(**_ZERO_PERCENTILE),
    ("act", INT, P.mse, PER_TENSOR, False): bq_shifted.ShiftedUint8ActPerTensorFloatMSE.let(**_ZERO_MSE),
    # OCP floating point (saturating; e4m3 / e5m2 carry the OCP NaN/Inf encodings)
    ("weight", FLOAT, P.stats, PER_TENSOR, True): FpOCPWeightPerTensorFloat,
    ("weight", FLOAT, P.stats, PER_CHANNEL, True): FpOCPWeightPerChannelFloat,
    ("weight", FLOAT, P.mse, PER_TENSOR, True): FpOCPWeightPerTensorFloatMSE,
    ("weight", FLOAT, P.mse, PER_CHANNEL, True): FpOCPWeightPerChannelFloatMSE,
    ("weight", FLOAT, P.stats, PER_GROUP, True): FpOCPWeightPerChannelFloat.let(
        proxy_class=GroupwiseWeightFloatQuantProxyFromInjector, **_GROUP),
    ("weight", FLOAT, P.mse, PER_GROUP, True): FpOCPWeightPerChannelFloatMSE.let(
        proxy_class=GroupwiseWeightFloatQuantProxyFromInjector, **_GROUP),
    ("act", FLOAT, P.stats, PER_TENSOR, True): FpOCPActPerTensorFloat,
    ("act", FLOAT, P.mse, PER_TENSOR, True): FpOCPActPerTensorFloatMSE,
    # OCP MX: blocks sharing a power-of-two scale (E8M0), weights and (always dynamic) activations
    ("weight", INT, P.stats, MX, True): bq_mx.MXInt8Weight.let(**_OCP_MX_INT),
    ("weight", FLOAT, P.stats, MX, True): bq_mx.MXFloat8e4m3Weight,
    ("act", INT, P.stats, MX, True): bq_mx.MXInt8Act.let(**_OCP_MX_INT),
    ("act", FLOAT, P.stats, MX, True): bq_mx.MXFloat8e4m3Act,
    # dynamic activations: scales from each input at run time (max |x|, or min/max with a zero point)
    ("act", INT, P.stats, PER_GROUP, True): bq_gen.Int8DynamicActPerGroupFloat.let(**_NARROW),
    ("act", FLOAT, P.stats, PER_GROUP, True): bq_gen.Fp8e4m3OCPDynamicActPerGroupFloat,
    ("act", INT, P.stats, DYNAMIC_PER_TENSOR, True): bq_gen.Int8DynamicActPerTensorFloat.let(**_NARROW),
    ("act", INT, P.stats, DYNAMIC_PER_TENSOR, False): bq_gen.ShiftedUint8DynamicActPerTensorFloat.let(**_ZERO_MIN_MAX),
    ("act", FLOAT, P.stats, DYNAMIC_PER_TENSOR, True): bq_gen.Fp8e4m3OCPDynamicActPerTensorFloat,
    ("act", INT, P.stats, DYNAMIC_PER_TOKEN, True): bq_gen.Int8DynamicActPerRowFloat.let(**_PER_TOKEN, **_NARROW),
    ("act", INT, P.stats, DYNAMIC_PER_TOKEN, False): bq_gen.ShiftedUint8DynamicActPerRowFloat.let(
        **_PER_TOKEN, **_ZERO_MIN_MAX),
    ("act", FLOAT, P.stats, DYNAMIC_PER_TOKEN, True): bq_gen.FP8e4m3OCPDynamicActPerRowFloat.let(**_PER_TOKEN),
}

_BIAS: dict[int, type] = {
    8: bq_int.Int8Bias,
    16: bq_int.Int16Bias,
    24: bq_int.Int24Bias,
    32: bq_int.Int32Bias,
}

_SCALE_LETS: dict[ScaleType, dict[str, Any]] = {
    ScaleType.float: {},
    ScaleType.pof2: {
        "restrict_scaling_type": RestrictValueType.POWER_OF_TWO,
        "restrict_value_float_to_int_impl": CeilSte,
    },
}

class _RoundHalfAwayFromZero(torch.autograd.Function):
    """``sign(x) * floor(|x| + 1/2)`` computed exactly (ties away from zero), identity gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        truncated = torch.trunc(x)
        return torch.where((x - truncated).abs() >= 0.5, truncated + torch.sign(x), truncated)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RoundHalfAwayFromZeroSte(nn.Module):
    """``RoundType.round`` as a Brevitas ``float_to_int_impl``: Brevitas has round-half-even (``RoundSte``),
    floor, ceil, round-to-zero and its DPU rounding, but not the usual "round half away from zero"."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RoundHalfAwayFromZero.apply(x)


#: Element rounding (``round_method``); ``None`` is Brevitas's default, round half to even.
_ROUNDING: dict[RoundType | None, dict[str, Any]] = {
    None: {},
    RoundType.half_even: {"float_to_int_impl": RoundSte},
    RoundType.floor: {"float_to_int_impl": FloorSte},
    RoundType.round: {"float_to_int_impl": RoundHalfAwayFromZeroSte},
}

INT_BIT_WIDTHS = {"weight": range(2, 9), "act": range(2, 17), "group": range(2, 9)}
FLOAT_BIT_WIDTHS = range(4, 9)
DEFAULT_PERCENTILE = 99.999
_ROLE_KIND = {"weight": "weight", "input_tensors": "act", "output_tensors": "act", "bias": "bias"}


def _allowed(values: Any) -> str:
    return ", ".join(str(getattr(v, "name", v)) for v in values)


def _check_types(spec: QuantizationSpec, path: str) -> None:
    """Field types by the spec's own annotations (the generic check the config parser uses too), then the
    one value range that does not depend on the role. A spec is recognised by shape: this module sits
    below :mod:`quark_brevitas.config` and cannot import the class."""
    if isinstance(spec, type) or not is_dataclass(spec) or not callable(getattr(spec, "resolved", None)):
        raise ConfigError(path, f"must be a QuantizationSpec (QTensorConfig) or None, got {type(spec).__name__}")
    check_fields(spec, path)
    if spec.percentile is not None and not 0 < spec.percentile <= 100:
        raise ConfigError(f"{path}.percentile", f"must be in (0, 100] (e.g. 99.999; 100 = max), got {spec.percentile}")


_BIAS_FIXED = ("qscheme", "symmetric", "scale_type", "quant_type", "param_type", "exponent_bit_width",
               "mantissa_bit_width", "dtype", "group_size", "ch_axis", "round_method", "is_dynamic",
               "zero_point_type", "mx_element_dtype", "percentile")


def _verify_bias(spec: QuantizationSpec, path: str) -> None:
    if spec.bit_width not in _BIAS:
        raise ConfigError(f"{path}.bit_width", f"bias bit width {spec.bit_width} unsupported; allowed: {sorted(_BIAS)}")
    defaults = spec_defaults(spec)
    for name in _BIAS_FIXED:
        if getattr(spec, name) != defaults[name]:
            raise ConfigError(
                f"{path}.{name}",
                "bias is quantized to integers with scale = input scale x weight scale; only bit_width "
                f"can be set (leave {name} at its default {defaults[name]!r})",
            )


def scheme_of(spec: QuantizationSpec, kind: str) -> str:
    """The table's scheme column for a resolved spec: per_tensor, per_channel, per_group, mx,
    dynamic_per_tensor or dynamic_per_token."""
    if spec.qscheme is QSchemeType.per_group:
        return MX if spec.scale_type is ScaleType.pof2 else PER_GROUP
    if kind == "act" and spec.is_dynamic:
        return DYNAMIC_PER_TENSOR if spec.qscheme is QSchemeType.per_tensor else DYNAMIC_PER_TOKEN
    return spec.qscheme.name


def _verify_granularity(spec: QuantizationSpec, kind: str, path: str) -> None:
    """qscheme, group_size, ch_axis and is_dynamic, and how they fit the tensor role."""
    qscheme = spec.qscheme
    if qscheme is QSchemeType.per_group:
        if spec.group_size is None:
            raise ConfigError(f"{path}.group_size", "per_group needs group_size (elements per group, e.g. 32 or "
                              "128; 32 for MX)")
        if spec.group_size < 2:
            raise ConfigError(f"{path}.group_size", f"must be >= 2, got {spec.group_size}")
    elif spec.group_size is not None:
        raise ConfigError(f"{path}.group_size", f"only used with qscheme=per_group (qscheme is {qscheme.name}); "
                          "remove it or set qscheme=per_group")
    if spec.ch_axis is not None:
        allowed = {QSchemeType.per_channel: (0,), QSchemeType.per_group: (1,)}.get(qscheme, ())
        if kind == "act":
            raise ConfigError(f"{path}.ch_axis", "activations follow the layer: one scale per token is over the "
                              "last dimension, groups run over the channels (Conv) or the last dimension (Linear); "
                              "leave ch_axis None")
        if spec.ch_axis not in allowed:
            raise ConfigError(f"{path}.ch_axis", f"{spec.ch_axis} is not supported for {qscheme.name} weights; "
                              f"allowed: None{''.join(f', {a}' for a in allowed)} (0: output channels for "
                              "per_channel, 1: input channels for per_group)")
    if kind == "weight":
        if spec.is_dynamic:
            raise ConfigError(f"{path}.is_dynamic", "weights are quantized once from their values; is_dynamic is "
                              "for activations (leave it None or False)")
        return
    if qscheme is QSchemeType.per_channel and not spec.is_dynamic:
        raise ConfigError(f"{path}.qscheme", "static activations are quantized per_tensor only; allowed: "
                          "per_tensor, or per_channel (one scale per token) / per_group with is_dynamic=True")
    if qscheme is QSchemeType.per_group and spec.is_dynamic is False:
        raise ConfigError(f"{path}.is_dynamic", "per_group activation scales are computed from each input "
                          "(dynamic); leave is_dynamic None or set it True")


def _verify_format(spec: QuantizationSpec, kind: str, scheme: str, path: str) -> None:
    if spec.quant_type is INT:
        for name in ("exponent_bit_width", "mantissa_bit_width"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"{path}.{name}", "only used by float_quant; leave it None for int_quant")
        widths = INT_BIT_WIDTHS["group" if kind == "act" and scheme in (PER_GROUP, MX) else kind]
        if spec.bit_width not in widths:
            what = "weights" if kind == "weight" else "activations" if widths is INT_BIT_WIDTHS["act"] else \
                f"{scheme} activations"
            raise ConfigError(f"{path}.bit_width", f"{spec.bit_width} is out of range for int_quant {what}; "
                              f"allowed: {widths.start}..{widths.stop - 1}")
        return
    e, m = spec.exponent_bit_width, spec.mantissa_bit_width
    for name, value in (("exponent_bit_width", e), ("mantissa_bit_width", m)):
        if value is None:
            raise ConfigError(f"{path}.{name}", "float_quant needs exponent_bit_width and mantissa_bit_width "
                              "(e.g. 4 and 3 for fp8 e4m3, 5 and 2 for fp8 e5m2), or a float dtype")
    if spec.bit_width not in FLOAT_BIT_WIDTHS:
        raise ConfigError(f"{path}.bit_width", f"{spec.bit_width} is out of range for float_quant; "
                          f"allowed: {FLOAT_BIT_WIDTHS.start}..{FLOAT_BIT_WIDTHS.stop - 1}")
    if e < 1 or m < 0:
        raise ConfigError(f"{path}.exponent_bit_width" if e < 1 else f"{path}.mantissa_bit_width",
                          f"need exponent_bit_width >= 1 and mantissa_bit_width >= 0; got e={e}, m={m}")
    if 1 + e + m != spec.bit_width:
        raise ConfigError(f"{path}.bit_width", "float_quant needs 1 (sign) + exponent_bit_width + "
                          f"mantissa_bit_width == bit_width; got 1 + {e} + {m} != {spec.bit_width}")
    if not spec.symmetric:
        raise ConfigError(f"{path}.symmetric", "asymmetric float_quant is not supported; use symmetric=True")
    if spec.zero_point_type is not None:
        raise ConfigError(f"{path}.zero_point_type", "float formats have no zero point; leave it None")


def _verify_options(spec: QuantizationSpec, kind: str, scheme: str, path: str) -> None:
    """param_type, percentile, zero_point_type and symmetry rules that depend on the scheme."""
    dynamic = kind == "act" and scheme in (PER_GROUP, MX, DYNAMIC_PER_TENSOR, DYNAMIC_PER_TOKEN)
    if scheme == MX and not spec.symmetric:
        raise ConfigError(f"{path}.symmetric", "per_group with scale_type=pof2 is the OCP MX shared-exponent rule, "
                          "which is symmetric; use symmetric=True, or scale_type=float for asymmetric per_group")
    if spec.param_type is ParamType.mse and (scheme == MX or dynamic):
        why = ("OCP MX takes the shared exponent from max|block|" if scheme == MX
               else "dynamic scales come from each input's range at run time, MSE is a calibration search")
        raise ConfigError(f"{path}.param_type", f"mse is not supported for {scheme} {kind}s: {why}; use stats")
    if spec.percentile is not None and (kind != "act" or dynamic or spec.param_type is not ParamType.stats):
        raise ConfigError(f"{path}.percentile", "only used by static activations with param_type=stats (the "
                          "calibration statistic); weights use max|w|, dynamic scales each input's range, mse "
                          "its search. Remove it")
    if kind == "act" and scheme == PER_GROUP and not spec.symmetric:
        raise ConfigError(f"{path}.symmetric", "asymmetric per_group activations are not supported (Brevitas's "
                          "dynamic per-group zero point fails on grouped inputs); use symmetric=True, or "
                          "asymmetric per_tensor / per_channel (per token) with is_dynamic=True")
    if spec.zero_point_type is ZeroPointType.float32:
        if spec.symmetric:
            raise ConfigError(f"{path}.zero_point_type", "float32 zero points are for asymmetric int (symmetric "
                              "quantization has zero point 0); set symmetric=False or remove it")
        if dynamic or scheme == PER_GROUP:
            raise ConfigError(f"{path}.zero_point_type", f"float32 zero points are supported for per_tensor and "
                              f"per_channel weights and static activations, not {scheme} {kind}s; use int32")


def verify_spec(spec: QuantizationSpec, role: str, path: str) -> None:
    """Raise ConfigError unless ``spec`` maps to a Brevitas quantizer for ``role``.

    ``role`` is one of ``weight``, ``input_tensors``, ``output_tensors``, ``bias``.
    """
    _check_types(spec, path)
    kind = _ROLE_KIND[role]
    if kind == "bias":
        _verify_bias(spec, path)
        return
    spec = spec.resolved(path)
    if spec.scale_type not in _SCALE_LETS:
        raise ConfigError(f"{path}.scale_type", f"{spec.scale_type.name} is not supported; allowed: "
                          f"{_allowed(_SCALE_LETS)}")
    _verify_granularity(spec, kind, path)
    scheme = scheme_of(spec, kind)
    _verify_format(spec, kind, scheme, path)
    _verify_options(spec, kind, scheme, path)
    key = (kind, spec.quant_type, spec.param_type, scheme, spec.symmetric)
    if key not in _TABLE:
        raise ConfigError(path, f"no Brevitas quantizer for {spec.short()} as {role}; supported: "
                          + "; ".join(sorted(_describe(k) for k in _TABLE if k[0] == kind)))


def _describe(key: tuple[str, QuantType, ParamType, str, bool]) -> str:
    _, quant_type, param_type, scheme, symmetric = key
    return f"{quant_type.name} {param_type.name} {scheme} {'sym' if symmetric else 'asym'}"


def build_quantizer(spec: QuantizationSpec | None, role: str) -> Any:
    """The Brevitas injector for ``spec`` in ``role`` (``None`` for no quantization).

    Assumes ``spec`` passed :func:`verify_spec`; see the module docstring for the scaling choice.
    """
    if spec is None:
        return None
    spec = spec.resolved()
    kind = _ROLE_KIND[role]
    if kind == "bias":
        return _BIAS[spec.bit_width]
    scheme = scheme_of(spec, kind)
    base = _TABLE[(kind, spec.quant_type, spec.param_type, scheme, spec.symmetric)]
    lets: dict[str, Any] = {"bit_width": spec.bit_width, **_ROUNDING[spec.round_method]}
    if scheme != MX:  # the MX rows carry the OCP power-of-two rule themselves
        lets.update(_SCALE_LETS[spec.scale_type])
    if spec.quant_type is FLOAT:
        lets["exponent_bit_width"] = spec.exponent_bit_width
        lets["mantissa_bit_width"] = spec.mantissa_bit_width
    if scheme in (PER_GROUP, MX):
        lets["group_size"] = spec.group_size
    if kind == "weight" and spec.param_type is ParamType.stats:
        lets["scaling_impl_type"] = ScalingImplType.PARAMETER_FROM_STATS
        if not spec.symmetric:
            lets["zero_point_impl"] = ParameterFromStatsFromParameterZeroPoint
    if spec.zero_point_type is ZeroPointType.float32:
        lets["quantize_zero_point"] = False
    if spec.percentile is not None:
        lets.update(_percentile_lets(spec))
    return base.let(**lets)


def _percentile_lets(spec: QuantizationSpec) -> dict[str, Any]:
    """The calibration statistic of static activations: the ``percentile`` of |x| (symmetric) or the
    ``percentile`` and ``100 - percentile`` of x (asymmetric); 100 is the max (and min)."""
    percentile = float(spec.percentile)
    if spec.quant_type is FLOAT:  # OCP float activations calibrate on max |x| by default
        return {} if percentile == 100 else {"scaling_stats_op": StatsOp.PERCENTILE, "high_percentile_q": percentile}
    if spec.symmetric:
        return {"high_percentile_q": percentile}
    if percentile == 100:  # Brevitas's percentile cannot take the 0th: use min/max statistics
        return {"scaling_stats_op": StatsOp.MIN_MAX, **_ZERO_MIN_MAX, "zero_point_stats_impl": NegativeMinOrZero}
    return {"high_percentile_q": percentile, "low_percentile_q": 100.0 - percentile}


__all__ = ["DEFAULT_PERCENTILE", "RoundHalfAwayFromZeroSte", "build_quantizer", "scheme_of", "verify_spec"]
