"""The configuration schema: Quark's Brevitas extension config (reference 003), as plain data.

``Config``, ``QuantizationConfig`` (alias ``QLayerConfig``), ``QuantizationSpec`` (alias
``QTensorConfig``), ``QuantType``, ``ParamType`` and ``Backend`` have the names, fields and
defaults of ``quark.torch.extensions.brevitas.config`` (the enums are defined in
:mod:`quark_brevitas.types` and re-exported here). ``Config`` also carries the hierarchy of Quark's
general PyTorch config (references 001 and 002): ``layer_type_quant_config``, ``layer_quant_config``
and ``exclude``, added after the Brevitas extension's fields so that positional construction keeps
working. How the levels combine for one module is decided in :mod:`quark_brevitas.resolve`. Quark's LLM
algorithm configs (reference 002: ``SmoothQuantConfig``, ``AWQConfig``, ``GPTQConfig``, which Quark keeps in
``quark.torch.quantization.config.config``) are defined in :mod:`quark_brevitas.algos` and re-exported here.

This module holds data: the dataclasses, whose annotations are the one statement of each field's type,
and thin methods that delegate to the modules doing the work:

- :mod:`quark_brevitas.dtypes`: the ``dtype`` short form (:meth:`QuantizationSpec.resolved`, ``short``);
- :mod:`quark_brevitas.serialization`: dicts, JSON and YAML, from the annotations (:meth:`Config.to_dict`, ...);
- :mod:`quark_brevitas.verification`: :func:`verify_config`, run before any model is touched;
- :mod:`quark_brevitas.schema`: the JSON Schema of config files, from the same annotations.

Files carry ``format_version`` (:data:`FORMAT_VERSION`) as their first key; files without it are the
first format, which this release still reads. Checks that need the model (does a layer name exist? what
does a layer get once the levels are merged?) run in :mod:`quark_brevitas.resolve`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

from torch import nn

from quark_brevitas import algos as _algos
from quark_brevitas import verification as _verification
from quark_brevitas.algos import AWQConfig, GPTQConfig, SmoothQuantConfig
from quark_brevitas.dtypes import (
    DTYPE_FIELDS,
    MX_BLOCK_SIZE,
    MX_ELEMENT_DTYPES,
    REJECTED_DTYPES,
    describe,
    resolve_dtype,
)
from quark_brevitas.errors import ConfigError
from quark_brevitas.serialization import (
    Polymorphic,
    Text,
    did_you_mean,
    from_plain,
    key_path,
    to_plain,
    with_version,
    without_version,
)
from quark_brevitas.types import Backend, Dtype, ParamType, QSchemeType, QuantType, RoundType, ScaleType, ZeroPointType
from quark_brevitas.verification import HIERARCHY_LEVELS

#: The format version :meth:`Config.to_dict` writes, and the versions :meth:`Config.from_dict` reads
#: (1: files written before versions were recorded, which carry no ``format_version``).
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


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
    - ``scale_type``: ``float`` or ``pof2`` (power-of-two) scales; ``per_group`` with ``pof2`` is the OCP MX
      shared-exponent rule.
    - ``quant_type``: ``int_quant`` or ``float_quant`` (then give exponent and mantissa widths).
    - ``param_type``: ``stats`` or ``mse``.
    - ``bit_width``: total bits of the quantized value (sign included for float formats).
    - ``exponent_bit_width`` / ``mantissa_bit_width``: float formats only.
    - ``dtype``: short form for the element format (``int4``, ``uint8``, ``fp8_e5m2``, ``fp4``, ``mx`` with
      ``mx_element_dtype``, ...): fields left at their defaults take the dtype's values, fields that
      contradict it are an error. ``uint4``/``uint8`` mean asymmetric (unsigned codes and a zero point).
    - ``group_size``: elements per group for ``per_group`` (32 for MX).
    - ``ch_axis``: Quark's channel axis, optional: 0 (output channels) for ``per_channel`` weights, 1 (input
      channels) for ``per_group`` weights; Brevitas uses the equivalent axis of transposed convolutions.
    - ``round_method``: element rounding: ``half_even`` (the default), ``floor`` or ``round`` (half away
      from zero).
    - ``is_dynamic``: activations only: scales computed from each input at run time (per tensor, per token
      with ``per_channel``, per group) instead of calibrated.
    - ``zero_point_type``: asymmetric int only: ``int32`` (integer zero point, the default) or ``float32``.
    - ``mx_element_dtype``: the element format of ``dtype=mx``: ``int8``, ``fp8_e4m3``, ``fp8_e5m2``,
      ``fp6_e3m2``, ``fp6_e2m3`` or ``fp4``.
    - ``percentile``: static int activations with ``stats``: the percentile of the calibration data mapped to
      the top of the range (default 99.999; 100 = max).
    """

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


#: How the fields of the hierarchy and the algorithm lists are written (see :mod:`quark_brevitas.serialization`).
LayerName = Annotated[str, Text("module name or pattern")]
LayerTypeName = Annotated[str, Text("layer type name (e.g. 'Conv2d', 'torch.nn.Conv2d' or 'package.module.Class')")]
PreQuantAlgorithm = Annotated[_algos.PreQuantOptConfig, Polymorphic(_algos.registered)]
PostQuantAlgorithm = Annotated[_algos.AlgoConfig, Polymorphic(_algos.registered)]


@dataclass(eq=True)
class Config:
    """Everything needed to quantize a model.

    - ``global_quant_config``: applied to every compute-heavy layer unless a level below overrides it.
    - ``pre_quant_opt_config``: algorithms run on the float model before quantization, in order (one algorithm
      without a list, or ``None``, is accepted as Quark writes them).
    - ``algo_config``: algorithms run on the quantized model after calibration, in order (idem).
    - ``backend``: how layers are replaced (``Backend.layerwise``).
    - ``layer_type_quant_config``: per layer type; keys are ``nn.Module`` classes or their names
      (``nn.Conv2d``, ``"Conv2d"``, ``"torch.nn.Conv2d"``), stored as names (see :func:`layer_type_key`).
    - ``layer_quant_config``: per layer name; keys are module names or fnmatch patterns
      (``"fc1"``, ``"encoder.layer.*.attention.*"``).
    - ``exclude``: module names or patterns that stay in float (a block excludes its layers).

    For one module, a tensor spec left ``None`` at the layer-name level defers to the layer-type
    level, then to the global level; ``None`` there means not quantized. See :mod:`quark_brevitas.resolve`.
    """

    global_quant_config: QuantizationConfig
    pre_quant_opt_config: list[PreQuantAlgorithm] = field(default_factory=lambda: [_algos.Preprocess()])
    algo_config: list[PostQuantAlgorithm] = field(default_factory=list)
    backend: Backend = Backend.layerwise
    layer_type_quant_config: dict[LayerTypeName, QuantizationConfig] = field(default_factory=dict)
    layer_quant_config: dict[LayerName, QuantizationConfig] = field(default_factory=dict)
    exclude: list[LayerName] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Quark writes one algorithm without a list (``algo_config=GPTQConfig(...)``) and ``None`` for none.
        for name in ("pre_quant_opt_config", "algo_config"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, [])
            elif isinstance(value, _algos.AlgorithmConfig):
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
        # One spelling per layer type, so that a config equals its own round trip through a file.
        if isinstance(self.layer_type_quant_config, Mapping):
            self.layer_type_quant_config = _normalised_type_keys(self.layer_type_quant_config)
        if isinstance(self.exclude, tuple):
            self.exclude = list(self.exclude)

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
        without ``format_version``). Errors name the offending path."""
        config = from_plain(cls, without_version(data, READABLE_FORMAT_VERSIONS))
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


# Quark's Brevitas extension exports both names for the same classes.
QTensorConfig = QuantizationSpec
QLayerConfig = QuantizationConfig

TENSOR_ROLES = tuple(f.name for f in fields(QuantizationConfig))
CONFIG_KEYS = [f.name for f in fields(Config)]


# ===================================================================== layer-type keys
def type_name(cls: type) -> str:
    """The name a layer type is written with in configs: ``"Conv2d"`` for a class of ``torch.nn``,
    ``"package.module.Class"`` for any other class."""
    if getattr(nn, cls.__name__, None) is cls:
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_type_key(key: Any) -> Any:
    """The stored form of a ``layer_type_quant_config`` key.

    An ``nn.Module`` class becomes :func:`type_name`; ``"torch.nn.Conv2d"`` and
    ``"torch.nn.modules.conv.Conv2d"`` become ``"Conv2d"``; other strings are kept as written (they
    are matched against the layer map by short or qualified name, without importing anything).
    Anything else is returned unchanged for :func:`verify_config` to reject with its path.
    """
    if isinstance(key, type):
        return type_name(key) if issubclass(key, nn.Module) else key
    if isinstance(key, str) and key.startswith("torch.nn."):
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
    (see :mod:`quark_brevitas.verification`).
    """
    if not isinstance(config, Config):
        raise ConfigError("", f"expected a quark_brevitas Config, got {type(config).__name__}")
    # Checked as rebuilt, so that layer types added to the dict after construction are spelled by name too.
    _verification.verify_config(replace(config))


def verify_layer_config(layer: QuantizationConfig, path: str) -> None:
    """Check one QuantizationConfig (all four tensor specs and how they relate)."""
    _verification.verify_layer_config(_layer(layer, path), path)


def verify_partial_layer_config(layer: QuantizationConfig, path: str) -> None:
    """Check a layer-type or layer-name entry: each tensor spec on its own (see
    :func:`quark_brevitas.verification.verify_partial_layer_config`)."""
    _verification.verify_partial_layer_config(_layer(layer, path), path)


def _layer(layer: Any, path: str) -> QuantizationConfig:
    if not isinstance(layer, QuantizationConfig):
        raise ConfigError(path, f"must be a QuantizationConfig (QLayerConfig), got {type(layer).__name__}")
    return layer


__all__ = [
    "AWQConfig",
    "DTYPE_FIELDS",
    "FORMAT_VERSION",
    "HIERARCHY_LEVELS",
    "MX_BLOCK_SIZE",
    "MX_ELEMENT_DTYPES",
    "READABLE_FORMAT_VERSIONS",
    "REJECTED_DTYPES",
    "SmoothQuantConfig",
    "TENSOR_ROLES",
    "Backend",
    "Config",
    "ConfigError",
    "GPTQConfig",
    "ParamType",
    "QLayerConfig",
    "QTensorConfig",
    "QuantType",
    "QuantizationConfig",
    "QuantizationSpec",
    "did_you_mean",
    "key_path",
    "layer_type_key",
    "resolve_dtype",
    "type_name",
    "verify_config",
    "verify_layer_config",
    "verify_partial_layer_config",
]
