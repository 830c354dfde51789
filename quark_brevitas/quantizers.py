"""The one translation table: a QuantizationSpec and a tensor role -> a Brevitas quant injector.

Every supported combination of (role, quant type, param type, qscheme, symmetry) maps to the
closest existing Brevitas quantizer class in ``_TABLE``; scale type and bit widths are applied with
``.let(...)``. Anything not in the table is rejected by :func:`verify_spec` at config time with a
message saying what is supported — there are no silent fallbacks.

Weight quantizers use ``ScalingImplType.PARAMETER_FROM_STATS`` (and a parameter zero point for
asymmetric weights): the scale is computed once from the float weight and then kept as a
parameter. Brevitas's default per-call ``STATS`` weight scaling recomputes the scale from whatever
the weight currently is, which would let GPTQ/GPFQ's updated weights silently move their own grid;
a parameter scale is also what QAT needs to learn.
"""

from __future__ import annotations

from typing import Any

from brevitas.core.function_wrapper.ops_ste import CeilSte
from brevitas.core.restrict_val import RestrictValueType
from brevitas.core.scaling import ScalingImplType
from brevitas.core.zero_point import ParameterFromStatsFromParameterZeroPoint
from brevitas.quant import scaled_int as bq_int
from brevitas.quant import shifted_scaled_int as bq_shifted
from brevitas.quant.float_quant_ocp import (
    FpOCPActPerTensorFloat,
    FpOCPActPerTensorFloatMSE,
    FpOCPWeightPerChannelFloat,
    FpOCPWeightPerChannelFloatMSE,
    FpOCPWeightPerTensorFloat,
    FpOCPWeightPerTensorFloatMSE,
)

from quark_brevitas.config import ParamType, QuantizationSpec, QuantType
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import QSchemeType, ScaleType

Q = QSchemeType
P = ParamType
INT = QuantType.int_quant
FLOAT = QuantType.float_quant

# (kind, quant type, param type, qscheme, symmetric) -> Brevitas base quantizer.
_TABLE: dict[tuple[str, QuantType, ParamType, QSchemeType, bool], type] = {
    # integer weights (narrow range, signed when symmetric, unsigned + zero point when not)
    ("weight", INT, P.stats, Q.per_tensor, True): bq_int.Int8WeightPerTensorFloat,
    ("weight", INT, P.stats, Q.per_channel, True): bq_int.Int8WeightPerChannelFloat,
    ("weight", INT, P.mse, Q.per_tensor, True): bq_int.Int8WeightPerTensorFloatMSE,
    ("weight", INT, P.mse, Q.per_channel, True): bq_int.Int8WeightPerChannelFloatMSE,
    ("weight", INT, P.stats, Q.per_tensor, False): bq_shifted.ShiftedUint8WeightPerTensorFloat,
    ("weight", INT, P.stats, Q.per_channel, False): bq_shifted.ShiftedUint8WeightPerChannelFloat,
    ("weight", INT, P.mse, Q.per_tensor, False): bq_shifted.ShiftedUint8WeightPerTensorFloatMSE,
    ("weight", INT, P.mse, Q.per_channel, False): bq_shifted.ShiftedUint8WeightPerChannelFloatMSE,
    # integer activations (per tensor; percentile statistics or MSE, collected during calibration)
    ("act", INT, P.stats, Q.per_tensor, True): bq_int.Int8ActPerTensorFloat,
    ("act", INT, P.mse, Q.per_tensor, True): bq_int.Int8ActPerTensorFloatMSE,
    ("act", INT, P.stats, Q.per_tensor, False): bq_shifted.ShiftedUint8ActPerTensorFloat,
    ("act", INT, P.mse, Q.per_tensor, False): bq_shifted.ShiftedUint8ActPerTensorFloatMSE,
    # OCP floating point (saturating; e4m3 / e5m2 carry the OCP NaN/Inf encodings)
    ("weight", FLOAT, P.stats, Q.per_tensor, True): FpOCPWeightPerTensorFloat,
    ("weight", FLOAT, P.stats, Q.per_channel, True): FpOCPWeightPerChannelFloat,
    ("weight", FLOAT, P.mse, Q.per_tensor, True): FpOCPWeightPerTensorFloatMSE,
    ("weight", FLOAT, P.mse, Q.per_channel, True): FpOCPWeightPerChannelFloatMSE,
    ("act", FLOAT, P.stats, Q.per_tensor, True): FpOCPActPerTensorFloat,
    ("act", FLOAT, P.mse, Q.per_tensor, True): FpOCPActPerTensorFloatMSE,
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

INT_BIT_WIDTHS = {"weight": range(2, 9), "act": range(2, 17)}
FLOAT_BIT_WIDTHS = range(4, 9)
_ROLE_KIND = {"weight": "weight", "input_tensors": "act", "output_tensors": "act", "bias": "bias"}


def _allowed(values: Any) -> str:
    return ", ".join(str(getattr(v, "name", v)) for v in values)


def _check_types(spec: QuantizationSpec, path: str) -> None:
    from quark_brevitas.types import QSchemeType as _Q

    expected = {
        "qscheme": _Q,
        "scale_type": ScaleType,
        "quant_type": QuantType,
        "param_type": ParamType,
    }
    for name, enum_cls in expected.items():
        value = getattr(spec, name)
        if not isinstance(value, enum_cls):
            raise ConfigError(f"{path}.{name}", f"must be a {enum_cls.__name__}; allowed: {_allowed(enum_cls)}")
    if not isinstance(spec.symmetric, bool):
        raise ConfigError(f"{path}.symmetric", f"must be True or False, got {spec.symmetric!r}")
    for name in ("bit_width", "exponent_bit_width", "mantissa_bit_width"):
        value = getattr(spec, name)
        if value is None and name != "bit_width":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}.{name}", f"must be an integer, got {value!r}")


def _verify_bias(spec: QuantizationSpec, path: str) -> None:
    if spec.bit_width not in _BIAS:
        raise ConfigError(f"{path}.bit_width", f"bias bit width {spec.bit_width} unsupported; allowed: {sorted(_BIAS)}")
    defaults = QuantizationSpec(bit_width=spec.bit_width)
    for name in ("qscheme", "symmetric", "scale_type", "quant_type", "param_type", "exponent_bit_width",
                 "mantissa_bit_width"):
        if getattr(spec, name) != getattr(defaults, name):
            raise ConfigError(
                f"{path}.{name}",
                "bias is quantized to integers with scale = input scale x weight scale; only bit_width "
                f"can be set (leave {name} at its default {getattr(defaults, name)!r})",
            )


def verify_spec(spec: QuantizationSpec, role: str, path: str) -> None:
    """Raise ConfigError unless ``spec`` maps to a Brevitas quantizer for ``role``.

    ``role`` is one of ``weight``, ``input_tensors``, ``output_tensors``, ``bias``.
    """
    if not isinstance(spec, QuantizationSpec):
        raise ConfigError(path, f"must be a QuantizationSpec (QTensorConfig) or None, got {type(spec).__name__}")
    _check_types(spec, path)
    kind = _ROLE_KIND[role]
    if kind == "bias":
        _verify_bias(spec, path)
        return
    if spec.scale_type not in _SCALE_LETS:
        raise ConfigError(f"{path}.scale_type", f"{spec.scale_type.name} is not supported; allowed: "
                          f"{_allowed(_SCALE_LETS)}")
    if spec.qscheme is QSchemeType.per_group:
        raise ConfigError(f"{path}.qscheme", "per_group is not supported yet; allowed: per_tensor, per_channel")
    if kind == "act" and spec.qscheme is not QSchemeType.per_tensor:
        raise ConfigError(f"{path}.qscheme", "activations are quantized per_tensor only; allowed: per_tensor")
    if spec.quant_type is INT:
        for name in ("exponent_bit_width", "mantissa_bit_width"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"{path}.{name}", "only used by float_quant; leave it None for int_quant")
        widths = INT_BIT_WIDTHS[kind]
        if spec.bit_width not in widths:
            raise ConfigError(f"{path}.bit_width", f"{spec.bit_width} is out of range for int_quant "
                              f"{'weights' if kind == 'weight' else 'activations'}; allowed: "
                              f"{widths.start}..{widths.stop - 1}")
    else:
        e, m = spec.exponent_bit_width, spec.mantissa_bit_width
        for name, value in (("exponent_bit_width", e), ("mantissa_bit_width", m)):
            if value is None:
                raise ConfigError(f"{path}.{name}", "float_quant needs exponent_bit_width and mantissa_bit_width "
                                  "(e.g. 4 and 3 for fp8 e4m3, 5 and 2 for fp8 e5m2)")
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
    key = (kind, spec.quant_type, spec.param_type, spec.qscheme, spec.symmetric)
    if key not in _TABLE:
        raise ConfigError(path, f"no Brevitas quantizer for {spec.short()} as {role}; supported: "
                          + "; ".join(sorted(_describe(k) for k in _TABLE if k[0] == kind)))


def _describe(key: tuple[str, QuantType, ParamType, QSchemeType, bool]) -> str:
    _, quant_type, param_type, qscheme, symmetric = key
    return f"{quant_type.name} {param_type.name} {qscheme.name} {'sym' if symmetric else 'asym'}"


def build_quantizer(spec: QuantizationSpec | None, role: str) -> Any:
    """The Brevitas injector for ``spec`` in ``role`` (``None`` for no quantization).

    Assumes ``spec`` passed :func:`verify_spec`; see the module docstring for the scaling choice.
    """
    if spec is None:
        return None
    kind = _ROLE_KIND[role]
    if kind == "bias":
        return _BIAS[spec.bit_width]
    base = _TABLE[(kind, spec.quant_type, spec.param_type, spec.qscheme, spec.symmetric)]
    lets: dict[str, Any] = {"bit_width": spec.bit_width, **_SCALE_LETS[spec.scale_type]}
    if spec.quant_type is FLOAT:
        lets["exponent_bit_width"] = spec.exponent_bit_width
        lets["mantissa_bit_width"] = spec.mantissa_bit_width
    if kind == "weight" and spec.param_type is ParamType.stats:
        lets["scaling_impl_type"] = ScalingImplType.PARAMETER_FROM_STATS
        if not spec.symmetric:
            lets["zero_point_impl"] = ParameterFromStatsFromParameterZeroPoint
    return base.let(**lets)


__all__ = ["build_quantizer", "verify_spec"]
