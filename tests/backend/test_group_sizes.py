"""A per-group weight on a layer whose input channels are no multiple of the group size (or fewer) is refused by
``plan()``, naming the layer, unless the spec asks for padding (issue 27: group sizes 7 and 100000 on 64-wide
layers were accepted and padded silently, making evaluation 3-70x slower). MX blocks pad unless told not to, as
Quark 0.13's MX quantizer does; every padding run says which layers it pads."""

from __future__ import annotations

import pytest
import torch
from helpers import reference as ref
from torch import nn

from quark_brevitas import ModelQuantizer
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import Dtype, QSchemeType


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))


def _config(group_size: int, **fields: object) -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_group, group_size=group_size, bit_width=4, **fields)
    return Config(QLayerConfig(weight=weight), pre_quant_opt_config=[])


@pytest.mark.parametrize(("group_size", "layer", "relation"), [(7, "0", "64 input channels are no multiple of"),
                                                                (100000, "0", "64 input channels are fewer than"),
                                                                (32, "2", "48 input channels are no multiple of")])
def test_a_group_size_that_does_not_divide_a_layer_is_refused_naming_it(group_size: int, layer: str,
                                                                         relation: str) -> None:
    with pytest.raises(ConfigError, match=f"module '{layer}': its {relation} group_size {group_size}") as caught:
        ModelQuantizer(_config(group_size)).plan(_model())
    assert caught.value.path == "global_quant_config.weight.group_size"
    assert "pad_groups=True" in str(caught.value)


def test_padding_when_asked_for_quantizes_as_the_reference_pads() -> None:
    """``pad_groups=True``: the last group of the 48-wide layer is padded with zeros (which change no group's
    max|w|), as every release before this one did silently; checked against the hand-written reference."""
    model = _model()
    weight = model[2].weight.detach().clone()
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_group, group_size=32, bit_width=8,
                                                      pad_groups=True)), pre_quant_opt_config=[])
    quantized = ModelQuantizer(config).quantize_model(model)
    expected = ref.int_qdq(weight, ref.group_symmetric_scale(weight, 8, 32), 0, 8, True, True)
    ref.assert_close(quantized[2].quant_weight().value.detach(), expected, "padded per-group int8 weight")
    ModelQuantizer(_config(16)).plan(_model())  # 64 and 48 are multiples of 16: nothing to ask for


def test_pad_groups_is_a_per_group_weight_field_written_only_when_set() -> None:
    with pytest.raises(ConfigError, match=r"pad_groups: only used with per_group weights"):
        ModelQuantizer(Config(QLayerConfig(weight=QTensorConfig(pad_groups=True))))
    assert "pad_groups" not in Config(QLayerConfig(weight=QTensorConfig())).to_dict()["global_quant_config"]["weight"]
    round_trip = Config.from_dict(_config(32, pad_groups=True).to_dict())
    assert round_trip.global_quant_config.weight.pad_groups is True


def test_the_refusal_comes_before_calibration_and_names_field_width_and_what_is_allowed() -> None:
    """quantize_model refuses in its plan: the calibration data is never read."""

    class Untouchable:
        def __iter__(self):
            pytest.fail("calibration started for a config plan() must refuse")

    with pytest.raises(ConfigError) as caught:
        ModelQuantizer(_config(100000)).quantize_model(_model(), Untouchable())
    message = str(caught.value)
    assert "module '0'" in message and "64 input channels" in message and "group_size 100000" in message
    assert "allowed: a group_size that divides 64 (e.g. 32)" in message


def test_mx_blocks_pad_as_quark_does_and_say_so_unless_told_not_to(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    mx = QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4)
    with caplog.at_level("INFO", logger="quark_brevitas"):
        ModelQuantizer(Config(QLayerConfig(weight=mx), pre_quant_opt_config=[])).quantize_model(model)
    assert "Padding the last weight group of 1 layer(s)" in caplog.text and "0 (1 inputs, groups of 32)" in caplog.text
    strict = QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, pad_groups=False)
    with pytest.raises(ConfigError, match=r"module '0': its 1 input channels are fewer than group_size 32"):
        ModelQuantizer(Config(QLayerConfig(weight=strict), pre_quant_opt_config=[])).plan(model)
