"""The whole config: :class:`Config` (Quark's Brevitas extension config, reference 003, with the hierarchy
of Quark's general config, references 001 and 002), its file formats and :func:`verify_config`.

Config sits at the top of the plain-data modules: it holds the layer specs (:mod:`.specs`) and the algorithm
configs (:mod:`.algorithms`), reads and writes files through :mod:`.serialization` and is checked by
:mod:`.checks`. Nothing here imports torch or Brevitas, so a config file loads and verifies quickly, on any
machine. Layer types may be given as ``nn.Module`` classes: they are spelled by name without importing torch
(a class of ``torch.nn`` can only exist once torch is imported; only a ``"torch.nn.X"`` string key makes this
module import torch, to check that ``X`` exists there).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

from quark_brevitas.config import algorithms
from quark_brevitas.config.attention import verify_attention
from quark_brevitas.config.checks import (
    HIERARCHY_LEVELS,
    INT,
    MX,
    scheme_of,
    verify_algorithms,
    verify_layer_config,
    verify_partial_layer_config,
)
from quark_brevitas.config.enums import Backend
from quark_brevitas.config.kv_cache import fold_kv_cache_config, verify_kv_cache
from quark_brevitas.config.quark_fields import from_quark_file, without_quark_fields
from quark_brevitas.config.serialization import (
    VERSION_KEY,
    Polymorphic,
    Text,
    check_fields,
    from_plain,
    key_path,
    to_plain,
    with_version,
    without_version,
)
from quark_brevitas.config.specs import QuantizationConfig, QuantizationSpec, narrow_range_of
from quark_brevitas.errors import ConfigError

__all__ = [
    "CONFIG_KEYS",
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "Config",
    "QConfig",
    "layer_type_key",
    "type_name",
    "verify_config",
]

#: The format version :meth:`Config.to_dict` writes, and the versions :meth:`Config.from_dict` reads
#: (1: files written before versions were recorded, which carry no ``format_version``; 3: 2-4 bit symmetric int
#: weights without ``narrow_range`` mean the full range, which version 2 files, written when the narrow grid was the
#: default, are read as narrow: a checkpoint keeps the codes it was written with).
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, 3)
#: The last format version whose unset ``narrow_range`` meant the narrow grid at every width.
NARROW_DEFAULT_VERSION = 2


#: How the fields of the hierarchy and the algorithm lists are written (see :mod:`quark_brevitas.config.serialization`).
LayerName = Annotated[str, Text("module name or pattern")]
LayerTypeName = Annotated[str, Text("layer type name (e.g. 'Conv2d', 'torch.nn.Conv2d' or 'package.module.Class')")]
PreQuantAlgorithm = Annotated[algorithms.PreQuantOptConfig, Polymorphic(
    algorithms.registered, note="post-quantization algorithms (GPTQ, GPFQ, AWQConfig, GPTQConfig, BiasCorrection, "
                                "...) are accepted in algo_config, which takes every algorithm")]
#: ``algo_config`` takes every algorithm, as Quark 0.13's does; weight transforms listed there (SmoothQuantConfig,
#: ...) run before quantization, in the order written (:meth:`Config.pre_quant_algorithms`).
PostQuantAlgorithm = Annotated[algorithms.AlgorithmConfig, Polymorphic(
    algorithms.registered, note="algo_config takes every algorithm config of quark_brevitas.algos / "
                                "quark_brevitas.config (instances, not classes or Quark's own objects)")]


@dataclass(eq=True)
class Config:
    """Everything needed to quantize a model.

    - ``global_quant_config``: applied to every compute-heavy layer unless a level below overrides it.
    - ``pre_quant_opt_config``: algorithms run on the float model before quantization, in order (one algorithm
      without a list, or ``None``, is accepted as Quark writes them).
    - ``algo_config``: algorithms run on the quantized model after calibration, in order (idem).
    - ``backend``: how layers are replaced (``Backend.layerwise``), or the whole traced network (``Backend.graph``).
    - ``layer_type_quant_config``: per layer type; keys are ``nn.Module`` classes or their names
      (``nn.Conv2d``, ``"Conv2d"``, ``"torch.nn.Conv2d"``), stored as names (see :func:`layer_type_key`).
    - ``layer_quant_config``: per layer name; keys are module names or fnmatch patterns
      (``"fc1"``, ``"encoder.layer.*.attention.*"``).
    - ``exclude``: module names or patterns that stay in float (a block excludes its layers).
    - ``kv_cache_quant_config`` / ``kv_cache_group`` / ``min_kv_scale`` / ``kv_cache_post_rope``: Quark 0.13's
      KV-cache quantization (:mod:`quark_brevitas.config.kv_cache`): the cache spec of the key/value
      projections' patterns (``output_tensors`` of each entry), the patterns whose scales are shared within an
      attention layer (their maximum), the smallest scale written, and whether keys are quantized after RoPE.
    - ``softmax_quant_spec``: Quark 0.13's attention quantization (:mod:`quark_brevitas.config.attention`): the
      spec of the attention probabilities (the softmax output). With it set, the ``output_tensors`` spec of each
      attention's query projection (where Quark's ``attention_scheme`` writes it) quantizes the query, after RoPE
      when ``kv_cache_post_rope`` is set (where vLLM applies ``q_scale``), else on the projection's output.
    - ``moe_calibrate_all_experts`` / ``moe_min_expert_tokens``: all-expert calibration of mixture-of-experts
      blocks (:mod:`quark_brevitas.model_parts.moe_calibration`; only experts unfused by
      :func:`~quark_brevitas.model_parts.moe.unfuse_experts`): an expert that routing sends fewer than
      ``moe_min_expert_tokens`` tokens of a block's calibration data takes its activation statistics and
      Hessians from every token of the block instead (its routed output, what the next layers see, unchanged).

    For one module, a tensor spec left ``None`` at the layer-name level defers to the layer-type
    level, then to the global level; ``None`` there means not quantized. See :mod:`quark_brevitas.resolve`.
    """

    global_quant_config: QuantizationConfig
    pre_quant_opt_config: list[PreQuantAlgorithm] = field(default_factory=lambda: [algorithms.Preprocess()])
    algo_config: list[PostQuantAlgorithm] = field(default_factory=list)
    backend: Backend = Backend.layerwise
    layer_type_quant_config: dict[LayerTypeName, QuantizationConfig] = field(default_factory=dict)
    layer_quant_config: dict[LayerName, QuantizationConfig] = field(default_factory=dict)
    exclude: list[LayerName] = field(default_factory=list)
    kv_cache_quant_config: dict[LayerName, QuantizationConfig] = field(default_factory=dict)
    kv_cache_group: list[LayerName] = field(default_factory=list)
    min_kv_scale: float = 0.0
    kv_cache_post_rope: bool = False
    softmax_quant_spec: QuantizationSpec | None = None
    moe_calibrate_all_experts: bool = True
    moe_min_expert_tokens: int = 1

    def __post_init__(self) -> None:
        # Quark writes one algorithm without a list (``algo_config=GPTQConfig(...)``) and ``None`` for none.
        for name in ("pre_quant_opt_config", "algo_config"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, [])
            elif isinstance(value, algorithms.AlgorithmConfig):
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
        # One spelling per layer type, so that a config equals its own round trip through a file.
        if isinstance(self.layer_type_quant_config, Mapping):
            self.layer_type_quant_config = _normalised_type_keys(self.layer_type_quant_config)
        if isinstance(self.exclude, tuple):
            self.exclude = list(self.exclude)
        if isinstance(self.kv_cache_group, tuple):
            self.kv_cache_group = list(self.kv_cache_group)
        # The cache entries' weight/input specs are their projections' (Quark applies the whole entry there);
        # the cache spec itself is executed by the KV quantizer, never twice (quark_brevitas.config.kv_cache).
        if isinstance(self.kv_cache_quant_config, Mapping) and isinstance(self.layer_quant_config, Mapping):
            self.layer_quant_config = fold_kv_cache_config(self.layer_quant_config, self.kv_cache_quant_config)

    # ----------------------------------------------------------------- the order algorithms run in
    def pre_quant_algorithms(self) -> list[algorithms.AlgorithmConfig]:
        """What runs on the float model, in order: ``pre_quant_opt_config``, then the weight transforms that
        ``algo_config`` lists (Quark 0.13's style; verification keeps them ahead of every algorithm there that
        fits the weights to the grid, so running them before quantization keeps the order written)."""
        return [*self.pre_quant_opt_config,
                *(a for a in self.algo_config if isinstance(a, algorithms.PreQuantOptConfig))]

    def post_quant_algorithms(self) -> list[algorithms.AlgorithmConfig]:
        """What runs on the quantized, calibrated model, in the order ``algo_config`` lists it."""
        return [a for a in self.algo_config if not isinstance(a, algorithms.PreQuantOptConfig)]

    def run_order(self) -> list[tuple[str, algorithms.AlgorithmConfig]]:
        """Every algorithm with its place in the config (``"algo_config[0]"``), in the order they run."""
        where = {id(a): f"pre_quant_opt_config[{i}]" for i, a in enumerate(self.pre_quant_opt_config)}
        where.update({id(a): f"algo_config[{i}]" for i, a in enumerate(self.algo_config)})
        return [(where[id(a)], a) for a in [*self.pre_quant_algorithms(), *self.post_quant_algorithms()]]

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-compatible dict: ``format_version`` first, enums by name, algorithms as
        ``{"name": ..., **params}``, layer types by name."""
        plain = to_plain(self)
        if isinstance(self.layer_type_quant_config, Mapping):  # classes may have been added after construction
            plain["layer_type_quant_config"] = {layer_type_key(key): layer
                                                for key, layer in plain["layer_type_quant_config"].items()}
        return with_version(plain, FORMAT_VERSION)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and verify a Config from :meth:`to_dict` output or a config file's content (with or
        without ``format_version``). Errors name the offending path.

        Quark 0.13's ``quantization_config`` (its ``QConfig.to_dict()``, with the ``export`` section its
        ``export_safetensors`` adds, or the whole ``config.json`` of such a folder) is read too; Quark's fields are
        accepted where quark_brevitas honours them and otherwise refused naming the field
        (:func:`~quark_brevitas.config.quark_fields.from_quark_file`)."""
        if isinstance(data, Mapping) and "quantization_config" in data and "global_quant_config" not in data:
            data = data["quantization_config"]  # a Hugging Face config.json (Quark's export): its recipe
        version = data.get(VERSION_KEY) if isinstance(data, Mapping) else None
        data = without_version(data, READABLE_FORMAT_VERSIONS)
        if isinstance(data, Mapping):  # files Quark 0.13 writes: its QConfig fields, export section, spec fields
            data = from_quark_file(data)
        config = from_plain(Config, data)
        if version == NARROW_DEFAULT_VERSION:
            config = _with_narrow_grid(config)
        verify_config(config)
        return config

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Config:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("", f"not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Config:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"not valid YAML: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a config from a ``.json``, ``.yaml`` or ``.yml`` file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"config file {str(path)!r} does not exist")
        text = _read_config_text(path)
        if path.suffix.lower() == ".json":
            return cls.from_json(text)
        if path.suffix.lower() in (".yaml", ".yml"):
            return cls.from_yaml(text)
        raise ConfigError("", f"config file {str(path)!r}: unknown extension; allowed: .json, .yaml, .yml")


def _read_config_text(path: Path) -> str:
    """The text of a config file; a file that cannot be read, or is not UTF-8 text (a model checkpoint or other
    binary file given by mistake), is a one-line :class:`ConfigError` naming it instead of a decoding traceback."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("", f"config file {str(path)!r} cannot be read ({exc.strerror or exc})") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"config file {str(path)!r} is not text (byte {exc.start} is not UTF-8); a JSON or "
                              "YAML config (.json, .yaml, .yml) is expected") from exc


CONFIG_KEYS = [f.name for f in fields(Config)]


class _AliasOfConfig(type):
    """Makes every Config an instance of QConfig (and Config a subclass of it): one class under two names."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, Config)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, Config)


class QConfig(Config, metaclass=_AliasOfConfig):
    """Quark 0.11+'s name of :class:`Config` (Quark kept ``Config`` as an alias): it builds a plain Config.

    Quark 0.13's QConfig fields that Config lacks (``kv_cache_quant_config``, ``quant_mode``, ``version``, ...:
    :data:`~quark_brevitas.config.quark_fields.QUARK_ONLY_FIELDS`) are accepted where they change nothing here
    (their defaults; metadata) and refused with a ConfigError naming the field otherwise, so Quark 0.13 code that
    spells them out runs unchanged and a setting that would be ignored never is.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Config:  # type: ignore[misc]
        return Config(*args, **without_quark_fields(kwargs))


# ===================================================================== layer-type keys
def _loaded_torch_nn() -> ModuleType | None:
    """``torch.nn`` if torch is already imported, else ``None``: a class of ``torch.nn`` (or a subclass of
    ``nn.Module``) cannot exist before that, so the layer-type keys never need to import torch for it."""
    return sys.modules.get("torch.nn")


def type_name(cls: type) -> str:
    """The name a layer type is written with in configs: ``"Conv2d"`` for a class of ``torch.nn``,
    ``"package.module.Class"`` for any other class."""
    nn = _loaded_torch_nn()
    if nn is not None and getattr(nn, cls.__name__, None) is cls:
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_type_key(key: Any) -> Any:
    """The stored form of a ``layer_type_quant_config`` key.

    An ``nn.Module`` class becomes :func:`type_name`; ``"torch.nn.Conv2d"`` and
    ``"torch.nn.modules.conv.Conv2d"`` become ``"Conv2d"`` (torch is imported to check the class exists);
    other strings are kept as written (they are matched against the layer map by short or qualified name,
    without importing anything). Anything else is returned unchanged for :func:`verify_config` to reject
    with its path.
    """
    if isinstance(key, type):
        nn = _loaded_torch_nn()
        return type_name(key) if nn is not None and issubclass(key, nn.Module) else key
    if isinstance(key, str) and key.startswith("torch.nn."):
        from torch import nn  # the user named a torch class: check it exists there

        short = key.rsplit(".", 1)[-1]
        cls = getattr(nn, short, None)
        if isinstance(cls, type) and key in (f"torch.nn.{short}", f"{cls.__module__}.{cls.__qualname__}"):
            return short
    return key


def _normalised_type_keys(levels: Mapping[Any, Any]) -> dict[Any, Any]:
    result: dict[Any, Any] = {}
    spelled: dict[Any, Any] = {}
    for key, value in levels.items():
        normal = layer_type_key(key)
        if normal in result:
            raise ConfigError(
                key_path("layer_type_quant_config", normal),
                f"given twice (as {spelled[normal]!r} and {key!r}); keep one entry per layer type",
            )
        result[normal] = value
        spelled[normal] = key
    return result


# ===================================================================== verification
def verify_config(config: Config) -> None:
    """Check that ``config`` can be honoured exactly; raise :class:`ConfigError` otherwise.

    Runs before the model is touched. Every rejected combination names its field and what is allowed
    (see :mod:`quark_brevitas.config.checks`).
    """
    if not isinstance(config, Config):
        raise ConfigError("", f"expected a quark_brevitas Config, got {type(config).__name__}")
    # Checked as rebuilt, so that layer types added to the dict after construction are spelled by name too.
    config = replace(config)
    check_fields(config)
    verify_layer_config(config.global_quant_config, "global_quant_config")
    for level in HIERARCHY_LEVELS:
        for key, layer in getattr(config, level).items():
            verify_partial_layer_config(layer, key_path(level, key))
    verify_algorithms(config.pre_quant_opt_config, config.algo_config, config)
    verify_kv_cache(config)
    verify_attention(config)
    _verify_moe_fields(config)


def _verify_moe_fields(config: Config) -> None:
    if not isinstance(config.moe_calibrate_all_experts, bool):
        raise ConfigError("moe_calibrate_all_experts", "must be True or False, got "
                          f"{config.moe_calibrate_all_experts!r}")
    tokens = config.moe_min_expert_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError("moe_min_expert_tokens", f"must be an integer >= 1 (routed tokens below which an expert is "
                          f"calibrated on every token of its block), got {tokens!r}")


def _with_narrow_grid(config: Config) -> Config:
    """``config`` with ``narrow_range=True`` on every symmetric int weight spec that leaves it unset and whose default
    is now the full range: what a version-2 file (a checkpoint's config included) meant when it was written."""
    def pinned(layer: QuantizationConfig | None) -> QuantizationConfig | None:
        spec = layer.weight if layer is not None else None
        if (not isinstance(spec, QuantizationSpec) or spec.narrow_range is not None or not spec.symmetric
                or spec.quant_type is not INT or scheme_of(spec, "weight") == MX or narrow_range_of(spec)):
            return layer
        return replace(layer, weight=replace(spec, narrow_range=True))

    return replace(config, global_quant_config=pinned(config.global_quant_config),
                   layer_type_quant_config={k: pinned(v) for k, v in config.layer_type_quant_config.items()},
                   layer_quant_config={k: pinned(v) for k, v in config.layer_quant_config.items()})
