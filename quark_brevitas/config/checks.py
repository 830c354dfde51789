"""The checks of a config that need neither the model nor Brevitas: every rejection names its field path
and what is allowed.

Three layers of checks, each in the one place that knows the rule:

1. Types: every field against its own annotation (:func:`quark_brevitas.config.serialization.check_fields`,
   the same walker the file parser uses), so a ``QTensorConfig(bit_width="8")`` built in code fails like
   ``bit_width: "8"`` in a file.
2. Tensor specs (:func:`verify_spec`): which (role, quant type, param type, scheme, symmetry) combinations
   have a Brevitas quantizer (:data:`SUPPORTED_QUANTIZERS`, the keys of the translation table in
   :mod:`quark_brevitas.quantizers`, which a test keeps equal), the bit-width ranges and the option rules;
   here too how the specs of one layer relate (a quantized bias needs int input and weight scales).
3. Algorithms: each algorithm's own ``verify`` for its parameters, and here the rules between entries.

The rules are stated here, without importing Brevitas, so that loading and verifying a config file is
quick and works where torch is not importable; the translation table builds the injectors for exactly
these combinations once the model is planned. :func:`quark_brevitas.config.verify_config` (beside the
Config class) runs them on a whole config; checks that need the model (do the layer names exist? what does
a layer get once the levels are merged?) are in :mod:`quark_brevitas.resolve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quark_brevitas.config import algorithms
from quark_brevitas.config.enums import (
    DeviceType,
    ParamType,
    QSchemeType,
    QuantType,
    RoundType,
    ScaleType,
    ZeroPointType,
)
from quark_brevitas.config.kquants import verify_gguf_scales
from quark_brevitas.config.serialization import check_fields
from quark_brevitas.config.specs import (
    TENSOR_ROLES,
    QuantHierarchy,
    QuantizationConfig,
    QuantizationSpec,
    spec_defaults,
)
from quark_brevitas.errors import ConfigError

__all__ = [
    "BIAS_BIT_WIDTHS",
    "DEFAULT_PERCENTILE",
    "DYNAMIC_PER_TENSOR",
    "DYNAMIC_PER_TOKEN",
    "FLOAT16_SIGNIFICANT_BITS",
    "FLOAT_BIT_WIDTHS",
    "HIERARCHY_LEVELS",
    "INT_BIT_WIDTHS",
    "MX",
    "PER_CHANNEL",
    "PER_GROUP",
    "PER_TENSOR",
    "ROLE_KIND",
    "SUPPORTED_QUANTIZERS",
    "SUPPORTED_SCALE_TYPES",
    "QuantizerKey",
    "float16_scale_bits",
    "scheme_of",
    "verify_algorithms",
    "verify_layer_config",
    "verify_partial_layer_config",
    "verify_spec",
]

#: The Config fields that map layer types / layer names to a QuantizationConfig (Quark's hierarchy).
HIERARCHY_LEVELS = ("layer_type_quant_config", "layer_quant_config")

P = ParamType
INT = QuantType.int_quant
FLOAT = QuantType.float_quant

# Schemes: ``qscheme`` refined by scale type and dynamism (the scheme column of the translation table).
PER_TENSOR, PER_CHANNEL, PER_GROUP, MX = "per_tensor", "per_channel", "per_group", "mx"
DYNAMIC_PER_TENSOR, DYNAMIC_PER_TOKEN = "dynamic_per_tensor", "dynamic_per_token"

#: (kind, quant type, param type, scheme, symmetric): one row of the translation table.
QuantizerKey = tuple[str, QuantType, ParamType, str, bool]

#: Every combination that has a Brevitas quantizer, in the order of the translation table
#: (:mod:`quark_brevitas.quantizers` maps each to its injector; a test keeps the two equal).
SUPPORTED_QUANTIZERS: tuple[QuantizerKey, ...] = (
    # integer weights (narrow range, signed when symmetric, unsigned + zero point when not)
    ("weight", INT, P.stats, PER_TENSOR, True),
    ("weight", INT, P.stats, PER_CHANNEL, True),
    ("weight", INT, P.mse, PER_TENSOR, True),
    ("weight", INT, P.mse, PER_CHANNEL, True),
    ("weight", INT, P.stats, PER_TENSOR, False),
    ("weight", INT, P.stats, PER_CHANNEL, False),
    ("weight", INT, P.mse, PER_TENSOR, False),
    ("weight", INT, P.mse, PER_CHANNEL, False),
    # integer weights per group of input channels (float scale per group)
    ("weight", INT, P.stats, PER_GROUP, True),
    ("weight", INT, P.mse, PER_GROUP, True),
    ("weight", INT, P.stats, PER_GROUP, False),
    ("weight", INT, P.mse, PER_GROUP, False),
    # integer activations (per tensor; percentile statistics or MSE, collected during calibration)
    ("act", INT, P.stats, PER_TENSOR, True),
    ("act", INT, P.mse, PER_TENSOR, True),
    ("act", INT, P.stats, PER_TENSOR, False),
    ("act", INT, P.mse, PER_TENSOR, False),
    # OCP floating point
    ("weight", FLOAT, P.stats, PER_TENSOR, True),
    ("weight", FLOAT, P.stats, PER_CHANNEL, True),
    ("weight", FLOAT, P.mse, PER_TENSOR, True),
    ("weight", FLOAT, P.mse, PER_CHANNEL, True),
    ("weight", FLOAT, P.stats, PER_GROUP, True),
    ("weight", FLOAT, P.mse, PER_GROUP, True),
    ("act", FLOAT, P.stats, PER_TENSOR, True),
    ("act", FLOAT, P.mse, PER_TENSOR, True),
    # OCP MX: blocks sharing a power-of-two scale (E8M0), weights and (always dynamic) activations
    ("weight", INT, P.stats, MX, True),
    ("weight", FLOAT, P.stats, MX, True),
    ("act", INT, P.stats, MX, True),
    ("act", FLOAT, P.stats, MX, True),
    # dynamic activations: scales from each input at run time
    ("act", INT, P.stats, PER_GROUP, True),
    ("act", FLOAT, P.stats, PER_GROUP, True),
    ("act", INT, P.stats, DYNAMIC_PER_TENSOR, True),
    ("act", INT, P.stats, DYNAMIC_PER_TENSOR, False),
    ("act", FLOAT, P.stats, DYNAMIC_PER_TENSOR, True),
    ("act", INT, P.stats, DYNAMIC_PER_TOKEN, True),
    ("act", INT, P.stats, DYNAMIC_PER_TOKEN, False),
    ("act", FLOAT, P.stats, DYNAMIC_PER_TOKEN, True),
)

#: Integer bias widths (Brevitas's Int8/16/24/32 bias quantizers).
BIAS_BIT_WIDTHS = (8, 16, 24, 32)
#: Scale types the translation table honours (the other ScaleType members are Quark's, without a Brevitas rule).
SUPPORTED_SCALE_TYPES = (ScaleType.float, ScaleType.pof2, ScaleType.pof2_round, ScaleType.float16, ScaleType.gguf_k,
                         ScaleType.gguf_0)
#: Significant bits of a float16 number (10 stored mantissa bits and the implicit one).
FLOAT16_SIGNIFICANT_BITS = 11


def float16_scale_bits(spec: QuantizationSpec) -> int:
    """Significant bits a ``scale_type=float16`` scale keeps: all 11 of float16 when symmetric; asymmetric,
    ``11 - bit_width``, so that ``scale * zero_point`` (the float16 offset formats such as GGUF Q4_1 store
    beside the scale) is a float16 number too."""
    if spec.symmetric:
        return FLOAT16_SIGNIFICANT_BITS
    return FLOAT16_SIGNIFICANT_BITS - spec.bit_width
INT_BIT_WIDTHS = {"weight": range(2, 9), "act": range(2, 17), "group": range(2, 9)}
FLOAT_BIT_WIDTHS = range(4, 9)
DEFAULT_PERCENTILE = 99.999
#: The kind of quantizer each tensor role gets.
ROLE_KIND = {"weight": "weight", "input_tensors": "act", "output_tensors": "act", "bias": "bias"}


def _allowed(values: Any) -> str:
    return ", ".join(str(getattr(v, "name", v)) for v in values)


def _check_types(spec: QuantizationSpec, path: str) -> None:
    """Field types by the spec's own annotations (the generic check the config parser uses too), then the
    one value range that does not depend on the role."""
    if not isinstance(spec, QuantizationSpec):
        raise ConfigError(path, f"must be a QuantizationSpec (QTensorConfig) or None, got {type(spec).__name__}")
    check_fields(spec, path)
    if spec.percentile is not None and not 0 < spec.percentile <= 100:
        raise ConfigError(f"{path}.percentile", f"must be in (0, 100] (e.g. 99.999; 100 = max), got {spec.percentile}")


_BIAS_FIXED = ("qscheme", "symmetric", "scale_type", "quant_type", "param_type", "exponent_bit_width",
               "mantissa_bit_width", "dtype", "group_size", "ch_axis", "round_method", "is_dynamic",
               "zero_point_type", "mx_element_dtype", "percentile", "narrow_range", "pad_groups")


def _verify_bias(spec: QuantizationSpec, path: str) -> None:
    if spec.bit_width not in BIAS_BIT_WIDTHS:
        raise ConfigError(f"{path}.bit_width",
                          f"bias bit width {spec.bit_width} unsupported; allowed: {sorted(BIAS_BIT_WIDTHS)}")
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
    if spec.pad_groups is not None and (qscheme is not QSchemeType.per_group or kind == "act"):
        raise ConfigError(f"{path}.pad_groups", "only used with per_group weights (it lets a layer whose input "
                          "channels are no multiple of group_size pad its last group); remove it")
    if spec.ch_axis is not None:
        # Quark 0.13's templates write ch_axis=-1 for per-group weights: the last dimension, a Linear weight's
        # input channels, which is what 1 means here.
        allowed = {QSchemeType.per_channel: (0,), QSchemeType.per_group: (1, -1)}.get(qscheme, ())
        if kind == "act":
            raise ConfigError(f"{path}.ch_axis", "activations follow the layer: one scale per token is over the "
                              "last dimension, groups run over the channels (Conv) or the last dimension (Linear); "
                              "leave ch_axis None")
        if spec.ch_axis not in allowed:
            raise ConfigError(f"{path}.ch_axis", f"{spec.ch_axis} is not supported for {qscheme.name} weights; "
                              f"allowed: None{''.join(f', {a}' for a in allowed)} (0: output channels for "
                              "per_channel, 1 or -1 (the last dimension): input channels for per_group)")
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
    if spec.scale_type is ScaleType.pof2_round and (scheme not in (PER_TENSOR, PER_CHANNEL) or dynamic):
        raise ConfigError(f"{path}.scale_type", "pof2_round is for static per_tensor/per_channel scales (MX: pof2)")
    if spec.round_method is RoundType.half_up and (kind != "act" or dynamic or spec.quant_type is not INT):
        raise ConfigError(f"{path}.round_method", "half_up is for static int activations; else half_even/floor/round")
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
    if spec.scale_type is ScaleType.float16 and (kind != "weight" or spec.quant_type is not QuantType.int_quant
                                                 or spec.zero_point_type is ZeroPointType.float32):
        raise ConfigError(f"{path}.scale_type", "float16 scales are supported for integer weights with integer zero "
                          "points (the scales GGUF files store); use scale_type=float here")
    if spec.scale_type in (ScaleType.gguf_k, ScaleType.gguf_0):
        verify_gguf_scales(spec, kind, scheme == PER_GROUP, path)
    if spec.narrow_range is not None and (kind != "weight" or spec.quant_type is not INT or not spec.symmetric
                                          or scheme == MX):
        raise ConfigError(f"{path}.narrow_range", "only used by symmetric int_quant weights (per_tensor, per_channel, "
                          "per_group with float scales): whether the most negative code is used; asymmetric codes "
                          "and float formats use their whole range, activations and OCP MX have fixed ranges. "
                          "Leave it None")
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
    kind = ROLE_KIND[role]
    if kind == "bias":
        _verify_bias(spec, path)
        return
    spec = spec.resolved(path)
    if spec.scale_type not in SUPPORTED_SCALE_TYPES:
        raise ConfigError(f"{path}.scale_type", f"{spec.scale_type.name} is not supported; allowed: "
                          f"{_allowed(SUPPORTED_SCALE_TYPES)}")
    _verify_granularity(spec, kind, path)
    scheme = scheme_of(spec, kind)
    _verify_format(spec, kind, scheme, path)
    _verify_options(spec, kind, scheme, path)
    key = (kind, spec.quant_type, spec.param_type, scheme, spec.symmetric)
    if key not in SUPPORTED_QUANTIZERS:
        raise unsupported(spec, role, path)


def unsupported(spec: QuantizationSpec, role: str, path: str) -> ConfigError:
    """The error for a spec whose combination has no Brevitas quantizer, listing the supported ones."""
    kind = ROLE_KIND[role]
    return ConfigError(path, f"no Brevitas quantizer for {spec.short()} as {role}; supported: "
                       + "; ".join(sorted(_describe(k) for k in SUPPORTED_QUANTIZERS if k[0] == kind)))


def _describe(key: QuantizerKey) -> str:
    _, quant_type, param_type, scheme, symmetric = key
    return f"{quant_type.name} {param_type.name} {scheme} {'sym' if symmetric else 'asym'}"


def verify_algorithms(pre_quant: Sequence[algorithms.AlgorithmConfig], post_quant: Sequence[algorithms.AlgorithmConfig],
                      hierarchy: QuantHierarchy) -> None:
    """Each algorithm's own ``verify`` (against the config's levels ``hierarchy``), then the rules between
    entries. ``pre_quant`` / ``post_quant`` are the Config's ``pre_quant_opt_config`` / ``algo_config``."""
    for name, algos in (("pre_quant_opt_config", pre_quant), ("algo_config", post_quant)):
        for index, algo in enumerate(algos):
            algo.verify(hierarchy, f"{name}[{index}]")
    _verify_algorithm_combinations(pre_quant, post_quant)


def _verify_algorithm_combinations(pre_quant: Sequence[algorithms.AlgorithmConfig],
                                   post_quant: Sequence[algorithms.AlgorithmConfig]) -> None:
    """The rules between entries: no algorithm twice, ``algo_config`` in an order where no step undoes an
    earlier one (:data:`~quark_brevitas.config.algorithms.EFFECTS`), at most one weight-rounding algorithm."""
    _verify_no_duplicates(pre_quant, post_quant)
    _verify_order(post_quant)
    _verify_rotation_first(pre_quant, post_quant)
    post = [a for a in post_quant if a.effect == "rounding"]
    if len({type(a) for a in post}) > 1:
        names = sorted({type(a).__name__ for a in post})
        allowed = sorted(cls.__name__ for cls in algorithms.registered(algorithms.AlgorithmConfig)
                         if getattr(cls, "effect", "") == "rounding")
        raise ConfigError("algo_config", f"use at most one of the rounding algorithms {', '.join(allowed)} (got "
                                         f"{names}): each rounds the weights again, undoing the one before")


def _verify_no_duplicates(pre_quant: Sequence[algorithms.AlgorithmConfig],
                          post_quant: Sequence[algorithms.AlgorithmConfig]) -> None:
    """An algorithm listed twice (in either list) would run twice: a second SmoothQuant or equalization pass
    wraps or rescales already transformed layers, a second rounding pass undoes the first. Corrections
    (BiasCorrection, CalibrateBatchNorm) are exempt: each run re-measures the model as it then is."""
    seen: dict[type, str] = {}
    entries = [(f"pre_quant_opt_config[{i}]", a) for i, a in enumerate(pre_quant)]
    entries += [(f"algo_config[{i}]", a) for i, a in enumerate(post_quant)]
    for path, algo in entries:
        kind = type(algo)
        if kind in seen and algo.effect != "correction":
            raise ConfigError(path, f"{kind.__name__} is listed twice (also at {seen[kind]}): it would run twice, "
                                    "the second run undoing or compounding the first; keep one entry with the "
                                    "parameters you want")
        seen[kind] = path


def _verify_rotation_first(pre_quant: Sequence[algorithms.AlgorithmConfig],
                           post_quant: Sequence[algorithms.AlgorithmConfig]) -> None:
    """A rotation runs before every other weight transform of the float model, wherever the two are listed (the
    run order is ``pre_quant_opt_config`` then the transforms of ``algo_config``): rotating after SmoothQuant or
    equalization would mix the channels their per-channel scales were measured on. ``Preprocess`` (graph steps,
    the default entry) may come first."""
    order = [(f"pre_quant_opt_config[{i}]", a) for i, a in enumerate(pre_quant)]
    order += [(f"algo_config[{i}]", a) for i, a in enumerate(post_quant)
              if isinstance(a, algorithms.PreQuantOptConfig)]
    for position, (path, algo) in enumerate(order):
        if algo.effect != "rotation":
            continue
        before = [(p, a) for p, a in order[:position] if a.effect != "rotation"
                  and not isinstance(a, algorithms.Preprocess)]
        if before:
            where, first = before[0]
            raise ConfigError(path, f"{type(algo).__name__} runs after {type(first).__name__} ({where}), which "
                                    f"{algorithms.EFFECTS.get(first.effect, first.effect)}: the rotation would mix "
                                    f"the channels it worked on. List {type(algo).__name__} first (Quark's order: "
                                    "rotation, then SmoothQuant/AWQ, then GPTQ)")


def _verify_order(post_quant: Sequence[algorithms.AlgorithmConfig]) -> None:
    """``algo_config`` runs in the order written (as in Quark 0.13); an algorithm whose effect comes earlier in
    :data:`~quark_brevitas.config.algorithms.EFFECT_ORDER` than a preceding one's would undo that one."""
    rank = {effect: index for index, effect in enumerate(algorithms.EFFECT_ORDER)}
    works = " -> ".join(f"{effect} ({algorithms.EFFECTS[effect]})" for effect in algorithms.EFFECT_ORDER)
    for later_index, later in enumerate(post_quant):
        for index, earlier in enumerate(post_quant[:later_index]):
            if rank.get(later.effect, 0) < rank.get(earlier.effect, 0):
                first, then = type(earlier).__name__, type(later).__name__
                raise ConfigError(
                    f"algo_config[{later_index}]",
                    f"{then} after {first} (algo_config[{index}]) would undo it: {first} "
                    f"{algorithms.EFFECTS.get(earlier.effect, earlier.effect)}, then {then} "
                    f"{algorithms.EFFECTS.get(later.effect, later.effect)}. Put {then} before {first}; the order "
                    f"that works: {works}",
                )


def _verify_specs(layer: QuantizationConfig, path: str) -> dict[str, QuantizationSpec | None]:
    """Each tensor spec of ``layer`` on its own; returns the specs by role."""
    if not isinstance(layer, QuantizationConfig):
        raise ConfigError(path, f"must be a QuantizationConfig (QLayerConfig), got {type(layer).__name__}")
    check_fields(layer, path)
    if layer.target_device is DeviceType.IPU:
        raise ConfigError(f"{path}.target_device", "IPU is not supported: its quantizer constraints are Quark's own "
                                                   "IPU flow; use None or DeviceType.CPU (the models and exports "
                                                   "this library writes run on torch devices and onnxruntime)")
    specs = {role: getattr(layer, role) for role in TENSOR_ROLES}
    for role, spec in specs.items():
        if spec is not None:
            verify_spec(spec, role, f"{path}.{role}")
    return specs


def verify_layer_config(layer: QuantizationConfig, path: str) -> None:
    """Check one QuantizationConfig (all four tensor specs and how they relate)."""
    _verify_specs(layer, path)
    if layer.bias is None:
        return
    if layer.input_tensors is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs input quantization (the bias scale is input scale x weight scale); "
            "set input_tensors or remove bias",
        )
    for role in ("input_tensors", "weight"):
        spec = getattr(layer, role)
        spec = spec.resolved(f"{path}.{role}") if spec is not None else None
        if spec is not None and spec.quant_type is not QuantType.int_quant:
            raise ConfigError(
                f"{path}.bias",
                f"integer bias quantization needs int_quant {role} (its scale is input scale x weight "
                f"scale); {role} is {spec.quant_type.name}. Remove bias or use int_quant {role}",
            )
        if spec is not None and (spec.qscheme is QSchemeType.per_group or spec.is_dynamic):
            what = "per_group" if spec.qscheme is QSchemeType.per_group else "dynamic"
            need = "a per-tensor or per-channel weight scale" if role == "weight" else \
                "a static per-tensor input scale"
            raise ConfigError(
                f"{path}.bias",
                f"integer bias quantization needs {need} (the bias scale is input scale x weight scale); "
                f"{role} is {what}. Remove bias (the bias then stays float)",
            )
    if layer.weight is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs weight quantization (the bias scale is input scale x weight scale); "
            "set weight or remove bias",
        )


def verify_partial_layer_config(layer: QuantizationConfig, path: str) -> None:
    """Check a layer-type or layer-name entry: each tensor spec on its own.

    How the specs relate (bias needs input and weight quantization) is checked per module once the
    levels are merged (:mod:`quark_brevitas.resolve`), since a ``None`` here defers to a level above.
    An entry whose four specs are all ``None`` changes nothing and is rejected, because it reads as
    "keep this layer in float", which is what ``exclude`` is for.
    """
    specs = _verify_specs(layer, path)
    if all(spec is None for spec in specs.values()):
        raise ConfigError(
            path,
            "all of input_tensors, output_tensors, weight and bias are None, which changes nothing (None "
            "defers to the next level up); set at least one, or list the layer in exclude to keep it in float",
        )
