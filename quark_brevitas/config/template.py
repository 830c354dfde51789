"""Quark 0.13's ``LLMTemplate``: a model family's quantization recipe from a scheme name and algorithm names.

Quark 0.13 users start from ``LLMTemplate.get("llama").get_config(scheme="int4_wo_128", algorithm="awq",
exclude_layers=["lm_head"])``; the same call here returns a :class:`~quark_brevitas.config.Config` that
quark_brevitas executes. The names and arguments are Quark's (``get``, ``list_available``,
``get_supported_schemes``, ``register_template``, ``register_scheme``, ``unregister_scheme``, ``get_config``);
the recipes are this project's own:

- **Schemes** (:data:`SCHEMES`): each Quark scheme the project can execute maps to the specs Quark's definition
  gives (element format, granularity, group size, symmetry, static or dynamic activations; Quark's min-max
  observer for static activations is ``percentile=100``). Per-group and MX weights have ``ch_axis=-1`` as Quark
  writes them (the last dimension: a Linear's input channels, the same axis as ``1``). Quark's
  schemes that the project cannot execute are listed in :data:`UNSUPPORTED_SCHEMES` with the reason, and asking
  for one is a :class:`ConfigError` listing the supported ones.
- **Families** (:mod:`quark_brevitas.config.families`, the table the structure inference reads): Llama,
  Mistral, Qwen2, OPT, GPT-2 and BERT. A template's algorithm configs leave ``scaling_layers`` and
  ``model_decoder_layers`` to the structure inference, which uses the family's groups where they are exact in
  the model at hand (grouped-query attention, post-norm blocks) and shows them in ``quark-brevitas plan``.
- **Algorithms** (:data:`TEMPLATE_ALGORITHMS`): ``awq``, ``gptq`` and ``smoothquant`` with Quark 0.13's
  defaults (GPTQ: ``damp_percent=0.01``, ``desc_act=True``, ``static_groups=True``, ``block_size=128``; the
  restated ``bit``/``sym``/``group_size`` left ``None``: the weight spec says them);
  ``algo_configs={"awq": AWQConfig(...)}`` replaces a default. All of them go into ``algo_config`` in the order
  given, as Quark 0.13's template writes them (SmoothQuant there still runs on the float model).
  :func:`register_template_algorithm` adds one (later algorithms register here).

Plain data like the rest of the package: nothing here imports torch (``layer_type_config`` keys may be
``nn.Module`` classes; they are stored by name, as in :class:`Config`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from quark_brevitas.config.algorithms import (
    AlgorithmConfig,
    AWQConfig,
    GPTQConfig,
    SmoothQuantConfig,
)
from quark_brevitas.config.enums import Dtype, QSchemeType, RoundType, ScaleType, ZeroPointType
from quark_brevitas.config.families import FAMILIES, Family
from quark_brevitas.config.model_config import Config, verify_config
from quark_brevitas.config.specs import QuantizationConfig, QuantizationSpec
from quark_brevitas.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_SCHEMES",
    "KV_CACHE_SCHEMES",
    "SCHEMES",
    "TEMPLATE_ALGORITHMS",
    "UNSUPPORTED_SCHEMES",
    "LLMTemplate",
    "QuantizationScheme",
    "register_template_algorithm",
]

_HALF_EVEN = RoundType.half_even


# ===================================================================== the specs Quark's schemes are made of
def _int4_group(group_size: int, *, unsigned: bool = False, dynamic: bool = False) -> QuantizationSpec:
    """Quark's ``Int4PerGroupSpec`` / ``Uint4PerGroupSpec``: 4-bit groups of input channels, float scales."""
    return QuantizationSpec(dtype=Dtype.uint4 if unsigned else Dtype.int4, qscheme=QSchemeType.per_group,
                            symmetric=not unsigned, scale_type=ScaleType.float, round_method=_HALF_EVEN,
                            group_size=group_size, ch_axis=None if dynamic else -1, is_dynamic=dynamic)


def _int4_channel(*, unsigned: bool = False) -> QuantizationSpec:
    """Quark's ``Int4PerChannelSpec`` / ``Uint4PerChannelSpec``: one scale per output channel."""
    return QuantizationSpec(dtype=Dtype.uint4 if unsigned else Dtype.int4, qscheme=QSchemeType.per_channel,
                            symmetric=not unsigned, scale_type=ScaleType.float, round_method=_HALF_EVEN, ch_axis=0,
                            is_dynamic=False, zero_point_type=ZeroPointType.int32 if unsigned else None)


def _per_tensor(dtype: Dtype, *, activation: bool) -> QuantizationSpec:
    """Quark's ``Int8PerTensorSpec`` / ``FP8E4M3PerTensorSpec`` with its min-max observer: static, one scale per
    tensor; for activations the calibration statistic is the maximum (``percentile=100``)."""
    return QuantizationSpec(dtype=dtype, qscheme=QSchemeType.per_tensor, symmetric=True, scale_type=ScaleType.float,
                            round_method=_HALF_EVEN, is_dynamic=False, percentile=100.0 if activation else None)


def _fp8_channel(*, dynamic: bool) -> QuantizationSpec:
    """Quark's ``FP8E4M3PerChannelSpec``: per output channel for weights, per token (dynamic) for activations."""
    return QuantizationSpec(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_channel, symmetric=True,
                            scale_type=ScaleType.float, round_method=_HALF_EVEN, ch_axis=None if dynamic else 0,
                            is_dynamic=dynamic)


def _mx(element: Dtype, *, dynamic: bool) -> QuantizationSpec:
    """Quark's ``OCP_MX*Spec``: blocks of 32 sharing a power-of-two (E8M0) scale; activations dynamic."""
    return QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=element, round_method=_HALF_EVEN,
                            ch_axis=None if dynamic else -1, is_dynamic=dynamic)


@dataclass(frozen=True)
class QuantizationScheme:
    """A named recipe for one layer (Quark's ``QuantizationScheme``): ``config`` is what every quantized layer of
    the model gets (weights, and activations where the scheme quantizes them)."""

    config: QuantizationConfig
    description: str = ""

    def layer_config(self) -> QuantizationConfig:
        """A fresh copy (QuantizationConfig is mutable; the specs in it are frozen)."""
        return replace(self.config)


def _scheme(description: str, weight: QuantizationSpec, inputs: QuantizationSpec | None = None) -> QuantizationScheme:
    return QuantizationScheme(QuantizationConfig(input_tensors=inputs, weight=weight), description)


def _builtin_schemes() -> dict[str, QuantizationScheme]:
    """Quark 0.13's schemes that the project executes, under Quark's names and in Quark's order."""
    schemes: dict[str, QuantizationScheme] = {}
    for group in (32, 64, 128):
        schemes[f"int4_wo_{group}"] = _scheme(f"int4 weights, symmetric, groups of {group}", _int4_group(group))
    schemes["int4_wo_per_channel"] = _scheme("int4 weights, symmetric, per output channel", _int4_channel())
    schemes["int4_wa_64"] = _scheme("int4 weights and dynamic int4 inputs, groups of 64", _int4_group(64),
                                    _int4_group(64, dynamic=True))
    for group in (32, 64, 128):
        schemes[f"uint4_wo_{group}"] = _scheme(f"uint4 weights, asymmetric, groups of {group}",
                                               _int4_group(group, unsigned=True))
    schemes["uint4_wo_per_channel"] = _scheme("uint4 weights, asymmetric, per output channel",
                                              _int4_channel(unsigned=True))
    schemes["int8"] = _scheme("int8 weights and static int8 inputs, per tensor",
                              _per_tensor(Dtype.int8, activation=False), _per_tensor(Dtype.int8, activation=True))
    schemes["fp8"] = _scheme("fp8 e4m3 weights and static fp8 inputs, per tensor",
                             _per_tensor(Dtype.fp8_e4m3, activation=False),
                             _per_tensor(Dtype.fp8_e4m3, activation=True))
    schemes["ptpc_fp8"] = _scheme("fp8 e4m3 weights per channel, dynamic fp8 inputs per token",
                                  _fp8_channel(dynamic=False), _fp8_channel(dynamic=True))
    schemes["mxfp4"] = _scheme("MXFP4 weights and dynamic MXFP4 inputs", _mx(Dtype.fp4, dynamic=False),
                               _mx(Dtype.fp4, dynamic=True))
    schemes["mxfp4_weight_only"] = _scheme("MXFP4 weights", _mx(Dtype.fp4, dynamic=False))
    schemes["mxfp6_e3m2"] = _scheme("MXFP6 e3m2 weights and dynamic inputs", _mx(Dtype.fp6_e3m2, dynamic=False),
                                    _mx(Dtype.fp6_e3m2, dynamic=True))
    schemes["mxfp6_e2m3"] = _scheme("MXFP6 e2m3 weights and dynamic inputs", _mx(Dtype.fp6_e2m3, dynamic=False),
                                    _mx(Dtype.fp6_e2m3, dynamic=True))
    schemes["mxfp4_mxfp6_e2m3"] = _scheme("MXFP4 weights, dynamic MXFP6 e2m3 inputs", _mx(Dtype.fp4, dynamic=False),
                                          _mx(Dtype.fp6_e2m3, dynamic=True))
    schemes["mxfp4_fp8"] = _scheme("MXFP4 weights, static fp8 e4m3 inputs per tensor", _mx(Dtype.fp4, dynamic=False),
                                   _per_tensor(Dtype.fp8_e4m3, activation=True))
    return schemes


#: The built-in schemes (Quark's names); :meth:`LLMTemplate.register_scheme` adds to the template's copy.
SCHEMES: Mapping[str, QuantizationScheme] = _builtin_schemes()

_NO_SCALE_FORMAT = "scales stored in a low-precision float format (E5M3 / E4M3) have no Brevitas scaling rule"
_TWO_STAGE = "two-stage quantization (a quantized scale, or FP8 then INT4) has no Brevitas quantizer"
_MICRO_EXPONENTS = "shared micro-exponents (MX6/MX9) have no Brevitas quantizer; use mxfp6_e3m2 / mxfp6_e2m3"

#: Quark 0.13's schemes the project cannot execute, and why.
UNSUPPORTED_SCHEMES: Mapping[str, str] = {
    "amdfp4": _NO_SCALE_FORMAT,
    "amdfp4_g32": _NO_SCALE_FORMAT,
    "int4_fp8": _TWO_STAGE,
    "mx6": _MICRO_EXPONENTS,
    "mx9": _MICRO_EXPONENTS,
    "bfp16": "block floating point with 8-bit mantissas and a shared exponent has no Brevitas quantizer",
    "nvfp4": _TWO_STAGE,
    "fp4_block16_scale_e4m3": _TWO_STAGE,
    "amdfp4_global16": _TWO_STAGE,
    "amdfp4_global32": _TWO_STAGE,
}


# ===================================================================== algorithms by name
#: Builds a family's default config of one algorithm for a scheme's resolved weight spec (``None``: no weights).
AlgorithmFactory = Callable[[Family | None, QuantizationSpec | None], AlgorithmConfig]


def _awq(family: Family | None, weight: QuantizationSpec | None) -> AlgorithmConfig:
    # bit / sym / group_size stay None, as Quark 0.13 has them: the weight spec says them (and verification
    # refuses a weight spec AWQ cannot serve).
    return AWQConfig()


def _gptq(family: Family | None, weight: QuantizationSpec | None) -> AlgorithmConfig:
    # Quark 0.13's template defaults for GPTQ.
    return GPTQConfig(damp_percent=0.01, desc_act=True, static_groups=True, block_size=128)


def _smoothquant(family: Family | None, weight: QuantizationSpec | None) -> AlgorithmConfig:
    return SmoothQuantConfig(alpha=1.0)


#: The algorithm names ``get_config(algorithm=...)`` takes, each with the factory of its default config.
TEMPLATE_ALGORITHMS: dict[str, AlgorithmFactory] = {"awq": _awq, "gptq": _gptq, "smoothquant": _smoothquant}

#: Quark 0.13's algorithm names that quark_brevitas does not (yet) run.
_QUARK_ONLY_ALGORITHMS = ("gptaq", "autosmoothquant", "rotation", "twobitscalar")


def register_template_algorithm(name: str, factory: AlgorithmFactory) -> None:
    """Make ``algorithm=name`` available to every template: ``factory(family, weight_spec)`` builds its default
    config (an issue that adds an algorithm registers it here)."""
    key = name.lower()
    if key in TEMPLATE_ALGORITHMS:
        raise ConfigError("algorithm", f"{name!r} is already registered; registered: {sorted(TEMPLATE_ALGORITHMS)}")
    TEMPLATE_ALGORITHMS[key] = factory


def _algorithm_key(name: object, path: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(path, f"must be an algorithm name (str), got {type(name).__name__}")
    key = name.lower()
    if key not in TEMPLATE_ALGORITHMS:
        later = f" ({name} is Quark's, not available in quark_brevitas)" if key in _QUARK_ONLY_ALGORITHMS else ""
        raise ConfigError(path, f"unknown algorithm {name!r}{later}; supported: {', '.join(TEMPLATE_ALGORITHMS)}")
    return key


def _algorithm_configs(configs: Mapping[str, AlgorithmConfig | None] | None, path: str
                       ) -> dict[str, AlgorithmConfig | None]:
    """``{name: config}`` with the names checked and lower-cased (Quark's spelling is case-insensitive)."""
    checked: dict[str, AlgorithmConfig | None] = {}
    for name, config in (configs or {}).items():
        key = _algorithm_key(name, f"{path}[{name!r}]")
        if config is not None and not isinstance(config, AlgorithmConfig):
            raise ConfigError(f"{path}[{name!r}]", f"must be an algorithm config (e.g. AWQConfig()) or None, got "
                                                   f"{type(config).__name__}")
        checked[key] = config
    return checked


# ===================================================================== the template
def _names(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


class LLMTemplate:
    """How to quantize one model family (Quark 0.13's ``LLMTemplate``, same constructor arguments).

    - ``model_type``: the Hugging Face ``config.model_type`` the template is registered under.
    - ``kv_layers_name`` / ``q_layer_name`` / ``gate_up_layers_name``: the key/value, query and gate/up projection
      patterns (``kv_layers_name``: where ``get_config(kv_cache_scheme=...)`` quantizes the cache).
    - ``exclude_layers_name``: the layers kept in float unless ``get_config(exclude_layers=...)`` says otherwise.
    - ``algorithm_configs``: ``{"awq": AWQConfig(...), ...}`` replacing the default config of an algorithm
      (``None``: the default, built for the scheme). Quark's older ``awq_config=...`` keywords are accepted too.
    - ``f2f_weight_converters``: Quark's file-to-file path only; must be ``None``.
    """

    _templates: ClassVar[dict[str, LLMTemplate]] = {}
    _schemes: ClassVar[dict[str, QuantizationScheme]] = dict(SCHEMES)
    _custom_schemes: ClassVar[list[str]] = []

    def __init__(self, model_type: str, kv_layers_name: list[str] | None = None,
                 q_layer_name: str | list[str] | None = None, gate_up_layers_name: list[str] | None = None,
                 exclude_layers_name: list[str] | None = None,
                 algorithm_configs: Mapping[str, AlgorithmConfig | None] | None = None,
                 f2f_weight_converters: list[Any] | None = None, **legacy_algorithm_configs: Any) -> None:
        if not isinstance(model_type, str) or not model_type:
            raise ConfigError("LLMTemplate.model_type", f"must be a non-empty str, got {model_type!r}")
        if f2f_weight_converters is not None:
            raise ConfigError("LLMTemplate.f2f_weight_converters", "Quark's file-to-file quantization is not part "
                              "of quark_brevitas (models are quantized in memory or block by block); leave it None")
        self.model_type = model_type
        self.kv_layers_name = _names(kv_layers_name)
        self.q_layer_name = q_layer_name
        self.gate_up_layers_name = list(gate_up_layers_name) if gate_up_layers_name is not None else [
            "gate_proj", "up_proj"]
        self.exclude_layers_name = list(exclude_layers_name or [])
        self.algo_config = _algorithm_configs(_legacy(legacy_algorithm_configs), "LLMTemplate")
        self.algo_config.update(_algorithm_configs(algorithm_configs, "LLMTemplate.algorithm_configs"))

    def __repr__(self) -> str:
        return (f"LLMTemplate(model_type={self.model_type!r}, exclude_layers_name={self.exclude_layers_name!r}, "
                f"kv_layers_name={self.kv_layers_name!r}, q_layer_name={self.q_layer_name!r})")

    @property
    def family(self) -> Family | None:
        """The family table row behind this template (``None`` for a custom model type)."""
        return FAMILIES.get(self.model_type)

    # ----------------------------------------------------------------- the registry of templates
    @classmethod
    def list_available(cls) -> list[str]:
        """The model types with a registered template."""
        return list(cls._templates)

    @classmethod
    def register_template(cls, template: LLMTemplate) -> None:
        """Register ``template`` under its ``model_type`` (replacing one of that name, with a warning)."""
        if not isinstance(template, LLMTemplate):
            raise ConfigError("template", f"must be an LLMTemplate, got {type(template).__name__}")
        if template.model_type in cls._templates:
            logger.warning("LLMTemplate %r is already registered; replacing it", template.model_type)
        cls._templates[template.model_type] = template

    @classmethod
    def get(cls, model_type: str) -> LLMTemplate:
        """The template of ``model_type`` (a Hugging Face ``config.model_type``)."""
        if model_type not in cls._templates:
            raise ConfigError("model_type", f"no LLMTemplate for {model_type!r}; available: "
                              f"{', '.join(cls.list_available())} (LLMTemplate.register_template adds one)")
        return cls._templates[model_type]

    # ----------------------------------------------------------------- the registry of schemes
    @classmethod
    def register_scheme(cls, scheme_name: str, config: QuantizationConfig) -> None:
        """Add a scheme: ``config`` (a QLayerConfig) is what every quantized layer gets. Verified now, so a
        scheme quark_brevitas cannot execute is refused here rather than in ``get_config``."""
        if scheme_name in cls._schemes:
            raise ConfigError("scheme_name", f"{scheme_name!r} is already registered; use another name")
        if not isinstance(config, QuantizationConfig):
            raise ConfigError(f"schemes[{scheme_name!r}]", f"must be a QLayerConfig, got {type(config).__name__}")
        verify_config(Config(global_quant_config=config, pre_quant_opt_config=[]))
        cls._schemes[scheme_name] = QuantizationScheme(replace(config), "registered")
        cls._custom_schemes.append(scheme_name)

    @classmethod
    def unregister_scheme(cls, scheme_name: str) -> None:
        """Remove a scheme added with :meth:`register_scheme` (built-in schemes stay)."""
        if scheme_name not in cls._custom_schemes:
            why = "is built in" if scheme_name in cls._schemes else "is not registered"
            raise ConfigError("scheme_name", f"{scheme_name!r} {why}; registered ones: {cls._custom_schemes}")
        del cls._schemes[scheme_name]
        cls._custom_schemes.remove(scheme_name)

    @classmethod
    def get_supported_schemes(cls) -> list[str]:
        """The scheme names ``get_config`` accepts (Quark's that the project executes, then registered ones)."""
        return list(cls._schemes)

    @classmethod
    def get_scheme(cls, name: object, path: str = "scheme") -> QuantizationScheme:
        """The scheme called ``name``; a ConfigError listing the supported ones otherwise."""
        if isinstance(name, str) and name in cls._schemes:
            return cls._schemes[name]
        reason = UNSUPPORTED_SCHEMES.get(name) if isinstance(name, str) else None
        what = f"{name!r} is Quark's but cannot be executed here: {reason}" if reason else f"unknown scheme {name!r}"
        raise ConfigError(path, f"{what}; supported: {', '.join(cls._schemes)}")

    # ----------------------------------------------------------------- the config
    def get_config(self, scheme: str, algorithm: str | list[str] | None = None, kv_cache_scheme: str | None = None,
                   min_kv_scale: float = 0.0, attention_scheme: str | None = None,
                   layer_config: Mapping[str, str] | None = None, layer_type_config: Mapping[Any, str] | None = None,
                   exclude_layers: list[str] | None = None, algo_configs: Mapping[str, AlgorithmConfig] | None = None,
                   shared_scale_groups: list[list[str]] | None = None) -> Config:
        """The Config for ``scheme`` (every quantized layer), the ``algorithm`` names in the order given, per-layer
        schemes (``layer_config``: pattern -> scheme; ``layer_type_config``: layer type -> scheme) and the layers
        kept in float (``exclude_layers``; ``None``: the template's). ``kv_cache_scheme`` (``"fp8"``, ``"int8"``)
        quantizes the key/value cache (:mod:`quark_brevitas.config.kv_cache`), floored at ``min_kv_scale``, K and V
        sharing one scale per layer (``kv_cache_group``: the template's key/value patterns). ``attention_scheme``
        (``"fp8"``, ``"int8"``) quantizes the attention probabilities (``softmax_quant_spec``) and the query (the
        ``output_tensors`` of the template's query projections, ``q_layer_name``), as Quark's template writes them
        (:mod:`quark_brevitas.config.attention`). Verified before it is
        returned, so an algorithm that cannot serve the scheme (AWQ with fp8 weights) is refused here."""
        _refuse_unexecutable(kv_cache_scheme, self.kv_layers_name, attention_scheme, self.q_layer_name,
                             shared_scale_groups)
        chosen = self.get_scheme(scheme)
        by_name = {pattern: self.get_scheme(name, f"layer_config[{pattern!r}]").layer_config()
                   for pattern, name in (layer_config or {}).items()}
        by_type = {layer_type: self.get_scheme(name, f"layer_type_config[{_type_label(layer_type)!r}]").layer_config()
                   for layer_type, name in (layer_type_config or {}).items()}
        # Every algorithm goes into algo_config in the order given, as Quark 0.13's template puts them; the
        # weight transforms among them (SmoothQuant) still run on the float model (Config.run_order).
        config = Config(global_quant_config=chosen.layer_config(), pre_quant_opt_config=[],
                        algo_config=self._algorithms(algorithm, algo_configs, chosen.config.weight),
                        layer_type_quant_config=by_type, layer_quant_config=by_name,
                        exclude=list(self.exclude_layers_name if exclude_layers is None else exclude_layers),
                        kv_cache_group=list(self.kv_layers_name or []), min_kv_scale=min_kv_scale)
        if kv_cache_scheme is not None:
            # After the per-layer schemes, as Quark's template does: the projections keep theirs.
            config = replace(config, kv_cache_quant_config=_kv_cache_entries(config, self.kv_layers_name or [],
                                                                             kv_cache_scheme))
        if attention_scheme is not None:
            # Last, as Quark's template does: the query projections keep their weight/input specs.
            config = _with_attention(config, _names(self.q_layer_name) or [], attention_scheme)
        verify_config(config)
        return config

    def _algorithms(self, algorithm: str | list[str] | None, algo_configs: Mapping[str, AlgorithmConfig] | None,
                    weight: QuantizationSpec | None) -> list[AlgorithmConfig]:
        names = [algorithm] if isinstance(algorithm, str) else list(algorithm or [])
        overrides = {**self.algo_config, **_algorithm_configs(algo_configs, "algo_configs")}
        resolved_weight = weight.resolved("global_quant_config.weight") if weight is not None else None
        chosen: list[AlgorithmConfig] = []
        for index, name in enumerate(names):
            key = _algorithm_key(name, f"algorithm[{index}]")
            given = overrides.get(key)
            chosen.append(given if given is not None else TEMPLATE_ALGORITHMS[key](self.family, resolved_weight))
        return chosen

    def describe(self) -> list[str]:
        """Human-readable lines: what the template keeps in float and the family's layers (``plan`` shows them)."""
        family = self.family
        lines = [f"template {self.model_type}: exclude {', '.join(self.exclude_layers_name) or '-'}"]
        if family is None:
            return [*lines, "  custom model type: decoder layers and scaling groups are inferred from the model"]
        lines.append(f"  decoder layers: {family.decoder_layers} (the family's; found in the model by inference)")
        lines.append("  scaling groups of the family (those exact in the model are used):")
        lines += [f"    {candidate}" for candidate in family.scaling]
        return lines


def _type_label(layer_type: Any) -> str:
    return str(getattr(layer_type, "__name__", layer_type))


def _legacy(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Quark's older ``<algorithm>_config=`` keywords of the constructor, as ``algorithm_configs`` entries."""
    configs: dict[str, Any] = {}
    for keyword, value in keywords.items():
        if not keyword.endswith("_config"):
            raise ConfigError(f"LLMTemplate.{keyword}", "unknown argument; algorithm configs are given as "
                              "algorithm_configs={'awq': AWQConfig(...)} (or the older awq_config=...)")
        logger.warning("LLMTemplate(%s=...) is Quark's older spelling; use algorithm_configs={%r: ...}", keyword,
                       keyword.removesuffix("_config"))
        configs[keyword.removesuffix("_config")] = value
    return configs


#: The ``kv_cache_scheme`` names get_config takes: Quark 0.13's ``fp8`` (static FP8 E4M3 per tensor, min-max), and
#: ``int8`` (static int8 per tensor, min-max), which Quark's template does not offer.
KV_CACHE_SCHEMES: Mapping[str, Dtype] = {"fp8": Dtype.fp8_e4m3, "int8": Dtype.int8}


def _kv_cache_entries(config: Config, kv_layers: Sequence[str], scheme: str) -> dict[str, QuantizationConfig]:
    """Quark's template entries for the cache: each key/value pattern keeps the projection's weight/input specs
    (its layer_quant_config entry, else the global ones; none where ``exclude`` names it) with the cache spec as
    ``output_tensors``."""
    spec = _per_tensor(KV_CACHE_SCHEMES[scheme], activation=True)
    entries: dict[str, QuantizationConfig] = {}
    for pattern in kv_layers:
        base = config.layer_quant_config.get(pattern, config.global_quant_config)
        excluded = pattern in config.exclude
        entries[pattern] = QuantizationConfig(weight=None if excluded else base.weight,
                                              input_tensors=None if excluded else base.input_tensors,
                                              output_tensors=spec)
    return entries


#: The ``attention_scheme`` names get_config takes: Quark 0.13's ``fp8`` (static FP8 E4M3 per tensor, min-max) and
#: ``int8`` (static int8 per tensor, min-max), which Quark's template does not offer.
ATTENTION_SCHEMES: Mapping[str, Dtype] = {"fp8": Dtype.fp8_e4m3, "int8": Dtype.int8}


def _with_attention(config: Config, q_layers: Sequence[str], scheme: str) -> Config:
    """Quark's template entries for attention: ``softmax_quant_spec``, and each query pattern keeping the
    projection's weight/input specs (its layer_quant_config entry, else the global ones) with the query spec as
    ``output_tensors``; a pattern ``exclude`` names gets none (its query stays float), as in Quark's template."""
    spec = _per_tensor(ATTENTION_SCHEMES[scheme], activation=True)
    layers = dict(config.layer_quant_config)
    for pattern in q_layers:
        if pattern in config.exclude:
            continue
        base = layers.get(pattern, config.global_quant_config)
        layers[pattern] = QuantizationConfig(weight=base.weight, input_tensors=base.input_tensors,
                                             output_tensors=spec)
    return replace(config, softmax_quant_spec=spec, layer_quant_config=layers)


def _refuse_unexecutable(kv_cache_scheme: str | None, kv_layers: Sequence[str] | None, attention_scheme: str | None,
                         q_layers: str | Sequence[str] | None, shared_scale_groups: list[list[str]] | None) -> None:
    """Quark's get_config arguments whose machinery quark_brevitas does not have: refused when used."""
    if kv_cache_scheme is not None and kv_cache_scheme not in KV_CACHE_SCHEMES:
        raise ConfigError("kv_cache_scheme", f"{kv_cache_scheme!r}; allowed: {', '.join(KV_CACHE_SCHEMES)} or None")
    if kv_cache_scheme is not None and not kv_layers:
        raise ConfigError("kv_cache_scheme", "the template names no key/value projections (kv_layers_name); "
                          "register one with kv_layers_name=['*k_proj', '*v_proj']")
    if attention_scheme is not None and attention_scheme not in ATTENTION_SCHEMES:
        raise ConfigError("attention_scheme", f"{attention_scheme!r}; allowed: {', '.join(ATTENTION_SCHEMES)} or None")
    if attention_scheme is not None and not q_layers:
        raise ConfigError("attention_scheme", "the template names no query projection (q_layer_name); register one "
                          "with q_layer_name='*q_proj'")
    if shared_scale_groups:
        raise ConfigError("shared_scale_groups", "shared global scales belong to the nvfp4 scheme, which is not "
                          "supported; leave it None")


def _register_families() -> None:
    """One template per family of the table, with Quark's fields for it."""
    for model_type, family in FAMILIES.items():
        q_layers = list(family.q_layers)
        LLMTemplate.register_template(LLMTemplate(
            model_type, kv_layers_name=list(family.kv_layers),
            q_layer_name=q_layers[0] if len(q_layers) == 1 else q_layers,
            gate_up_layers_name=list(family.gate_up_layers) or None, exclude_layers_name=list(family.exclude)))


_register_families()
