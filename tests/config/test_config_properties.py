"""Property-based tests of the config format (hypothesis).

- Random configs (hierarchy included) either fail verification or round-trip through dict, JSON and
  YAML to an equal Config.
- Random verified configs either are rejected (ConfigError / ModelError) before the model is touched,
  or quantize the digits CNN to a model with finite outputs.
- Random malformed dicts, made by breaking valid ones, always raise ConfigError, never another
  exception; arbitrary JSON-like data gives a Config or a ConfigError, nothing else.

Example counts are kept small: quantizing the digits CNN takes 0.1-1 s.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from typing import Any

import pytest
import torch
import yaml
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer as QuantWBIOL
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from quark_brevitas import algos
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config import (
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantType,
    verify_config,
)
from quark_brevitas.config.formats import OBSERVER_FIELDS
from quark_brevitas.errors import ConfigError, ModelError
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ScaleType, ZeroPointType

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUICK = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DIGITS_LAYERS = ["conv1", "conv2", "fc1", "fc2"]
# Mostly names the digits CNN has; the last entry of each list is rejected by the model check.
NAME_KEYS = [*DIGITS_LAYERS, "fc*", "conv?", "*", "*1", *DIGITS_LAYERS, "bn1", "fc_1"]
EXCLUDES = ["fc2", "conv1", "fc*", "bn1", "pool", "fc2", "conv1", "conv_2"]
TYPE_KEYS = ["Conv2d", "Linear", "Conv2d", "Linear", "Conv1d"]
FLOAT_SPLITS = [(4, 3), (5, 2), (2, 1), (3, 2), (2, 3)]


# ===================================================================== strategies: configs
def _int_spec(weight: bool) -> st.SearchStrategy[QTensorConfig]:
    qschemes = [QSchemeType.per_tensor, QSchemeType.per_channel] if weight else [QSchemeType.per_tensor]
    return st.builds(QTensorConfig, qscheme=st.sampled_from(qschemes), symmetric=st.booleans(),
                     scale_type=st.sampled_from([ScaleType.float, ScaleType.pof2]),
                     param_type=st.sampled_from(ParamType), bit_width=st.integers(2, 8))


def _float_spec(weight: bool) -> st.SearchStrategy[QTensorConfig]:
    qschemes = [QSchemeType.per_tensor, QSchemeType.per_channel] if weight else [QSchemeType.per_tensor]
    return st.builds(lambda split, qscheme, param: QTensorConfig(
        qscheme=qscheme, quant_type=QuantType.float_quant, param_type=param, bit_width=1 + sum(split),
        exponent_bit_width=split[0], mantissa_bit_width=split[1]),
        st.sampled_from(FLOAT_SPLITS), st.sampled_from(qschemes), st.sampled_from(ParamType))


# Anything the dataclass accepts, most of it unsupported: exercises verification.
_WILD_SPEC = st.builds(QTensorConfig, qscheme=st.sampled_from(QSchemeType), symmetric=st.booleans(),
                       scale_type=st.sampled_from(ScaleType), quant_type=st.sampled_from(QuantType),
                       param_type=st.sampled_from(ParamType), bit_width=st.integers(0, 40),
                       exponent_bit_width=st.none() | st.integers(0, 8),
                       mantissa_bit_width=st.none() | st.integers(0, 8),
                       dtype=st.none() | st.sampled_from(Dtype), group_size=st.none() | st.integers(0, 64),
                       ch_axis=st.none() | st.integers(-1, 2), round_method=st.none() | st.sampled_from(RoundType),
                       is_dynamic=st.none() | st.booleans(), zero_point_type=st.none() | st.sampled_from(ZeroPointType),
                       mx_element_dtype=st.none() | st.sampled_from(Dtype),
                       percentile=st.none() | st.floats(-1, 101, allow_nan=False))

# The number formats of issue 4 (dtype short forms, per-group, MX), for weights and activations.
_FORMAT_SPEC = {
    "weight": st.sampled_from([
        QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32),
        QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=16),
        QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4),
        QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8),
        QTensorConfig(dtype=Dtype.fp6_e2m3, qscheme=QSchemeType.per_channel, round_method=RoundType.floor),
    ]),
    "act": st.sampled_from([
        QTensorConfig(dtype=Dtype.uint8, percentile=99.9),
        QTensorConfig(dtype=Dtype.int8, is_dynamic=True),
        QTensorConfig(dtype=Dtype.fp8_e5m2, is_dynamic=True),
        QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3),
    ]),
}


_GOOD_BIAS = st.builds(QTensorConfig, bit_width=st.sampled_from([8, 16, 24, 32]))


def _good_spec(role: str) -> st.SearchStrategy[QTensorConfig]:
    if role == "bias":
        return _GOOD_BIAS
    return _int_spec(role == "weight") | _float_spec(role == "weight") | \
        _FORMAT_SPEC["weight" if role == "weight" else "act"]


@st.composite
def _global_layer(draw: st.DrawFn) -> QLayerConfig:
    """A global layer config that passes verification (bias only with int input and weight)."""
    weight = draw(st.none() | _good_spec("weight"))
    inputs = draw(st.none() | _good_spec("input_tensors"))
    output = draw(st.none() | st.none() | _good_spec("output_tensors"))
    ints = weight is not None and inputs is not None and QuantType.float_quant not in (weight.quant_type,
                                                                                       inputs.quant_type)
    bias = draw(st.none() | _GOOD_BIAS) if ints else None
    return QLayerConfig(input_tensors=inputs, output_tensors=output, weight=weight, bias=bias)


@st.composite
def _partial_layer(draw: st.DrawFn) -> QLayerConfig:
    """A layer-type or layer-name entry: one to three supported specs (bias rarely: it may clash with
    the levels above, which the plan rejects)."""
    roles = draw(st.lists(st.sampled_from(["weight", "weight", "input_tensors", "output_tensors", "bias"]),
                          min_size=1, max_size=3, unique=True))
    return QLayerConfig(**{role: draw(_good_spec(role)) for role in roles})


_PRE = st.lists(st.one_of(
    st.builds(algos.Preprocess, equalize_iterations=st.integers(0, 2), merge_batch_norm=st.booleans()),
    st.builds(algos.ActivationEqualization, alpha=st.floats(0.0, 1.0)),
), max_size=2)
_POST = st.lists(st.sampled_from([algos.BiasCorrection(), algos.GPTQ(), algos.CalibrateBatchNorm(),
                                  algos.GPTQ(act_order=True)]), max_size=1)

#: Configs that pass verify_config (GPTQ without global weights aside); some name layers the digits
#: CNN does not have, or merge into an invalid layer config, which the plan rejects.
VALID_CONFIGS = st.builds(
    Config,
    global_quant_config=_global_layer(),
    pre_quant_opt_config=_PRE,
    algo_config=_POST,
    layer_type_quant_config=st.dictionaries(st.sampled_from(TYPE_KEYS), _partial_layer(), max_size=2),
    layer_quant_config=st.dictionaries(st.sampled_from(NAME_KEYS), _partial_layer(), max_size=3),
    exclude=st.lists(st.sampled_from(EXCLUDES), max_size=2, unique=True),
)


def _wild_layer() -> st.SearchStrategy[QLayerConfig]:
    spec = st.none() | _WILD_SPEC | _good_spec("weight") | _GOOD_BIAS
    return st.builds(QLayerConfig, input_tensors=spec, output_tensors=spec, weight=spec, bias=spec)


#: Anything the dataclasses accept, most of it rejected by verification.
WILD_CONFIGS = st.builds(
    Config,
    global_quant_config=_wild_layer(),
    pre_quant_opt_config=_PRE,
    algo_config=_POST,
    layer_type_quant_config=st.dictionaries(st.sampled_from(TYPE_KEYS), _wild_layer(), max_size=2),
    layer_quant_config=st.dictionaries(st.sampled_from(NAME_KEYS), _wild_layer(), max_size=3),
    exclude=st.lists(st.sampled_from(EXCLUDES), max_size=2, unique=True),
)


def _verified(config: Config) -> bool:
    try:
        verify_config(config)
    except ConfigError:
        return False
    return True


# ===================================================================== round trip
@QUICK
@given(VALID_CONFIGS | WILD_CONFIGS)
def test_round_trip_or_rejected(config: Config) -> None:
    data = config.to_dict()
    json.dumps(data)  # plain data only
    event("verified" if _verified(config) else "rejected by verification")
    if not _verified(config):
        with pytest.raises(ConfigError):
            Config.from_dict(data)
        return
    assert Config.from_dict(data) == config
    assert Config.from_json(config.to_json()) == config
    assert Config.from_yaml(config.to_yaml()) == config


# ===================================================================== quantization
def _calib(digits_data) -> list:
    return [next(iter(digits_data.calib))]  # one batch of 64 images: enough for finite outputs, and fast


@FAST
@given(config=VALID_CONFIGS)
def test_verified_configs_quantize_or_are_rejected_first(config: Config, digits_model, digits_data) -> None:
    """Session fixtures are safe with @given (only function-scoped ones are not)."""
    before = {k: v.clone() for k, v in digits_model.state_dict().items()}
    try:
        quantizer = ModelQuantizer(config)
        quantizer.plan(digits_model)
        quant = quantizer.quantize_model(digits_model, _calib(digits_data))
    except (ConfigError, ModelError) as exc:
        event(f"rejected: {type(exc).__name__} at {getattr(exc, 'path', '') or 'model'}".split("[")[0])
        rejected = True
    else:
        event("quantized")
        rejected = False
        images = next(iter(digits_data.test))[0]
        with torch.no_grad():
            assert torch.isfinite(quant(images)).all()
    after = digits_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the caller's model, either way
    if rejected:
        return
    modules = dict(quant.named_modules())
    for layer in DIGITS_LAYERS:  # excluded layers stay float (possibly wrapped as layer.layer by equalization)
        if any(fnmatchcase(layer, entry) for entry in config.exclude):
            assert not any(isinstance(modules.get(name), QuantWBIOL) for name in (layer, f"{layer}.layer"))


# ===================================================================== malformed input
_JUNK_KINDS: dict[str, st.SearchStrategy[Any]] = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-3, 300),
    "float": st.floats(allow_nan=False),
    "text": st.text(max_size=8),
    "list": st.lists(st.integers(), min_size=1, max_size=2),
    "dict": st.dictionaries(st.sampled_from(["zz", "__bogus__"]), st.integers(), min_size=1, max_size=1),
}
_ENUM_FIELDS = {"qscheme", "scale_type", "quant_type", "param_type", "backend"}
_ENUM_NAMES = {m.name for e in (QSchemeType, ScaleType, QuantType, ParamType, Dtype, RoundType, ZeroPointType)
               for m in e} | {"layerwise"}
# Spec fields whose None is valid: replaced by junk of any other kind.
_NULLABLE_ENUM_FIELDS = {"dtype", "round_method", "zero_point_type", "mx_element_dtype"}
_NULLABLE_SCALAR_FIELDS = {"is_dynamic": ("bool",), "group_size": ("int",), "ch_axis": ("int",),
                           "percentile": ("int", "float")}
_ALGO_NAMES = {c.__name__ for c in algos.registered(algos.AlgorithmConfig)}


def _junk(*but: str) -> st.SearchStrategy[Any]:
    """Junk of every kind except ``but`` (junk dicts and non-empty int lists are never valid)."""
    return st.one_of(*[strategy for kind, strategy in _JUNK_KINDS.items() if kind not in but])


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) into a plain config dict."""
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index))
    return found


def _bad_value(path: tuple, value: Any) -> st.SearchStrategy[Any]:
    """A replacement that is invalid wherever ``path`` points."""
    last = path[-1] if path else None
    if last in _NULLABLE_ENUM_FIELDS:
        return _junk("text", "none") | st.text(max_size=12).filter(lambda t: t not in _ENUM_NAMES)
    if last in _NULLABLE_SCALAR_FIELDS:
        return _junk(*_NULLABLE_SCALAR_FIELDS[last], "none")
    if last == "target_device":  # None (no device) is valid: junk of the other kinds, or a name no device has
        return _junk("text", "none") | st.text(max_size=12).filter(lambda t: t not in {"CPU", "IPU"})
    if last == "observer_cls":  # None or one of Quark's observers by name
        return _junk("text", "none") | st.text(max_size=12).filter(lambda t: t not in OBSERVER_FIELDS)
    if last in _ENUM_FIELDS or last == "name":
        allowed = _ENUM_NAMES if last in _ENUM_FIELDS else _ALGO_NAMES
        return _junk("text") | st.text(max_size=12).filter(lambda t: t not in allowed)
    if isinstance(value, bool):
        return _junk("bool")
    if last in ("exponent_bit_width", "mantissa_bit_width"):
        return _junk("int", "none")
    if isinstance(value, int) or last == "bit_width":
        return _junk("int")
    if isinstance(value, float):
        return _junk("int", "float")
    if last in ("input_tensors", "output_tensors", "weight", "bias", "softmax_quant_spec"):
        return _junk("none")
    if last in ("algo_config", "pre_quant_opt_config"):  # None is Quark's default there: no algorithms
        return _junk("none")
    if isinstance(last, int) and len(path) >= 2 and path[-2] == "exclude":
        return _junk("text") | st.just("")
    return _junk()  # a mapping or a list: nothing in the junk is one that is valid there


def _set(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@st.composite
def malformed(draw: st.DrawFn) -> Any:
    data = draw(VALID_CONFIGS).to_dict()
    paths = _paths(data)
    kind = draw(st.sampled_from(["replace", "unknown_key", "drop_global"]))
    if kind == "drop_global":
        del data["global_quant_config"]
        return data
    if kind == "unknown_key":
        dict_paths = [p for p in paths if isinstance(_get(data, p), dict)]
        path = draw(st.sampled_from(dict_paths))
        _get(data, path)[draw(st.sampled_from(["__bogus__", "bit_widht", "wieght", "excludes"]))] = draw(_junk())
        return data
    path = draw(st.sampled_from(paths))
    return _set(data, path, draw(_bad_value(path, _get(data, path))))


def _get(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data


@QUICK
@given(malformed())
def test_malformed_dicts_raise_config_error(data: Any) -> None:
    with pytest.raises(ConfigError):
        Config.from_dict(data)
    with pytest.raises(ConfigError):
        Config.from_json(json.dumps(data))
    with pytest.raises(ConfigError):
        Config.from_yaml(yaml.safe_dump(data))


_JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["global_quant_config", "weight", "layer_quant_config", "exclude", "fc1", "bit_width",
                         "name", "algo_config", "x"]), children, max_size=3),
    max_leaves=12,
)


@QUICK
@given(_JSON_LIKE)
def test_arbitrary_data_gives_config_or_config_error(data: Any) -> None:
    try:
        result = Config.from_dict(data)
    except ConfigError:
        return
    assert isinstance(result, Config)
