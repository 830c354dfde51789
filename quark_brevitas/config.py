"""The configuration schema: Quark's Brevitas extension config (reference 003), as plain data.

``Config``, ``QuantizationConfig`` (alias ``QLayerConfig``), ``QuantizationSpec`` (alias
``QTensorConfig``), ``QuantType``, ``ParamType`` and ``Backend`` have the names, fields and
defaults of ``quark.torch.extensions.brevitas.config``. ``Config`` also carries the hierarchy of
Quark's general PyTorch config (references 001 and 002): ``layer_type_quant_config``,
``layer_quant_config`` and ``exclude``, added after the Brevitas extension's fields so that
positional construction keeps working. How the levels combine for one module is decided in
:mod:`quark_brevitas.resolve`.

Behaviour does not live here: the translation to Brevitas is in :mod:`quark_brevitas.quantizers`,
the pipeline in :mod:`quark_brevitas.api`. This module only describes *what* to quantize, checks
what can be checked without a model (:func:`verify_config`, run before any model is touched) and
converts configs to and from plain dicts, JSON and YAML. Checks that need the model (does a layer
name exist? what does a layer get once the levels are merged?) run in :mod:`quark_brevitas.resolve`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas import algos as _algos
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ScaleType, ZeroPointType


class Backend(Enum):
    """The backend target for quantization.

    - ``layerwise``: only quantizes inputs, weights, biases (and optionally outputs) of compute-heavy
      layers, which are replaced one by one by their Brevitas counterparts.
    """

    layerwise = "layerwise"


class QuantType(Enum):
    """The fundamental data type of the quantized values: integers or (OCP) floating point."""

    int_quant = "int_quant"
    float_quant = "float_quant"


class ParamType(Enum):
    """How scale and zero point are determined: statistics (max / percentile) or MSE search."""

    stats = "stats"
    mse = "mse"


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
        try:
            spec = self.resolved()
        except ConfigError:
            spec = self
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


# ===================================================================== the dtype short form
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
_MX_FIELDS: dict[str, Any] = {"qscheme": QSchemeType.per_group, "group_size": MX_BLOCK_SIZE,
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

_SPEC_DEFAULTS: dict[str, Any] = {}


def _spec_default(name: str) -> Any:
    if not _SPEC_DEFAULTS:
        _SPEC_DEFAULTS.update({f.name: f.default for f in fields(QuantizationSpec)})
    return _SPEC_DEFAULTS[name]


def resolve_dtype(spec: QuantizationSpec, path: str = "") -> QuantizationSpec:
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
    if not isinstance(dtype, Dtype):
        raise ConfigError(f"{prefix}dtype", f"must be a Dtype or None; allowed: {[d.name for d in Dtype]}")
    if dtype in REJECTED_DTYPES:
        raise ConfigError(f"{prefix}dtype", f"{dtype.name} is not supported: {REJECTED_DTYPES[dtype]}")
    implied: dict[str, Any]
    if dtype is Dtype.mx:
        if element not in MX_ELEMENT_DTYPES:
            raise ConfigError(f"{prefix}mx_element_dtype", f"dtype=mx needs an MX element format; got "
                              f"{getattr(element, 'name', element)!r}; allowed: {[d.name for d in MX_ELEMENT_DTYPES]}")
        implied = {**DTYPE_FIELDS[element], **_MX_FIELDS}
        what = f"dtype=mx with mx_element_dtype={element.name}"
    else:
        implied = DTYPE_FIELDS[dtype]
        what = f"dtype={dtype.name}"
    changes: dict[str, Any] = {}
    for name, value in implied.items():
        current = getattr(spec, name)
        if current == value:
            continue
        if current != _spec_default(name):
            shown = getattr(current, "name", current)
            raise ConfigError(f"{prefix}{name}", f"{what} means {name}={getattr(value, 'name', value)!r}, but "
                              f"{name} is {shown!r}; leave {name} at its default or make it agree")
        changes[name] = value
    return replace(spec, **changes) if changes else spec


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


@dataclass(eq=True)
class Config:
    """Everything needed to quantize a model.

    - ``global_quant_config``: applied to every compute-heavy layer unless a level below overrides it.
    - ``pre_quant_opt_config``: algorithms run on the float model before quantization, in order.
    - ``algo_config``: algorithms run on the quantized model after calibration, in order.
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
    pre_quant_opt_config: list[_algos.PreQuantOptConfig] = field(
        default_factory=lambda: [_algos.Preprocess()]
    )
    algo_config: list[_algos.AlgoConfig] = field(default_factory=list)
    backend: Backend = Backend.layerwise
    layer_type_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    layer_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # One spelling per layer type, so that a config equals its own round trip through a file.
        if isinstance(self.layer_type_quant_config, Mapping):
            self.layer_type_quant_config = _normalised_type_keys(self.layer_type_quant_config)
        if isinstance(self.exclude, tuple):
            self.exclude = list(self.exclude)

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-compatible dict (enums by name, algorithms as ``{"name": ..., **params}``,
        layer types by name)."""
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and verify a Config from :meth:`to_dict` output. Errors name the offending path."""
        config = _config_from_dict(data)
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
        text = path.read_text()
        if path.suffix.lower() == ".json":
            return cls.from_json(text)
        if path.suffix.lower() in (".yaml", ".yml"):
            return cls.from_yaml(text)
        raise ConfigError("", f"config file {str(path)!r}: unknown extension; allowed: .json, .yaml, .yml")


# Quark's Brevitas extension exports both names for the same classes.
QTensorConfig = QuantizationSpec
QLayerConfig = QuantizationConfig

TENSOR_ROLES = ("input_tensors", "output_tensors", "weight", "bias")
HIERARCHY_LEVELS = ("layer_type_quant_config", "layer_quant_config")


# ===================================================================== layer-type keys and paths
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


def key_path(level: str, key: Any) -> str:
    """The error path of one hierarchy entry, e.g. ``layer_quant_config["fc1"]``."""
    shown = json.dumps(key, ensure_ascii=False) if isinstance(key, str) else repr(key)
    return f"{level}[{shown}]"


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

    Runs before the model is touched. Every rejected combination names its field and what is allowed.
    """
    if not isinstance(config, Config):
        raise ConfigError("", f"expected a quark_brevitas Config, got {type(config).__name__}")
    if not isinstance(config.backend, Backend):
        raise ConfigError("backend", f"must be a Backend, one of {[b.name for b in Backend]}")
    verify_layer_config(config.global_quant_config, "global_quant_config")
    _verify_hierarchy(config)
    _verify_algo_list(config, "pre_quant_opt_config", _algos.PreQuantOptConfig)
    _verify_algo_list(config, "algo_config", _algos.AlgoConfig)
    equalizations = [i for i, algo in enumerate(config.pre_quant_opt_config)
                     if isinstance(algo, _algos.ActivationEqualization)]
    if len(equalizations) > 1:
        raise ConfigError(
            f"pre_quant_opt_config[{equalizations[1]}]",
            "ActivationEqualization may appear once: a second pass would wrap the already wrapped layers, "
            "which Brevitas cannot run; use one entry with the alpha you want",
        )
    post = [a for a in config.algo_config if isinstance(a, _algos.GPTQ | _algos.GPFQ | _algos.GPFA2Q)]
    if len({type(a) for a in post}) > 1:
        names = sorted({type(a).__name__ for a in post})
        raise ConfigError("algo_config", f"use at most one of GPTQ, GPFQ, GPFA2Q (got {names})")


def verify_layer_config(layer: QuantizationConfig, path: str) -> None:
    """Check one QuantizationConfig (all four tensor specs and how they relate)."""
    # Imported here: the translation table imports Brevitas, which the schema alone does not need.
    from quark_brevitas.quantizers import verify_spec

    if not isinstance(layer, QuantizationConfig):
        raise ConfigError(path, f"must be a QuantizationConfig (QLayerConfig), got {type(layer).__name__}")
    for role in TENSOR_ROLES:
        spec = getattr(layer, role)
        if spec is not None:
            verify_spec(spec, role, f"{path}.{role}")
    if layer.bias is not None and layer.input_tensors is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs input quantization (the bias scale is input scale x weight scale); "
            "set input_tensors or remove bias",
        )
    if layer.bias is not None:
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
    if layer.bias is not None and layer.weight is None:
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
    from quark_brevitas.quantizers import verify_spec

    if not isinstance(layer, QuantizationConfig):
        raise ConfigError(path, f"must be a QuantizationConfig (QLayerConfig), got {type(layer).__name__}")
    specs = {role: getattr(layer, role) for role in TENSOR_ROLES}
    for role, spec in specs.items():
        if spec is not None:
            verify_spec(spec, role, f"{path}.{role}")
    if all(spec is None for spec in specs.values()):
        raise ConfigError(
            path,
            "all of input_tensors, output_tensors, weight and bias are None, which changes nothing (None "
            "defers to the next level up); set at least one, or list the layer in exclude to keep it in float",
        )


def _verify_hierarchy(config: Config) -> None:
    for level in HIERARCHY_LEVELS:
        entries = getattr(config, level)
        what = "layer types" if level == "layer_type_quant_config" else "layer names or patterns"
        if not isinstance(entries, dict):
            raise ConfigError(level, f"must be a dict mapping {what} to QuantizationConfig, "
                                     f"got {type(entries).__name__}")
        for key, layer in entries.items():
            if level == "layer_type_quant_config":
                key = layer_type_key(key)
            if not isinstance(key, str) or not key:
                allowed = ("nn.Module subclasses or their class names (e.g. 'Conv2d')"
                           if level == "layer_type_quant_config" else "non-empty module names or patterns")
                raise ConfigError(key_path(level, key), f"keys must be {allowed}, got {key!r}")
            verify_partial_layer_config(layer, key_path(level, key))
    if not isinstance(config.exclude, list):
        raise ConfigError("exclude", f"must be a list of module names or patterns, got {type(config.exclude).__name__}")
    for index, entry in enumerate(config.exclude):
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"exclude[{index}]", f"must be a non-empty module name or pattern, got {entry!r}")


def _verify_algo_list(config: Config, name: str, base: type) -> None:
    algos = getattr(config, name)
    if not isinstance(algos, list | tuple):
        raise ConfigError(name, f"must be a list of {base.__name__} instances, got {type(algos).__name__}")
    for index, algo in enumerate(algos):
        path = f"{name}[{index}]"
        if not isinstance(algo, base):
            allowed = ", ".join(sorted(c.__name__ for c in _algos.registered(base)))
            raise ConfigError(path, f"must be a {base.__name__} ({allowed}), got {type(algo).__name__}")
        algo.verify(config, path)


# ===================================================================== dict conversion
def _to_plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, _algos.AlgorithmConfig):
        return {"name": type(value).__name__, **{f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, Config):
        plain = {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
        plain["layer_type_quant_config"] = {
            layer_type_key(key): _to_plain(layer) for key, layer in value.layer_type_quant_config.items()
        }
        return plain
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {key: _to_plain(v) for key, v in value.items()}
    return value


def _expect_mapping(data: Any, path: str, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be a mapping describing {what}, got {type(data).__name__}")
    return data


def did_you_mean(word: Any, candidates: list[str]) -> str:
    """``"did you mean 'x'? "`` for the closest candidate, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(str(word), candidates, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_keys(data: dict[str, Any], allowed: list[str], path: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{path}.{key}" if path else str(key),
                          f"unknown key; {did_you_mean(key, allowed)}allowed: {allowed}")


def _enum_from(enum_cls: type[Enum], value: Any, path: str) -> Enum:
    if isinstance(value, enum_cls):
        return value
    names = [m.name for m in enum_cls]
    if isinstance(value, str):
        if value in enum_cls.__members__:
            return enum_cls[value]
        for member in enum_cls:
            if member.value == value:
                return member
    hint = did_you_mean(value, names) if isinstance(value, str) else ""
    raise ConfigError(path, f"{value!r} is not a {enum_cls.__name__}; {hint}allowed: {names}")


def _spec_from_dict(data: Any, path: str) -> QuantizationSpec | None:
    if data is None:
        return None
    data = _expect_mapping(data, path, "a QuantizationSpec")
    allowed = [f.name for f in fields(QuantizationSpec)]
    _check_keys(data, allowed, path)
    enums = {"qscheme": QSchemeType, "scale_type": ScaleType, "quant_type": QuantType, "param_type": ParamType,
             "dtype": Dtype, "round_method": RoundType, "zero_point_type": ZeroPointType, "mx_element_dtype": Dtype}
    nullable = {"dtype", "round_method", "zero_point_type", "mx_element_dtype", "is_dynamic", "percentile"}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}"
        if value is None and key in nullable:
            kwargs[key] = None
        elif key in enums:
            kwargs[key] = _enum_from(enums[key], value, sub)
        elif key in ("symmetric", "is_dynamic"):
            if not isinstance(value, bool):
                raise ConfigError(sub, f"must be true or false{' or null' if key in nullable else ''}, got {value!r}")
            kwargs[key] = value
        elif key == "percentile":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(sub, f"must be a number or null, got {value!r}")
            kwargs[key] = value
        else:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(sub, f"must be an integer, got {value!r}")
            kwargs[key] = value
    return QuantizationSpec(**kwargs)


def _layer_from_dict(data: Any, path: str) -> QuantizationConfig:
    data = _expect_mapping(data, path, "a QuantizationConfig")
    _check_keys(data, list(TENSOR_ROLES), path)
    return QuantizationConfig(**{k: _spec_from_dict(v, f"{path}.{k}") for k, v in data.items()})


def _algo_list_from_dict(data: Any, path: str, base: type) -> list[Any]:
    if not isinstance(data, list):
        raise ConfigError(path, f"must be a list of algorithm mappings, got {type(data).__name__}")
    for i, item in enumerate(data):
        if isinstance(item, dict) and "name" in item and not isinstance(item["name"], str):
            allowed = sorted(cls.__name__ for cls in _algos.registered(base))
            raise ConfigError(f"{path}[{i}].name", f"must be an algorithm name; allowed: {allowed}")
    return [_algos.algorithm_from_dict(item, f"{path}[{i}]", base) for i, item in enumerate(data)]


def _levels_from_dict(data: Any, level: str) -> dict[str, QuantizationConfig]:
    what = "layer types" if level == "layer_type_quant_config" else "layer names or patterns"
    data = _expect_mapping(data, level, f"{what} mapped to QuantizationConfig mappings")
    levels: dict[str, QuantizationConfig] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(key_path(level, key), f"keys must be non-empty strings naming {what}, got {key!r}")
        levels[key] = _layer_from_dict(value, key_path(level, key))
    return levels


def _exclude_from_dict(data: Any) -> list[str]:
    if not isinstance(data, list):
        raise ConfigError("exclude", f"must be a list of module names or patterns, got {type(data).__name__}")
    for index, entry in enumerate(data):
        if not isinstance(entry, str) or not entry:
            raise ConfigError(f"exclude[{index}]", f"must be a non-empty module name or pattern, got {entry!r}")
    return list(data)


CONFIG_KEYS = [f.name for f in fields(Config)]


def _config_from_dict(data: Any) -> Config:
    data = _expect_mapping(data, "", "a Config")
    _check_keys(data, CONFIG_KEYS, "")
    if "global_quant_config" not in data:
        raise ConfigError("global_quant_config", "is required")
    global_layer = _layer_from_dict(data["global_quant_config"], "global_quant_config")
    kwargs: dict[str, Any] = {"global_quant_config": global_layer}
    if "pre_quant_opt_config" in data:
        kwargs["pre_quant_opt_config"] = _algo_list_from_dict(
            data["pre_quant_opt_config"], "pre_quant_opt_config", _algos.PreQuantOptConfig
        )
    if "algo_config" in data:
        kwargs["algo_config"] = _algo_list_from_dict(data["algo_config"], "algo_config", _algos.AlgoConfig)
    if "backend" in data:
        kwargs["backend"] = _enum_from(Backend, data["backend"], "backend")
    for level in HIERARCHY_LEVELS:
        if level in data:
            kwargs[level] = _levels_from_dict(data[level], level)
    if "exclude" in data:
        kwargs["exclude"] = _exclude_from_dict(data["exclude"])
    return Config(**kwargs)


__all__ = [
    "Backend",
    "Config",
    "ConfigError",
    "ParamType",
    "QLayerConfig",
    "QTensorConfig",
    "QuantType",
    "QuantizationConfig",
    "QuantizationSpec",
    "key_path",
    "layer_type_key",
    "type_name",
    "verify_config",
    "verify_layer_config",
    "verify_partial_layer_config",
]
