"""The JSON Schema shipped for config files: up to date, valid, and as strict as from_dict on structure."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import yaml

from quark_brevitas import algos
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.presets import PRESETS, get_preset
from quark_brevitas.config.schema import SCHEMA_PATH, config_json_schema, schema_text
from quark_brevitas.types import QSchemeType

jsonschema = pytest.importorskip("jsonschema")

EXAMPLE_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_shipped_schema_is_generated_one() -> None:
    assert json.loads(SCHEMA_PATH.read_text()) == config_json_schema(), (
        "quark_brevitas/config.schema.json is stale; regenerate it with: python -m quark_brevitas.config.schema")
    assert SCHEMA_PATH.read_text() == schema_text()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(validator, name: str) -> None:
    # the GGUF mixes are built for a model (its layer count); the other presets ignore it
    model = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4)
    validator.validate(get_preset(name, model).to_dict())


def test_every_field_and_algorithm_validates(validator) -> None:
    config = Config(
        QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel), input_tensors=QTensorConfig()),
        pre_quant_opt_config=[algos.Preprocess(), algos.ActivationEqualization(alpha=0.3)],
        algo_config=[algos.GPFA2Q(accumulator_bit_width=20), algos.BiasCorrection(), algos.CalibrateBatchNorm()],
        layer_type_quant_config={"Conv2d": QLayerConfig(weight=QTensorConfig(bit_width=6))},
        layer_quant_config={"encoder.*.query": QLayerConfig(input_tensors=QTensorConfig(bit_width=16))},
        exclude=["head"],
    )
    validator.validate(config.to_dict())
    validator.validate({"global_quant_config": {}})  # everything else defaults
    validator.validate({"format_version": 1, "global_quant_config": {}})
    for path in EXAMPLE_CONFIGS.glob("*.yaml"):
        validator.validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["global_quant_config"]["weight"].update(bit_widht=4),  # misspelt key
        lambda d: d.update(layer_quant_confg={}),
        lambda d: d["global_quant_config"]["weight"].update(qscheme="per_chanel"),
        lambda d: d["global_quant_config"]["weight"].update(bit_width="8"),
        lambda d: d["global_quant_config"]["weight"].update(symmetric="yes"),
        lambda d: d.update(exclude="fc2"),
        lambda d: d.update(layer_type_quant_config={"Conv2d": {"weight": {"bit_width": 4}, "wieght": None}}),
        lambda d: d["algo_config"].append({"name": "GPTQQ"}),
        lambda d: d["algo_config"].append({"name": "GPTQ", "order": True}),
        lambda d: d["pre_quant_opt_config"].append({"name": "GPTQ"}),
        lambda d: d.pop("global_quant_config"),
        lambda d: d.update(format_version=99),  # a newer format than this release reads
        lambda d: d.update(format_version="2"),
    ],
)
def test_schema_rejects_what_from_dict_rejects(validator, mutate) -> None:
    data = get_preset("w4a8_gptq").to_dict()
    mutate(data)
    assert not validator.is_valid(data)
    with pytest.raises(ValueError):
        Config.from_dict(data)


def test_schema_documents_fields() -> None:
    schema = config_json_schema()
    spec = schema["$defs"]["QuantizationSpec"]["properties"]
    assert spec["qscheme"]["enum"] == ["per_tensor", "per_channel", "per_group"]
    assert spec["bit_width"]["default"] == 8 and "description" in spec["bit_width"]
    assert "fnmatch" in schema["properties"]["layer_quant_config"]["description"]
    assert "Conv2d" in schema["properties"]["layer_type_quant_config"]["propertyNames"]["examples"]
    # algo_config takes every algorithm (Quark 0.13), pre_quant_opt_config the weight transforms
    names = {ref["$ref"].rsplit("/", 1)[1] for ref in schema["$defs"]["AlgorithmConfig"]["oneOf"]}
    assert names == {"AWQConfig", "BiasCorrection", "CalibrateBatchNorm", "GPFA2Q", "GPFQ", "GPTQ", "GPTQConfig",
                     "ActivationEqualization", "Preprocess", "RotationConfig", "SmoothQuantConfig", "QronosConfig",
                     "AutoRoundConfig"}
