"""The configuration schema: Quark's Brevitas extension config (reference 003), as plain data.

``Config``, ``QuantizationConfig`` (alias ``QLayerConfig``), ``QuantizationSpec`` (alias
``QTensorConfig``), ``QuantType``, ``ParamType`` and ``Backend`` have the names, fields and
defaults of ``quark.torch.extensions.brevitas.config``. Behaviour does not live here: the
translation to Brevitas is in :mod:`quark_brevitas.quantizers`, the pipeline in
:mod:`quark_brevitas.api`. This module only describes *what* to quantize, checks that it can be
honoured (:func:`verify_config`, run before any model is touched) and converts configs to and from
plain dicts, JSON and YAML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from quark_brevitas import algos as _algos
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import QSchemeType, ScaleType


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
    statistics, so ``QuantizationSpec()`` is usable as is.

    - ``qscheme``: granularity (``per_tensor`` or ``per_channel``; ``per_channel`` for weights only).
    - ``symmetric``: zero point in the middle of the integer range (True) or fitted to min/max (False).
    - ``scale_type``: ``float`` or ``pof2`` (power-of-two) scales.
    - ``quant_type``: ``int_quant`` or ``float_quant`` (then give exponent and mantissa widths).
    - ``param_type``: ``stats`` or ``mse``.
    - ``bit_width``: total bits of the quantized value (sign included for float formats).
    - ``exponent_bit_width`` / ``mantissa_bit_width``: float formats only.
    """

    qscheme: QSchemeType = QSchemeType.per_tensor
    symmetric: bool = True
    scale_type: ScaleType = ScaleType.float
    quant_type: QuantType = QuantType.int_quant
    param_type: ParamType = ParamType.stats
    bit_width: int = 8
    exponent_bit_width: int | None = None
    mantissa_bit_width: int | None = None

    def short(self) -> str:
        """A one-line human summary such as ``int8 per_channel sym stats``."""
        if self.quant_type is QuantType.float_quant:
            kind = f"fp{self.bit_width}_e{self.exponent_bit_width}m{self.mantissa_bit_width}"
        else:
            kind = f"int{self.bit_width}"
        sym = "sym" if self.symmetric else "asym"
        scale = "" if self.scale_type is ScaleType.float else f" {self.scale_type.value}"
        return f"{kind} {self.qscheme.value} {sym} {self.param_type.value}{scale}"


@dataclass(eq=True)
class QuantizationConfig:
    """Which tensors of a layer are quantized, and how. ``None`` means: left in float."""

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None


@dataclass(eq=True)
class Config:
    """Everything needed to quantize a model.

    - ``global_quant_config``: applied to every compute-heavy layer.
    - ``pre_quant_opt_config``: algorithms run on the float model before quantization, in order.
    - ``algo_config``: algorithms run on the quantized model after calibration, in order.
    - ``backend``: how layers are replaced (``Backend.layerwise``).
    """

    global_quant_config: QuantizationConfig
    pre_quant_opt_config: list[_algos.PreQuantOptConfig] = field(
        default_factory=lambda: [_algos.Preprocess()]
    )
    algo_config: list[_algos.AlgoConfig] = field(default_factory=list)
    backend: Backend = Backend.layerwise

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-compatible dict (enums by name, algorithms as ``{"name": ..., **params}``)."""
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
    _verify_algo_list(config, "pre_quant_opt_config", _algos.PreQuantOptConfig)
    _verify_algo_list(config, "algo_config", _algos.AlgoConfig)
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
            if spec is not None and spec.quant_type is not QuantType.int_quant:
                raise ConfigError(
                    f"{path}.bias",
                    f"integer bias quantization needs int_quant {role} (its scale is input scale x weight "
                    f"scale); {role} is {spec.quant_type.name}. Remove bias or use int_quant {role}",
                )
    if layer.bias is not None and layer.weight is None:
        raise ConfigError(
            f"{path}.bias",
            "bias quantization needs weight quantization (the bias scale is input scale x weight scale); "
            "set weight or remove bias",
        )


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
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def _expect_mapping(data: Any, path: str, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be a mapping describing {what}, got {type(data).__name__}")
    return data


def _check_keys(data: dict[str, Any], allowed: list[str], path: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}" if path else unknown[0], f"unknown key; allowed: {allowed}")


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
    raise ConfigError(path, f"{value!r} is not a {enum_cls.__name__}; allowed: {names}")


def _spec_from_dict(data: Any, path: str) -> QuantizationSpec | None:
    if data is None:
        return None
    data = _expect_mapping(data, path, "a QuantizationSpec")
    allowed = [f.name for f in fields(QuantizationSpec)]
    _check_keys(data, allowed, path)
    enums = {"qscheme": QSchemeType, "scale_type": ScaleType, "quant_type": QuantType, "param_type": ParamType}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}"
        if key in enums:
            kwargs[key] = _enum_from(enums[key], value, sub)
        elif key == "symmetric":
            if not isinstance(value, bool):
                raise ConfigError(sub, f"must be true or false, got {value!r}")
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
    return [_algos.algorithm_from_dict(item, f"{path}[{i}]", base) for i, item in enumerate(data)]


def _config_from_dict(data: Any) -> Config:
    data = _expect_mapping(data, "", "a Config")
    allowed = ["global_quant_config", "pre_quant_opt_config", "algo_config", "backend"]
    _check_keys(data, allowed, "")
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
    "verify_config",
    "verify_layer_config",
]
