"""Quark's config hierarchy: layer name > layer type > global, exclude, the plan, and the checks
that make a misspelt name fail before anything runs (issue 3)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from brevitas import nn as qnn
from torch import nn

from quark_brevitas import DEFAULT_LAYER_MAP, Container, LayerMapping, algos
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.backend import plan_table
from quark_brevitas.cli import main
from quark_brevitas.cli.digits import evaluate
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig, type_name
from quark_brevitas.errors import CalibrationDataError, ConfigError, ModelError
from quark_brevitas.resolve import literal_length
from quark_brevitas.types import QSchemeType

INT8 = QTensorConfig()
W8A8 = QLayerConfig(weight=INT8, input_tensors=INT8, bias=QTensorConfig(bit_width=32))
W4_PER_CHANNEL = QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel))
W8_PER_TENSOR = QLayerConfig(weight=QTensorConfig(bit_width=8))
CONV = 'layer_type_quant_config["Conv2d"]'
FC1 = 'layer_quant_config["fc1"]'


def done_when_config(**overrides) -> Config:
    """Global W8A8; every Conv2d 4-bit per-channel weights; fc1 8-bit per-tensor; fc2 excluded."""
    kwargs = dict(global_quant_config=W8A8, layer_type_quant_config={"Conv2d": W4_PER_CHANNEL},
                  layer_quant_config={"fc1": W8_PER_TENSOR}, exclude=["fc2"])
    return Config(**{**kwargs, **overrides})


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ===================================================================== the done-when scenario
def test_hierarchy_quantizes_exactly_what_it_says(digits_model, digits_data) -> None:
    config = done_when_config()
    before = _state(digits_model)
    quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    assert _unchanged(digits_model, before)
    modules = dict(quant.named_modules())
    for name, channels in (("conv1", 16), ("conv2", 32)):
        conv = modules[name]
        assert type(conv) is qnn.QuantConv2d
        weight = conv.quant_weight()
        assert int(weight.bit_width) == 4
        assert weight.scale.shape == (channels, 1, 1, 1)  # one scale per output channel
        assert int(conv.input_quant.bit_width()) == 8  # input and bias still come from global
        assert conv.bias_quant.is_quant_enabled
    fc1 = modules["fc1"]
    assert type(fc1) is qnn.QuantLinear
    assert int(fc1.quant_weight().bit_width) == 8 and fc1.quant_weight().scale.numel() == 1
    assert int(fc1.input_quant.bit_width()) == 8
    assert type(modules["fc2"]) is nn.Linear  # excluded: plain float
    assert evaluate(quant, digits_data.test) > 90.0


def test_plan_shows_levels(digits_model) -> None:
    before = _state(digits_model)
    rows = {row.name: row for row in ModelQuantizer(done_when_config()).plan(digits_model)}
    assert _unchanged(digits_model, before)
    assert list(rows) == [name for name, _ in digits_model.named_children()]
    conv1 = rows["conv1"]
    assert conv1.quantized and conv1.module_type == "Conv2d"
    assert conv1.layer_config.weight.short() == "int4 per_channel sym stats"
    assert conv1.sources == {"input_tensors": "global", "output_tensors": "global", "weight": CONV, "bias": "global"}
    assert rows["fc1"].sources["weight"] == FC1 and rows["fc1"].sources["input_tensors"] == "global"
    assert rows["fc1"].layer_config.weight == QTensorConfig(bit_width=8)
    assert not rows["fc2"].quantized and set(rows["fc2"].sources.values()) == {"excluded"}
    assert not rows["bn1"].quantized and rows["bn1"].sources == {}
    table = plan_table(list(rows.values())).splitlines()
    assert table[0].split() == ["name", "type", "quantized", "weight", "input", "output", "bias", "source"]
    line = {row.split()[0]: row for row in table[2:]}
    assert "int4 per_channel sym stats" in line["conv1"] and f"weight: {CONV}; input, output, bias: global" in (
        line["conv1"])
    assert line["fc2"].split()[2] == "no" and line["fc2"].endswith("excluded")


def test_round_trip_keeps_hierarchy(tmp_path: Path) -> None:
    config = done_when_config(layer_quant_config={"fc1": W8_PER_TENSOR, "conv*": QLayerConfig(bias=QTensorConfig(
        bit_width=16))}, algo_config=[algos.GPTQ(act_order=True)])
    data = config.to_dict()
    assert data["layer_type_quant_config"]["Conv2d"]["weight"]["qscheme"] == "per_channel"
    assert list(data["layer_quant_config"]) == ["fc1", "conv*"] and data["exclude"] == ["fc2"]
    assert Config.from_dict(data) == config
    assert Config.from_json(config.to_json()) == config
    assert Config.from_yaml(config.to_yaml()) == config
    assert list(Config.from_yaml(config.to_yaml()).layer_quant_config) == ["fc1", "conv*"]  # order kept


# ===================================================================== layer-type keys
@pytest.mark.parametrize("key", [nn.Conv2d, "Conv2d", "torch.nn.Conv2d", "torch.nn.modules.conv.Conv2d"])
def test_type_key_spellings_are_one_key(key) -> None:
    config = Config(W8A8, layer_type_quant_config={key: W4_PER_CHANNEL})
    assert list(config.layer_type_quant_config) == ["Conv2d"]
    assert config == done_when_config(layer_quant_config={}, exclude=[])
    assert Config.from_dict(config.to_dict()) == config


def test_type_key_given_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="given twice") as info:
        Config(W8A8, layer_type_quant_config={nn.Linear: W8_PER_TENSOR, "Linear": W4_PER_CHANNEL})
    assert info.value.path == 'layer_type_quant_config["Linear"]'


def test_misspelt_type_key_fails_at_construction() -> None:
    config = Config(W8A8, layer_type_quant_config={"Conv2D": W4_PER_CHANNEL})  # Keras spelling
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(config)
    assert info.value.path == 'layer_type_quant_config["Conv2D"]'
    assert "did you mean 'Conv2d'" in str(info.value) and "Linear" in str(info.value)


def test_non_quantizable_type_key_names_supported_types() -> None:
    with pytest.raises(ConfigError, match="not a quantizable layer type.*Conv2d, .*Linear"):
        ModelQuantizer(Config(W8A8, layer_type_quant_config={nn.BatchNorm2d: W8_PER_TENSOR}))


def test_type_key_absent_from_model(digits_model) -> None:
    quantizer = ModelQuantizer(Config(W8A8, layer_type_quant_config={"Conv1d": W8_PER_TENSOR}))
    with pytest.raises(ConfigError, match="DigitsCNN has no Conv1d layer; did you mean 'Conv2d'") as info:
        quantizer.plan(digits_model)
    assert info.value.path == 'layer_type_quant_config["Conv1d"]'


class MyLinear(nn.Linear):
    """A user layer type (a subclass: not matched by a ``Linear`` key, exact-class matching)."""


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mine = MyLinear(4, 4)
        self.plain = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.mine(x))


def test_custom_layer_type_key() -> None:
    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, MyLinear: LayerMapping(qnn.QuantLinear)})
    weight_only = QLayerConfig(weight=INT8)
    config = Config(weight_only, pre_quant_opt_config=[], layer_type_quant_config={MyLinear: W4_PER_CHANNEL})
    assert list(config.layer_type_quant_config) == [type_name(MyLinear)]
    assert type_name(MyLinear).endswith(".MyLinear") and "." in type_name(MyLinear)
    assert Config.from_dict(config.to_dict()) == config
    for key in (type_name(MyLinear), "MyLinear"):
        rows = {r.name: r for r in ModelQuantizer(Config(weight_only, layer_type_quant_config={key: W4_PER_CHANNEL}),
                                                  container=container).plan(TwoLinears())}
        assert rows["mine"].layer_config.weight.bit_width == 4  # the subclass's own entry
        assert rows["plain"].layer_config.weight.bit_width == 8  # a Linear: global
    with pytest.raises(ConfigError, match="not a quantizable layer type"):
        ModelQuantizer(config)  # the default container does not know MyLinear


# ===================================================================== layer names, patterns, exclude
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.key = nn.Linear(8, 8)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention.query(x) + self.attention.key(x))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            x = block(x)
        return x


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _bits(bit_width: int) -> QLayerConfig:
    return QLayerConfig(weight=QTensorConfig(bit_width=bit_width))


def _plan(config: Config, model: nn.Module | None = None) -> dict[str, tuple[int | None, str | None]]:
    """name -> (weight bit width, weight source) of every quantizable layer."""
    rows = ModelQuantizer(config).plan(model if model is not None else Toy())
    return {r.name: (r.layer_config.weight.bit_width if r.layer_config else None, r.sources.get("weight"))
            for r in rows if r.sources}


def test_literal_length() -> None:
    assert literal_length("encoder.layer.*.attention.*") == len("encoder.layer..attention.")
    assert literal_length("fc?") == 2 and literal_length("fc[12]") == 2 and literal_length("fc[!1]x") == 3
    assert literal_length("a[b") == 3  # an unclosed bracket is literal, as in fnmatch


def test_name_precedence_exact_then_most_specific_then_first() -> None:
    config = Config(_bits(8), layer_quant_config={
        "encoder.layer.*": _bits(7),
        "encoder.layer.*.attention.*": _bits(6),
        "encoder.layer.0.attention.query": _bits(5),
        "*.query": _bits(4),
    })
    plan = _plan(config)
    assert plan["encoder.layer.0.attention.query"] == (5, 'layer_quant_config["encoder.layer.0.attention.query"]')
    assert plan["encoder.layer.1.attention.query"] == (6, 'layer_quant_config["encoder.layer.*.attention.*"]')
    assert plan["encoder.layer.1.out"] == (7, 'layer_quant_config["encoder.layer.*"]')
    assert plan["head"] == (8, "global")


@pytest.mark.parametrize("first", ["*.layer.1.out", "encoder.*.out"])
def test_equally_specific_patterns_first_listed_wins(first: str) -> None:
    second = "encoder.*.out" if first == "*.layer.1.out" else "*.layer.1.out"
    assert literal_length(first) == literal_length(second)
    config = Config(_bits(8), layer_quant_config={first: _bits(4), second: _bits(6)})
    assert _plan(config)["encoder.layer.1.out"] == (4, f'layer_quant_config["{first}"]')
    assert _plan(config)["encoder.layer.0.out"][0] == (6 if first == "*.layer.1.out" else 4)


def test_none_defers_per_role_name_then_type_then_global() -> None:
    global_layer = QLayerConfig(weight=INT8, input_tensors=INT8, bias=QTensorConfig(bit_width=32))
    config = Config(global_layer,
                    layer_type_quant_config={"Linear": QLayerConfig(input_tensors=QTensorConfig(bit_width=6))},
                    layer_quant_config={"head": QLayerConfig(weight=QTensorConfig(bit_width=4))})
    rows = {r.name: r for r in ModelQuantizer(config).plan(Toy())}
    head = rows["head"]
    assert head.layer_config == QLayerConfig(weight=QTensorConfig(bit_width=4), input_tensors=QTensorConfig(
        bit_width=6), bias=QTensorConfig(bit_width=32))
    assert head.sources == {"weight": 'layer_quant_config["head"]', "bias": "global", "output_tensors": "global",
                            "input_tensors": 'layer_type_quant_config["Linear"]'}


def test_exclude_block_pattern_and_layer() -> None:
    plan = _plan(Config(_bits(8), exclude=["encoder.layer.0", "*.key"]))
    assert plan["encoder.layer.0.attention.query"] == (None, "excluded")
    assert plan["encoder.layer.0.out"] == (None, "excluded")
    assert plan["encoder.layer.1.attention.key"] == (None, "excluded")
    assert plan["encoder.layer.1.attention.query"] == (8, "global")
    # exclude wins over a name entry for the same layer
    assert _plan(Config(_bits(8), layer_quant_config={"head": _bits(4)}, exclude=["head"]))["head"] == (None,
                                                                                                         "excluded")


def test_everything_excluded_is_an_error(digits_model) -> None:
    with pytest.raises(ModelError, match="quantizes no layer"):
        ModelQuantizer(Config(W8A8, exclude=["*"])).quantize_model(digits_model)


# ===================================================================== errors that show the fix
@pytest.mark.parametrize(
    ("config", "path", "fragments"),
    [
        (Config(W8A8, layer_quant_config={"fc_1": W8_PER_TENSOR}), 'layer_quant_config["fc_1"]',
         ["matches no module of DigitsCNN", "did you mean 'fc1'", "conv1, conv2, fc1, fc2"]),
        (Config(W8A8, layer_quant_config={"decoder.*": W8_PER_TENSOR}), 'layer_quant_config["decoder.*"]',
         ["matches no module"]),
        (Config(W8A8, exclude=["fc2", "fc_2"]), "exclude[1]", ["'fc_2' matches no module", "did you mean 'fc2'"]),
        (Config(W8A8, layer_quant_config={"bn1": W8_PER_TENSOR}), 'layer_quant_config["bn1"]',
         ["not quantized layers (bn1)", "conv1, conv2, fc1, fc2"]),
        (Config(QLayerConfig(weight=INT8), layer_quant_config={"fc1": QLayerConfig(bias=QTensorConfig(bit_width=32))}),
         'layer_quant_config["fc1"].bias', ["module 'fc1' (Linear) after merging", "weight from global",
                                            "needs input quantization"]),
    ],
)
def test_model_errors_before_the_model_is_touched(digits_model, digits_data, config, path, fragments) -> None:
    before = _state(digits_model)
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(config).quantize_model(digits_model, digits_data.calib, inplace=True)
    assert info.value.path == path
    for fragment in fragments:
        assert fragment in str(info.value)
    assert _unchanged(digits_model, before)
    assert type(digits_model.fc1) is nn.Linear  # not replaced, even with inplace=True


def test_key_naming_a_container_suggests_a_pattern() -> None:
    with pytest.raises(ConfigError, match=r"use 'encoder.layer.0.\*'") as info:
        ModelQuantizer(Config(W8A8, layer_quant_config={"encoder.layer.0": W8_PER_TENSOR})).plan(Toy())
    assert "encoder.layer.0.attention.query" in str(info.value)


def test_all_none_entry_is_rejected() -> None:
    with pytest.raises(ConfigError, match="exclude") as info:
        ModelQuantizer(Config(W8A8, layer_quant_config={"fc1": QLayerConfig()}))
    assert info.value.path == 'layer_quant_config["fc1"]'


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({"exclude": "fc2"}, "exclude"),
        ({"exclude": ["fc2", ""]}, "exclude[1]"),
        ({"layer_quant_config": [("fc1", W8_PER_TENSOR)]}, "layer_quant_config"),
        ({"layer_quant_config": {"fc1": W8_PER_TENSOR.weight}}, 'layer_quant_config["fc1"]'),
        ({"layer_type_quant_config": {int: W8_PER_TENSOR}}, "layer_type_quant_config[<class 'int'>]"),
        ({"layer_quant_config": {"fc1": QLayerConfig(weight=QTensorConfig(bit_width=9))}},
         'layer_quant_config["fc1"].weight.bit_width'),
    ],
)
def test_hierarchy_verification_paths(kwargs, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(Config(W8A8, **kwargs))
    assert info.value.path == path


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d["layer_quant_config"]["fc1"]["weight"].update(bit_width="8"),
         'layer_quant_config["fc1"].weight.bit_width', "integer"),
        (lambda d: d["layer_type_quant_config"]["Conv2d"]["weight"].update(qscheme="per_chanel"),
         'layer_type_quant_config["Conv2d"].weight.qscheme', "did you mean 'per_channel'"),
        (lambda d: d["layer_quant_config"]["fc1"].update(wieght=None), 'layer_quant_config["fc1"].wieght',
         "did you mean 'weight'"),
        (lambda d: d.update(exclude=["fc2", 3]), "exclude[1]", "non-empty module name"),
        (lambda d: d.update(layer_quant_config=["fc1"]), "layer_quant_config", "mapping"),
        (lambda d: d.update(excludes=["fc2"]), "excludes", "did you mean 'exclude'"),
    ],
)
def test_from_dict_hierarchy_errors(mutate, path: str, fragment: str) -> None:
    data = done_when_config().to_dict()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert info.value.path == path
    assert fragment in str(info.value)


# ===================================================================== pipeline interplay
def test_preprocess_merging_batchnorm_does_not_break_names(digits_model, digits_data) -> None:
    # bn1 exists in the caller's model (checked there) but is merged away by Preprocess.
    quant = ModelQuantizer(done_when_config(exclude=["fc2", "bn1"])).quantize_model(digits_model, digits_data.calib)
    modules = dict(quant.named_modules())
    assert "bn1" not in modules and type(modules["fc2"]) is nn.Linear


def test_names_survive_activation_equalization(digits_model, digits_data) -> None:
    # Activation equalization wraps each layer (fc1 -> fc1.layer); the name entry must still apply.
    config = Config(W8A8, pre_quant_opt_config=[algos.Preprocess(equalize_iterations=1),
                                                algos.ActivationEqualization()],
                    layer_quant_config={"fc1": W4_PER_CHANNEL}, exclude=["fc2"])
    quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    modules = dict(quant.named_modules())
    assert int(modules["fc1.layer"].quant_weight().bit_width) == 4
    assert int(modules["conv1.layer"].quant_weight().bit_width) == 8
    assert type(modules["fc2.layer"]) is nn.Linear


def test_fx_traced_model_keeps_names(digits_model) -> None:
    traced = torch.fx.symbolic_trace(copy.deepcopy(digits_model))
    rows = {r.name: r for r in ModelQuantizer(done_when_config()).plan(traced)}
    assert rows["fc1"].sources["weight"] == FC1 and not rows["fc2"].quantized


def test_activation_spec_below_global_triggers_calibration(digits_model, digits_data) -> None:
    config = Config(QLayerConfig(weight=INT8), pre_quant_opt_config=[],
                    layer_type_quant_config={"Linear": QLayerConfig(input_tensors=INT8)})
    with pytest.raises(CalibrationDataError, match="activation calibration"):
        ModelQuantizer(config).quantize_model(digits_model)
    quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    assert quant.fc1.input_quant.is_quant_enabled and not quant.conv1.input_quant.is_quant_enabled
    assert evaluate(quant, digits_data.test) > 90.0


# ===================================================================== command line
def _write_yaml(path: Path, config: Config) -> Path:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return path


def test_cli_plan_and_quantize_from_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = _write_yaml(tmp_path / "mixed.yaml", done_when_config())
    assert main(["plan", "--config", str(config_file)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    assert "int4 per_channel sym stats" in lines["conv1"] and CONV in lines["conv1"]
    assert FC1 in lines["fc1"] and lines["fc2"].split()[2] == "no" and "excluded" in lines["fc2"]

    out = tmp_path / "out"
    assert main(["quantize", "--config", str(config_file), "--output", str(out), "--epochs", "3"]) == 0
    assert Config.from_file(out / "config.json") == done_when_config()
    report = (out / "report.json").read_text()
    assert '"quant_accuracy_onnxruntime"' in report


def test_cli_misspelt_name_fails_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = _write_yaml(tmp_path / "typo.yaml", done_when_config(exclude=["fc_2"]))
    out = tmp_path / "out"
    assert main(["quantize", "--config", str(config_file), "--output", str(out), "--epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert "exclude[0]" in err and "did you mean 'fc2'" in err
    assert "Float accuracy" not in err and not out.exists()


def test_example_mixed_precision_file_is_the_done_when_config() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "configs" / "mixed_precision.yaml"
    assert Config.from_file(path) == done_when_config()
