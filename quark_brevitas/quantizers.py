"""The one translation table: a QuantizationSpec and a tensor role -> a Brevitas quant injector.

Every supported combination of (role, quant type, param type, scheme, symmetry) maps to the closest
existing Brevitas quantizer class in ``_TABLE``; bit widths, scale type, rounding, zero-point type and
percentile are applied with ``.let(...)``. Which combinations exist, and every rule a spec must follow, is
stated without Brevitas in :mod:`quark_brevitas.config.checks` (its ``SUPPORTED_QUANTIZERS`` are this
table's keys; a test keeps them equal), so anything not in the table is rejected at config time
with a message saying what is supported — there are no silent fallbacks. This module builds the injectors
once the model is planned. A spec's ``dtype`` short form is spelled out first
(:func:`quark_brevitas.config.resolve_dtype`).

The *scheme* column refines ``qscheme``: ``per_group`` with float scales, ``mx`` (``per_group`` with
``scale_type=pof2``: one power-of-two scale per block chosen by the OCP MX rule, shared exponent
``floor(log2(max|block|)) - emax(element)``), and for activations ``dynamic_per_tensor`` /
``dynamic_per_token`` (``is_dynamic=True``). Per-group activations are always dynamic; symmetric int8 ones compute
their codes as onnxruntime's int8 ``MatMulNBits`` kernel does, ``round(x * (127 / max|x|))`` (see
:func:`_is_reciprocal_int8`).

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

from dataclasses import replace
from typing import Any

import torch
from brevitas.core.function_wrapper.ops_ste import CeilSte, FloorSte, RoundSte
from brevitas.core.restrict_val import RestrictValueType
from brevitas.core.scaling import IntScaling, ScalingImplType
from brevitas.core.stats import (
    AbsMinMax,
    NegativeMinOrZero,
    NegativePercentileOrZero,
    PercentileInterval,
    SignedAbsMax,
    StatsOp,
)
from brevitas.core.zero_point import ParameterFromStatsFromParameterZeroPoint
from brevitas.inject.enum import FloatToIntImplType, ScalingPerOutputType
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

from quark_brevitas.brevitas_adapter import RECIPROCAL_INT8_LETS
from quark_brevitas.brevitas_adapter import generative_quantizers as bq_gen
from quark_brevitas.brevitas_adapter.kquant import KQuantScaleRestrict
from quark_brevitas.brevitas_adapter.kquant_minimum import KQUANT_MINIMUM_LETS
from quark_brevitas.config.checks import (
    BIAS_BIT_WIDTHS,
    DEFAULT_PERCENTILE,
    DYNAMIC_PER_TENSOR,
    DYNAMIC_PER_TOKEN,
    FLOAT,
    FLOAT16_SIGNIFICANT_BITS,
    INT,
    MX,
    PER_CHANNEL,
    PER_GROUP,
    PER_TENSOR,
    ROLE_KIND,
    QuantizerKey,
    float16_scale_bits,
    scheme_of,
    unsupported,
)
from quark_brevitas.config.checks import verify_spec as verify_spec_rules
from quark_brevitas.config.enums import ParamType, RoundType, ScaleType, ZeroPointType
from quark_brevitas.config.formats import MIN_MAX_OBSERVERS
from quark_brevitas.config.kquants import KQUANT_BY_BITS
from quark_brevitas.config.specs import QuantizationSpec, narrow_range_of

P = ParamType
_GROUP = {"scaling_per_output_type": ScalingPerOutputType.GROUP}
_OCP_MX_INT = {"int_scaling_impl": IntScaling, "narrow_range": True}


class HalfStepIntScaling(nn.Module):
    """The full two's-complement range's divisor as Quark computes it: ``(qmax - qmin) / 2 = 2^(b-1) - 1/2``
    (int3: 3.5, int2: 1.5), so ``+max|w|`` lands on ``qmax + 1/2`` and rounds to ``qmax`` while ``-max|w|``
    rounds to ``qmin`` (half to even) -- every code is used and no weight is clipped by more than half a
    step. Brevitas's ``IntScaling`` with ``narrow_range=False`` divides by ``2^(b-1)`` (clipping the top
    weights by a whole step: measured worse at 2-3 bits, see the README's Number formats section); the
    constructor takes what the injector gives ``IntScaling``."""

    def __init__(self, narrow_range: bool, signed: bool | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.narrow_range = narrow_range
        self.signed = signed
        self.dtype = dtype

    def forward(self, bit_width: torch.Tensor, signed: bool | torch.Tensor | None = None) -> torch.Tensor:
        is_signed = self.signed if signed is None else bool(signed)
        if not is_signed or self.narrow_range:
            raise ValueError("HalfStepIntScaling is the full range of signed integers: narrow_range=False, "
                             f"signed=True; got narrow_range={self.narrow_range}, signed={is_signed}")
        return (torch.exp2(bit_width - 1) - 0.5).to(dtype=self.dtype)


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

# (kind, quant type, param type, scheme, symmetric) -> Brevitas base quantizer; the keys are
# quark_brevitas.config.checks.SUPPORTED_QUANTIZERS, in the same order.
_TABLE: dict[QuantizerKey, type] = {
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

_BIAS: dict[int, type] = dict(zip(BIAS_BIT_WIDTHS, (bq_int.Int8Bias, bq_int.Int16Bias, bq_int.Int24Bias,
                                                      bq_int.Int32Bias), strict=True))

_SCALE_LETS: dict[ScaleType, dict[str, Any]] = {
    ScaleType.float: {},
    ScaleType.pof2: {
        "restrict_scaling_type": RestrictValueType.POWER_OF_TWO,
        "restrict_value_float_to_int_impl": CeilSte,
    },
    ScaleType.pof2_round: {
        "restrict_scaling_type": RestrictValueType.POWER_OF_TWO,
        "restrict_value_float_to_int_impl": RoundSte,
    },
    ScaleType.float16: {},  # significant bits depend on the spec: _scale_lets
}

#: The smallest positive float16 (a subnormal) and the largest finite one.
_FLOAT16_TINY = 2.0 ** -24
_FLOAT16_MAX = 65504.0


class _RoundToSignificantBits(torch.autograd.Function):
    """``x`` rounded (half to even) to ``bits`` significant bits on float16's grid (no step finer than its
    smallest subnormal, clamped to its finite range); identity gradient (straight-through, for QAT)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bits: int) -> torch.Tensor:
        magnitude = x.abs().clamp(min=_FLOAT16_TINY, max=_FLOAT16_MAX)
        step = torch.exp2(torch.floor(torch.log2(magnitude)) - (bits - 1)).clamp(min=_FLOAT16_TINY)
        rounded = (torch.round(magnitude / step) * step).clamp(min=_FLOAT16_TINY, max=_FLOAT16_MAX)
        return torch.sign(x) * rounded

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Float16ScaleRestrict(nn.Module):
    """``scale_type=float16`` as Brevitas's ``restrict_scale_threshold_impl``: the final scale (the scale
    parameter divided by the integer range, after which nothing changes it) is rounded to a float16 number of
    ``scale_significant_bits`` significant bits, so a file storing scales as float16 (GGUF) holds them
    exactly. Brevitas has power-of-two and log restrictions, no float16 one."""

    def __init__(self, scale_significant_bits: int) -> None:
        super().__init__()
        self.bits = int(scale_significant_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RoundToSignificantBits.apply(x, self.bits)


def _scale_lets(spec: QuantizationSpec) -> dict[str, Any]:
    """The ``.let`` arguments of the spec's scale type."""
    if spec.scale_type is ScaleType.float16:
        return {"restrict_scale_threshold_impl": Float16ScaleRestrict,
                "scale_significant_bits": float16_scale_bits(spec)}
    if spec.scale_type is ScaleType.gguf_0:
        # llama.cpp's Q4_0 / Q5_0 scale: d = (the group's signed largest-magnitude weight) / -2^(b-1), so that
        # weight lands on the most negative code exactly and the step is max|w| / 2^(b-1) (finer than the full
        # range's max|w| / (2^(b-1) - 1/2)); Brevitas's SignedAbsMax is that statistic negated, its IntScaling
        # of the full range divides by 2^(b-1). Brevitas's signed-float restriction (not its default, which takes
        # |scale|) and the float16 rounding keep the sign.
        return {"restrict_scale_threshold_impl": Float16ScaleRestrict,
                "scale_significant_bits": FLOAT16_SIGNIFICANT_BITS, "scaling_stats_impl": SignedAbsMax,
                "restrict_scaling_type": RestrictValueType.SIGNED_FP}
    if spec.scale_type is ScaleType.gguf_k:
        kquant = KQUANT_BY_BITS[spec.bit_width]
        lets = {"restrict_scale_threshold_impl": KQuantScaleRestrict,
                "kquant_groups_per_super_block": kquant.groups_per_super_block,
                "kquant_sub_scale_max": kquant.sub_scale_max}
        if not spec.symmetric:  # llama.cpp's d * sc * q - dmin * m (quark_brevitas.brevitas_adapter.kquant_minimum)
            lets.update(KQUANT_MINIMUM_LETS, kquant_minimum_max=kquant.minimum_max,
                        kquant_code_max=2 ** spec.bit_width - 1)
        return lets
    return _SCALE_LETS[spec.scale_type]

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


#: The offset, in steps, that turns round half to even into ties-up rounding (``RoundType.half_up``): finer than
#: any grid the exact graph arithmetic produces (2^-15 steps), coarse enough that ``|x / scale| < 2^8`` plus it
#: is exact in float32.
TIES_UP_OFFSET = 2.0 ** -16
#: What ``RoundType.half_up`` quantizers write as a QONNX ``Quant`` node's ``rounding_mode``: the name of the Brevitas
#: rounding its exporter traces the node's values with (Brevitas knows no ties-up rounding; its DPU rounding rounds
#: negative ties up and positive ones to even). The QONNX export rewrites every such node into the exact form
#: (:mod:`quark_brevitas.export.onnx.ties_up`), so no file keeps it; nothing else in quark_brevitas rounds this way.
TIES_UP_MODE = "DPU"


class RoundTiesUpSte(nn.Module):
    """``RoundType.half_up`` as a Brevitas ``float_to_int_impl``: ``round_half_even(x + 2^-16)`` with an identity
    gradient (see :data:`TIES_UP_OFFSET`)."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (torch.round(x + TIES_UP_OFFSET) - x).detach()


#: Element rounding (``round_method``); ``None`` is Brevitas's default, round half to even.
_ROUNDING: dict[RoundType | None, dict[str, Any]] = {
    None: {},
    RoundType.half_even: {"float_to_int_impl": RoundSte},
    RoundType.floor: {"float_to_int_impl": FloorSte},
    RoundType.round: {"float_to_int_impl": RoundHalfAwayFromZeroSte},
    RoundType.half_up: {"float_to_int_impl": RoundTiesUpSte, "float_to_int_impl_type": FloatToIntImplType.DPU},
}

def verify_spec(spec: QuantizationSpec, role: str, path: str) -> None:
    """Raise ConfigError unless ``spec`` maps to a Brevitas quantizer for ``role`` (``weight``,
    ``input_tensors``, ``output_tensors`` or ``bias``): the rules of
    :func:`quark_brevitas.config.checks.verify_spec`, then the row of this table that will build it."""
    verify_spec_rules(spec, role, path)
    if ROLE_KIND[role] != "bias":
        _row(spec.resolved(path), role, path)


def table_keys() -> tuple[QuantizerKey, ...]:
    """The rows of the translation table, in order (a test checks they are the config package's
    ``SUPPORTED_QUANTIZERS``, the torch-free statement of the same combinations)."""
    return tuple(_TABLE)


def _row(spec: QuantizationSpec, role: str, path: str) -> type:
    """The table's base quantizer for a resolved spec; the same ConfigError as the config check if the table
    lacks the row (the two tables are kept equal by a test, so this names the spec rather than a KeyError)."""
    kind = ROLE_KIND[role]
    key = (kind, spec.quant_type, spec.param_type, scheme_of(spec, kind), spec.symmetric)
    if key not in _TABLE:
        raise unsupported(spec, role, path)
    return _TABLE[key]


def build_quantizer(spec: QuantizationSpec | None, role: str) -> Any:
    """The Brevitas injector for ``spec`` in ``role`` (``None`` for no quantization).

    Assumes ``spec`` passed :func:`verify_spec`; see the module docstring for the scaling choice.
    """
    if spec is None:
        return None
    spec = spec.resolved()
    kind = ROLE_KIND[role]
    if kind == "bias":
        return _BIAS[spec.bit_width]
    scheme = scheme_of(spec, kind)
    base = _row(spec, role, role)
    lets: dict[str, Any] = {"bit_width": spec.bit_width, **_ROUNDING[spec.round_method]}
    if scheme != MX:  # the MX rows carry the OCP power-of-two rule themselves
        lets.update(_scale_lets(spec))
    if spec.quant_type is FLOAT:
        lets["exponent_bit_width"] = spec.exponent_bit_width
        lets["mantissa_bit_width"] = spec.mantissa_bit_width
    if scheme in (PER_GROUP, MX):
        lets["group_size"] = spec.group_size
    if _is_reciprocal_int8(spec, kind, scheme):
        lets.update(RECIPROCAL_INT8_LETS)
    if kind == "weight" and spec.quant_type is INT and spec.symmetric and scheme != MX:
        lets.update(_range_lets(spec))
    if kind == "weight" and spec.param_type is ParamType.stats:
        lets["scaling_impl_type"] = ScalingImplType.PARAMETER_FROM_STATS
        if not spec.symmetric:
            lets["zero_point_impl"] = ParameterFromStatsFromParameterZeroPoint
    if spec.zero_point_type is ZeroPointType.float32:
        lets["quantize_zero_point"] = False
    if spec.percentile is None and kind == "act" and scheme == PER_TENSOR and spec.observer_cls in MIN_MAX_OBSERVERS:
        spec = replace(spec, percentile=100.0)  # Quark's min-max observer: the maximum, not the default percentile
    if spec.percentile is not None:
        lets.update(_percentile_lets(spec))
    return base.let(**lets)


def _is_reciprocal_int8(spec: QuantizationSpec, kind: str, scheme: str) -> bool:
    """Dynamic symmetric int8 per-group activations with float scales compute their codes as onnxruntime's
    ``MatMulNBits`` at accuracy level 4 does, ``round(x * (127 / max|x|))`` rather than Brevitas's
    ``round(x / (max|x| / 127))`` (the two differ only at near-ties, about twice per million elements): what the
    deployment runtime computes, so the export feeds the raw input to that kernel
    (:mod:`quark_brevitas.brevitas_adapter.reciprocal`, README "W4 + int8 inputs per group")."""
    return (kind == "act" and scheme == PER_GROUP and spec.quant_type is INT and spec.symmetric
            and spec.bit_width == 8 and spec.scale_type is ScaleType.float)


def _range_lets(spec: QuantizationSpec) -> dict[str, Any]:
    """Narrow or full two's-complement codes for a symmetric integer weight (:func:`narrow_range_of`); the full
    range takes Quark's divisor (:class:`HalfStepIntScaling`) except with power-of-two scales, where Brevitas's
    ``2^(b-1)`` keeps the scale a power of two."""
    if narrow_range_of(spec):
        return {"narrow_range": True}
    if spec.scale_type in (ScaleType.pof2, ScaleType.pof2_round, ScaleType.gguf_0):  # their own divisor, 2^(b-1)
        return {"narrow_range": False}
    return {"narrow_range": False, "int_scaling_impl": HalfStepIntScaling}


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


__all__ = ["DEFAULT_PERCENTILE", "TIES_UP_MODE", "TIES_UP_OFFSET", "HalfStepIntScaling", "RoundHalfAwayFromZeroSte",
           "RoundTiesUpSte", "build_quantizer", "scheme_of", "table_keys", "verify_spec"]
