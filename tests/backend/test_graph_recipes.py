"""``finn_config``: the ``finn_w*a*`` presets with the network's ends named (wide first/last layers, a quantized
model output), found on the torch.fx trace."""

from __future__ import annotations

import pytest
import torch
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised
from torch import nn

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.backend.graph import FINN_QAT_RECIPE, end_layers, finn_config
from quark_brevitas.config import QTensorConfig
from quark_brevitas.config.enums import QSchemeType, RoundType, ScaleType
from quark_brevitas.config.presets import get_preset
from quark_brevitas.errors import ConfigError


class TwoStems(nn.Module):
    """Two layers read the input (one behind a reshape), two heads form the output (one behind a ReLU): the
    ends are sets, and module registration order is not graph order (``tail`` is registered first)."""

    def __init__(self) -> None:
        super().__init__()
        self.tail = nn.Linear(8, 3)
        self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(64, 8)
        self.mid, self.other = nn.Linear(4 * 64, 8), nn.Linear(8, 3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.flatten(self.a(x), 1)) + self.b(x.reshape(x.shape[0], -1))
        return torch.cat([self.tail(h), self.relu(self.other(h))], dim=1)


@pytest.mark.parametrize(("name", "first", "last"), [
    ("mlp", "fc1", "fc3"), ("residual_cnn", "conv0", "fc"), ("mobilenet", "stem", "fc"),
    ("encoder_decoder", "enc", "head"), ("conv1d", "conv1", "fc")])
def test_end_layers_of_the_zoo(name: str, first: str, last: str) -> None:
    assert end_layers(GRAPH_ZOO[name]()) == ((first,), (last,))


def test_end_layers_are_found_on_the_graph_not_by_registration_order() -> None:
    assert end_layers(TwoStems()) == (("a", "b"), ("tail", "other"))


def test_without_options_it_is_the_preset() -> None:
    model = GRAPH_ZOO["residual_cnn"]()
    for bits in (2, 4, 8):
        assert finn_config(bits, model) == get_preset(f"finn_w{bits}a{bits}")


def test_wide_ends_and_quantized_output_name_the_layers() -> None:
    config = finn_config(2, TwoStems(), ends_bits=8, output_bits=6)
    layer = config.global_quant_config
    # the preset's arithmetic (power-of-two scales, ties up), only the widths changed
    exact = {"scale_type": ScaleType.pof2_round}
    wide = QTensorConfig(bit_width=8, qscheme=QSchemeType.per_channel, **exact)
    assert set(config.layer_quant_config) == {"a", "b", "tail", "other"}
    for name in ("a", "b"):
        assert config.layer_quant_config[name].input_tensors == QTensorConfig(bit_width=8, **exact,
                                                                              round_method=RoundType.half_up)
        assert config.layer_quant_config[name].weight == wide
        assert config.layer_quant_config[name].output_tensors is None
    for name in ("tail", "other"):
        assert config.layer_quant_config[name].input_tensors == layer.input_tensors  # the shared point's width
        assert config.layer_quant_config[name].weight == wide
        assert config.layer_quant_config[name].output_tensors == QTensorConfig(bit_width=6, **exact,
                                                                               round_method=RoundType.half_up)
    assert layer.weight.bit_width == 2 and FINN_QAT_RECIPE[2] == (60, 1e-2)


def test_quantized_output_puts_the_models_output_on_one_grid() -> None:
    """With ``output_bits=4`` the encoder-decoder's pixel map takes at most 16 values, integer multiples of one
    step; without it the map is float."""
    x = input_batch(32)
    model = randomised(GRAPH_ZOO["encoder_decoder"]())
    with torch.no_grad():
        grid = ModelQuantizer(finn_config(4, model, output_bits=4)).quantize_model(model, [x[:16], x[16:]])(x)
        plain = ModelQuantizer(finn_config(4, model)).quantize_model(randomised(GRAPH_ZOO["encoder_decoder"]()),
                                                                      [x[:16], x[16:]])(x)
    values = torch.unique(grid)
    assert len(values) <= 16 and len(torch.unique(plain)) > 16
    step = float(torch.diff(values).min())
    assert torch.allclose(values / step, torch.round(values / step), atol=1e-4)


@pytest.mark.parametrize(("field", "value"), [("ends_bits", 1), ("output_bits", 9), ("output_bits", True),
                                              ("ends_bits", 8.0), ("bits", 3)])
def test_bad_widths_name_the_field(field: str, value: object) -> None:
    kwargs = {"bits": 4, field: value}
    with pytest.raises(ConfigError, match=field):
        finn_config(kwargs.pop("bits"), GRAPH_ZOO["mlp"](), **kwargs)
