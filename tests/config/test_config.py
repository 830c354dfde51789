"""The schema: reference names and defaults, verification before the model is touched, files and their
format versions, and the generic serialiser they are read and written with."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

import pytest
import torch
from torch import nn

from quark_brevitas import algos
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config import (
    FORMAT_VERSION,
    Backend,
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    QuantType,
    verify_config,
)
from quark_brevitas.config.serialization import Polymorphic, Text, check_fields, from_plain, to_plain
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import QSchemeType, ScaleType

W8A8 = QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32))
FP8 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3)


def test_reference_defaults_and_aliases() -> None:
    spec = QuantizationSpec()
    assert (spec.qscheme, spec.symmetric, spec.scale_type, spec.quant_type, spec.param_type, spec.bit_width) == (
        QSchemeType.per_tensor, True, ScaleType.float, QuantType.int_quant, ParamType.stats, 8)
    assert spec.exponent_bit_width is None and spec.mantissa_bit_width is None
    assert QTensorConfig is QuantizationSpec and QLayerConfig is QuantizationConfig
    layer = QuantizationConfig()
    assert (layer.input_tensors, layer.output_tensors, layer.weight, layer.bias) == (None, None, None, None)
    config = Config(global_quant_config=layer)
    assert config.pre_quant_opt_config == [algos.Preprocess()]
    assert config.algo_config == [] and config.backend is Backend.layerwise
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.bit_width = 4  # type: ignore[misc]


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


BAD_CONFIGS = [
    (QLayerConfig(weight=QTensorConfig(quant_type=QuantType.float_quant)),
     "global_quant_config.weight.exponent_bit_width", "float_quant needs"),
    (QLayerConfig(weight=QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=2)),
     "global_quant_config.weight.bit_width", "1 (sign)"),
    (QLayerConfig(input_tensors=dataclasses.replace(FP8, symmetric=False)),
     "global_quant_config.input_tensors.symmetric", "asymmetric"),
    (QLayerConfig(weight=QTensorConfig(), bias=QTensorConfig(bit_width=32)), "global_quant_config.bias",
     "input quantization"),
    (QLayerConfig(input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)), "global_quant_config.bias",
     "weight quantization"),
    (QLayerConfig(weight=FP8, input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)),
     "global_quant_config.bias", "int_quant weight"),
    (QLayerConfig(weight=QTensorConfig(bit_width=9)), "global_quant_config.weight.bit_width", "2..8"),
    (QLayerConfig(weight=QTensorConfig(bit_width=1)), "global_quant_config.weight.bit_width", "2..8"),
    (QLayerConfig(input_tensors=QTensorConfig(bit_width=17)), "global_quant_config.input_tensors.bit_width",
     "2..16"),
    (QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=12)),
     "global_quant_config.bias.bit_width", "[8, 16, 24, 32]"),
    (QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_group)), "global_quant_config.weight.group_size",
     "per_group needs group_size"),
    (QLayerConfig(input_tensors=QTensorConfig(qscheme=QSchemeType.per_channel)),
     "global_quant_config.input_tensors.qscheme", "per_tensor"),
    (QLayerConfig(weight=QTensorConfig(scale_type=ScaleType.bfloat16)), "global_quant_config.weight.scale_type",
     "float, pof2, pof2_round, float16"),
    (QLayerConfig(weight=QTensorConfig(exponent_bit_width=4)), "global_quant_config.weight.exponent_bit_width",
     "float_quant"),
    (QLayerConfig(weight=QTensorConfig(bit_width="8")), "global_quant_config.weight.bit_width",  # type: ignore
     "integer"),
    (QLayerConfig(weight=QTensorConfig(qscheme="per_tensor")), "global_quant_config.weight.qscheme",  # type: ignore
     "QSchemeType"),
    (QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(),
                  bias=QTensorConfig(bit_width=32, param_type=ParamType.mse)),
     "global_quant_config.bias.param_type", "only bit_width"),
]


@pytest.mark.parametrize(("layer", "path", "fragment"), BAD_CONFIGS)
def test_verification_names_field_and_allowed_values(layer: QLayerConfig, path: str, fragment: str) -> None:
    model = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(Config(global_quant_config=layer)).quantize_model(model)
    assert info.value.path == path
    assert fragment in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


BAD_ALGOS = [
    ([algos.GPTQ(), algos.GPFQ()], "algo_config", "at most one"),
    ([algos.GPFQ(percentage_of_processed_inputs=0.5)], "algo_config[0].percentage_of_processed_inputs", "1.0"),
    ([algos.GPFA2Q(accumulator_bit_width=4)], "algo_config[0].accumulator_bit_width", "8..32"),
    ([algos.GPTQ(act_order="yes")], "algo_config[0].act_order", "True or False"),  # type: ignore[arg-type]
    # algo_config takes every algorithm (Quark 0.13); the default pre_quant_opt_config already has Preprocess
    ([algos.Preprocess()], "algo_config[0]", "Preprocess is listed twice (also at pre_quant_opt_config[0])"),
    (["GPTQ"], "algo_config[0]", "algo_config takes every algorithm config"),
    ([algos.GPTQ(), algos.ActivationEqualization()], "algo_config[1]",
     "ActivationEqualization after GPTQ (algo_config[0]) would undo it"),
    ([algos.BiasCorrection(), algos.GPTQ()], "algo_config[1]", "Put GPTQ before BiasCorrection"),
]


@pytest.mark.parametrize(("algo_list", "path", "fragment"), BAD_ALGOS)
def test_algorithm_verification(algo_list: list, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        verify_config(Config(global_quant_config=W8A8, algo_config=algo_list))
    assert info.value.path == path
    assert fragment in str(info.value)


def test_a_post_quantization_algorithm_in_pre_quant_opt_config_says_where_it_belongs() -> None:
    with pytest.raises(ConfigError) as info:
        verify_config(Config(global_quant_config=W8A8, pre_quant_opt_config=[algos.GPTQ()]))
    assert info.value.path == "pre_quant_opt_config[0]"
    assert "are accepted in algo_config" in str(info.value)
    with pytest.raises(ConfigError, match=r"pre_quant_opt_config\[0\].name: 'GPTQ' is not a PreQuantOptConfig.*"
                                          r"accepted in algo_config"):
        Config.from_dict({"global_quant_config": {}, "pre_quant_opt_config": [{"name": "GPTQ"}]})


def test_gpfq_needs_input_quantization() -> None:
    with pytest.raises(ConfigError, match="input_tensors"):
        verify_config(Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), algo_config=[algos.GPFQ()]))


def test_activation_equalization_must_be_layerwise() -> None:
    with pytest.raises(ConfigError) as info:
        verify_config(Config(global_quant_config=W8A8,
                             pre_quant_opt_config=[algos.ActivationEqualization(is_layerwise=False)]))
    assert info.value.path == "pre_quant_opt_config[0].is_layerwise"


FULL = Config(
    global_quant_config=QLayerConfig(
        weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, param_type=ParamType.mse),
        input_tensors=QTensorConfig(symmetric=False, scale_type=ScaleType.pof2),
        output_tensors=FP8,
        bias=None,
    ),
    pre_quant_opt_config=[algos.Preprocess(equalize_iterations=3), algos.ActivationEqualization(alpha=0.7)],
    algo_config=[algos.GPTQ(act_order=True), algos.BiasCorrection(), algos.CalibrateBatchNorm()],
)


def test_round_trip_dict_json_yaml() -> None:
    assert Config.from_dict(FULL.to_dict()) == FULL
    assert Config.from_json(FULL.to_json()) == FULL
    assert Config.from_yaml(FULL.to_yaml()) == FULL
    assert FULL.to_dict()["global_quant_config"]["weight"]["qscheme"] == "per_channel"
    assert FULL.to_dict()["algo_config"][0] == {"name": "GPTQ", "act_order": True}


def test_from_file(tmp_path) -> None:
    json_file = tmp_path / "c.json"
    json_file.write_text(FULL.to_json())
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(FULL.to_yaml())
    assert Config.from_file(json_file) == FULL == Config.from_file(yaml_file)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "c.toml"
    bad.write_text("")
    with pytest.raises(ConfigError, match=".json, .yaml"):
        Config.from_file(bad)


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d["global_quant_config"]["weight"].update(bit_widht=4), "global_quant_config.weight.bit_widht",
         "unknown key"),
        (lambda d: d["global_quant_config"]["weight"].update(qscheme="per_chanel"),
         "global_quant_config.weight.qscheme", "per_channel"),
        (lambda d: d["global_quant_config"]["weight"].update(bit_width="4"), "global_quant_config.weight.bit_width",
         "integer"),
        (lambda d: d["algo_config"][0].update(name="GPTQQ"), "algo_config[0].name", "GPTQ"),
        (lambda d: d["algo_config"][0].update(order=True), "algo_config[0].order", "act_order"),
        (lambda d: d.update(backend="grpah"), "backend", "layerwise"),
        (lambda d: d.pop("global_quant_config"), "global_quant_config", "required"),
    ],
)
def test_from_dict_errors_name_the_path(mutate, path: str, fragment: str) -> None:
    data = FULL.to_dict()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert info.value.path == path
    assert fragment in str(info.value)


def test_malformed_text_is_config_error() -> None:
    with pytest.raises(ConfigError, match="JSON"):
        Config.from_json("{not json")
    with pytest.raises(ConfigError, match="YAML"):
        Config.from_yaml("a: [unclosed")
    with pytest.raises(ConfigError, match="mapping"):
        Config.from_yaml("- 1\n- 2\n")


def test_short_form() -> None:
    assert QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, param_type=ParamType.mse).short() == (
        "int4 per_channel sym mse")
    assert FP8.short() == "fp8_e4m3 per_tensor sym stats"


# ===================================================================== format versions
EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))


def test_to_dict_starts_with_the_format_version() -> None:
    data = FULL.to_dict()
    assert next(iter(data)) == "format_version" and data["format_version"] == FORMAT_VERSION == 3
    assert FULL.to_yaml().startswith("format_version: 3\n")


@pytest.mark.parametrize("version", [None, 1, FORMAT_VERSION], ids=["absent (format 1)", "1", "current"])
def test_readable_format_versions(version: int | None) -> None:
    data = FULL.to_dict()
    del data["format_version"]
    if version is not None:
        data = {"format_version": version, **data}
    assert Config.from_dict(data) == FULL


@pytest.mark.parametrize(("version", "fragment"), [
    (4, "format version 4 is not supported (written by a newer quark_brevitas"),
    (0, "format version 0 is not supported; this release reads format versions 1, 2, 3"),
    ("2", "must be an integer format version (1, 2, 3), got '2'"),
    (2.0, "got 2.0"),
    (True, "got True"),
    (None, "got None"),
])
def test_unreadable_format_version_is_config_error(version: object, fragment: str) -> None:
    data = {**FULL.to_dict(), "format_version": version}
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert info.value.path == "format_version"
    assert fragment in str(info.value)
    assert "1, 2" in str(info.value)


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_files_of_format_1_load(path: Path) -> None:
    assert "format_version" not in path.read_text()
    config = Config.from_file(path)
    assert Config.from_dict(config.to_dict()) == config


def test_a_checkpoint_config_json_of_format_1_loads(tmp_path: Path) -> None:
    """config.json as checkpoints wrote it before versions were recorded."""
    legacy = {key: value for key, value in FULL.to_dict().items() if key != "format_version"}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert Config.from_file(tmp_path / "config.json") == FULL


# ===================================================================== the generic serialiser
class _Colour(Enum):
    red = "r"
    green = "g"


@dataclass
class _Base:
    pass


@dataclass
class _Circle(_Base):
    radius: float = 1.0


@dataclass
class _Square(_Base):
    side: int = 1
    filled: bool = False


def _shapes(base: type) -> list[type]:
    return list(base.__subclasses__())


@dataclass
class _Part:
    colour: _Colour
    label: str | None = None


@dataclass
class _Drawing:
    """A dataclass unrelated to Config: the serialiser only reads annotations."""

    parts: dict[Annotated[str, Text("part name")], _Part]
    shapes: list[Annotated[_Base, Polymorphic(_shapes, tag="kind")]] = dataclasses.field(default_factory=list)
    scale: int | None = None


def test_serialiser_round_trips_any_annotated_dataclass() -> None:
    drawing = _Drawing({"a": _Part(_Colour.red)}, [_Square(2, True), _Circle(0.5)], 3)
    plain = to_plain(drawing)
    assert plain == {"parts": {"a": {"colour": "red", "label": None}},
                     "shapes": [{"kind": "_Square", "side": 2, "filled": True}, {"kind": "_Circle", "radius": 0.5}],
                     "scale": 3}
    assert from_plain(_Drawing, plain) == drawing
    assert from_plain(_Drawing, {"parts": {"a": {"colour": "g"}}}) == _Drawing({"a": _Part(_Colour.green)})
    check_fields(drawing)


@pytest.mark.parametrize(("data", "path", "fragment"), [
    ({"parts": {"a": {"colour": "blue"}}}, 'parts["a"].colour', "'blue' is not a _Colour; allowed: ['red', 'green']"),
    ({"parts": {"a": {"colour": "gren"}}}, 'parts["a"].colour', "did you mean 'green'?"),
    ({"parts": {"": {"colour": "red"}}}, 'parts[""]', "each key must be a non-empty part name"),
    ({"parts": {"a": {"colour": "red", "lable": "x"}}}, 'parts["a"].lable', "unknown key; did you mean 'label'?"),
    ({"parts": {}, "shapes": [{"kind": "_Triangle"}]}, "shapes[0].kind", "allowed: ['_Circle', '_Square']"),
    ({"parts": {}, "shapes": [{"side": 1}]}, "shapes[0].kind", "is required"),
    ({"parts": {}, "shapes": [{"kind": "_Square", "side": True}]}, "shapes[0].side", "must be an integer, got True"),
    ({"parts": {}, "shapes": [{"kind": "_Square", "filled": 1}]}, "shapes[0].filled", "must be true or false, got 1"),
    ({"parts": {}, "scale": 1.5}, "scale", "must be an integer or null, got 1.5"),
    ({"parts": []}, "parts", "must be a mapping from a non-empty part name to a mapping describing a _Part"),
    ({}, "parts", "is required"),
])
def test_serialiser_errors_name_the_path(data: dict, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_plain(_Drawing, data)
    assert info.value.path == path
    assert fragment in str(info.value)


@pytest.mark.parametrize(("drawing", "path", "fragment"), [
    (_Drawing({"a": _Part("red")}), 'parts["a"].colour', "'red' is not a _Colour; use _Colour.red"),
    (_Drawing({"a": _Part(_Colour.red, label=3)}), 'parts["a"].label', "must be a string or None, got 3"),
    (_Drawing({}, [_Square(filled="yes")]), "shapes[0].filled", "must be True or False, got 'yes'"),
    (_Drawing({}, [_Part(_Colour.red)]), "shapes[0]", "must be a _Base (_Circle, _Square), got _Part"),
    (_Drawing({}, scale=2.0), "scale", "must be an integer or None, got 2.0"),
])
def test_type_check_of_objects_built_in_code(drawing: _Drawing, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_fields(drawing)
    assert info.value.path == path
    assert fragment in str(info.value)
