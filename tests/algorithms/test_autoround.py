"""AutoRoundConfig (issue 19): learned rounding offsets and clipping per block, on Brevitas's grid.

References: round to nearest through Brevitas's own quantized weight (``iters=0`` must equal it exactly), the float
model's output, the block-output error computed here.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import INT4_G32, UINT4_G32, tiny_bert, tiny_llama, token_batches, weight_only_config  # noqa: E402
from helpers.rounding_checks import (  # noqa: E402
    assert_beats_rounding_on_brevitas_grid,
    assert_block_and_whole_model_paths_agree,
    assert_survives_a_checkpoint,
    block_layers,
)

from quark_brevitas.algorithms import describe_algorithms, handler_for  # noqa: E402
from quark_brevitas.algorithms.autoround import LearnedRounding  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.blocks.capture import capture_block_inputs  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402
from quark_brevitas.calibration.data import BlockInputs, CalibrationData  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    AutoRoundConfig,
    Config,
    QronosConfig,
    QuantizationSpec,
)
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

INT3_CHANNEL = QuantizationSpec(bit_width=3, qscheme=QSchemeType.per_channel)


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return token_batches(count=2)


@pytest.mark.slow
@pytest.mark.parametrize("weight", [INT4_G32, UINT4_G32], ids=["int4-g32", "uint4-g32"])
def test_zero_iterations_is_round_to_nearest_exactly(weight, batches) -> None:
    model = tiny_llama()
    learned = ModelQuantizer(weight_only_config(weight, AutoRoundConfig(iters=0))).quantize_model(model, batches)
    rounded = ModelQuantizer(weight_only_config(weight)).quantize_model(model, batches)
    for a, b in zip(block_layers(learned), block_layers(rounded), strict=True):
        assert torch.equal(a.quant_weight().value, b.quant_weight().value)
    with torch.no_grad():
        assert torch.equal(learned(batches[0]).logits, rounded(batches[0]).logits)


@pytest.mark.slow
@pytest.mark.parametrize(("build", "weight", "clip"), [(tiny_llama, INT4_G32, True), (tiny_llama, UINT4_G32, True),
                                                       (tiny_bert, INT3_CHANNEL, False)],
                         ids=["llama-int4-clip", "llama-uint4-clip", "bert-int3-channel"])
def test_autoround_beats_rounding_and_sits_on_brevitas_grid(build, weight, clip, batches) -> None:
    algo = AutoRoundConfig(iters=40, lr=1 / 40, minmax_lr=1 / 40, enable_minmax_tuning=clip, batch_size=2)
    assert_beats_rounding_on_brevitas_grid(build, weight, algo, batches)


def test_learned_rounding_offsets_and_clipping_act_as_defined() -> None:
    """Offsets of +-0.5 move each code by one step where rounding was close; clipping factors shrink the grid."""
    from helpers.adapter_layers import weight_only_linear

    layer = weight_only_linear(INT4_G32, 64, 8)
    rounding = LearnedRounding.of(layer, tune_clip=True)
    grid = rounding.grid
    assert torch.equal(rounding.finish(), grid.quantize(rounding.weight))  # untouched: round to nearest
    with torch.no_grad():
        rounding.offsets.fill_(0.49)
    up = rounding.finish()
    codes_up, codes = (up / grid.scale).round(), (grid.quantize(rounding.weight) / grid.scale).round()
    assert bool(((codes_up - codes) >= 0).all()) and bool((codes_up != codes).any())
    with torch.no_grad():
        rounding.offsets.zero_()
        for factor in rounding.clip:
            factor.fill_(0.5)
    clipped = rounding.finish()  # the layer's quantizer now holds the grid of the weight clipped to half its range
    with torch.no_grad():
        scale = layer.quant_weight().scale
    assert torch.allclose(scale.expand_as(grid.scale), 0.5 * grid.scale, rtol=1e-5)
    # Half the range: the largest code times half the scale (the full grid's -8 reaches 8/7.5 of max|group|).
    top_code = max(-float(grid.min_int), float(grid.max_int))
    assert bool((clipped.abs() <= 0.5 * grid.scale.expand_as(clipped) * top_code + 1e-6).all())
    divisor = float(grid.max_int) + (top_code - float(grid.max_int)) / 2  # min-max divisor: 7.5 full, 7 narrow
    assert float(clipped.abs().max()) <= 0.5 * float(rounding.weight.abs().max()) * top_code / divisor + 1e-6


@pytest.mark.slow
def test_autoround_block_by_block_and_whole_model_paths_agree(batches) -> None:
    assert_block_and_whole_model_paths_agree(weight_only_config(INT4_G32, AutoRoundConfig(iters=10, batch_size=2)),
                                             batches)


@pytest.mark.slow
def test_autoround_survives_a_checkpoint(batches, tmp_path) -> None:
    assert_survives_a_checkpoint(weight_only_config(INT4_G32, AutoRoundConfig(iters=10)), batches, tmp_path / "ckpt")


def test_autoround_config_has_quarks_defaults_and_round_trips() -> None:
    algo = AutoRoundConfig()
    assert (algo.name, algo.iters, algo.lr, algo.enable_minmax_tuning, algo.minmax_lr, algo.batch_size) == \
        ("autoround", 200, 1 / 200, True, 1 / 200, 8)
    config = weight_only_config(INT4_G32, AutoRoundConfig(iters=50, enable_minmax_tuning=False,
                                               inside_layer_modules=["mlp.down_proj"]))
    data = config.to_dict()
    assert data["algo_config"][0]["name"] == "autoround"
    assert data["algo_config"][0]["iters"] == 50
    assert Config.from_dict(data) == config
    assert Config.from_yaml(config.to_yaml()) == config


@pytest.mark.parametrize(("algo", "message"), [
    (AutoRoundConfig(iters=-1), r"algo_config\[0\].iters: must be >= 0"),
    (AutoRoundConfig(lr=0.0), r"algo_config\[0\].lr: must be > 0"),
    (AutoRoundConfig(minmax_lr=-1.0), r"algo_config\[0\].minmax_lr: must be > 0"),
    (AutoRoundConfig(batch_size=0), r"algo_config\[0\].batch_size: must be >= 1"),
    (AutoRoundConfig(name="AutoRound"), r"algo_config\[0\].name: must be 'autoround'"),
])
def test_autoround_config_errors_name_the_field(algo, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelQuantizer(weight_only_config(INT4_G32, algo))


def test_plan_describes_autoround() -> None:
    lines = describe_algorithms(weight_only_config(INT4_G32, AutoRoundConfig(iters=7)), tiny_llama())
    assert "algo_config[0] AutoRoundConfig:" in lines
    assert any("min/max clipping" in line and "7 steps" in line and "mlp.down_proj" in line for line in lines)


class _DoublingData(BlockInputs):
    """Block inputs reduced as if a second process held the same data (sums doubled): results must not change."""

    def __init__(self, inputs: BlockInputs) -> None:
        calls = list(inputs.loader)
        super().__init__(calls.__getitem__, len(calls), inputs.parent, inputs.label)
        self.reductions = 0

    def all_reduce(self, tensor, op="sum"):
        self.reductions += 1
        return tensor.mul_(2) if op == "sum" else tensor


@pytest.mark.parametrize("algo", [QronosConfig(), AutoRoundConfig(iters=6, batch_size=2)], ids=["qronos", "autoround"])
def test_statistics_are_reduced_over_processes_without_changing_the_result(algo, batches) -> None:
    model = ModelQuantizer(weight_only_config(INT4_G32)).quantize_model(tiny_llama(layers=1), batches)
    plain = copy.deepcopy(model)
    handler = handler_for(algo)
    block = model.get_submodule("model.layers.0")
    with handler.inputs_context(model):
        inputs = capture_block_inputs(model, block, CalibrationData(batches), "inputs")
    doubling = _DoublingData(inputs)
    handler.apply_block(algo, block, doubling, "model.layers.0")
    assert doubling.reductions > 0
    handler.apply_block(algo, plain.get_submodule("model.layers.0"), inputs, "model.layers.0")
    pairs = [(a, b) for a, b in zip(block.modules(), plain.get_submodule("model.layers.0").modules(), strict=True)
             if isinstance(a, QuantLayer)]
    assert len(pairs) == 7
    for a, b in pairs:
        assert torch.allclose(a.weight, b.weight, atol=1e-6), "reducing over (simulated) processes changed the result"


def test_mse_clip_init_starts_from_a_smaller_rounding_error_on_the_grid_it_ends_on() -> None:
    """``clip_init="mse"``: each group's factors start where its rounding error is least; ``finish`` then
    re-initialises the layer's quantizer from the clipped weight, whose grid is the searched one."""
    from helpers.adapter_layers import weight_only_linear

    weight = QuantizationSpec(bit_width=3, qscheme=QSchemeType.per_group, group_size=32, narrow_range=False)
    layer = weight_only_linear(weight, 64, 8)
    with torch.no_grad():
        layer.weight[:, ::16] *= 6  # a few large weights per group: min-max wastes most codes on them
    rounding = LearnedRounding.of(layer, tune_clip=True)
    minmax_error = float(((rounding.finish() - rounding.weight) ** 2).sum())
    rounding.search_clip()
    low, high = (factor.detach() for factor in rounding.clip)
    assert torch.equal(low, high) and float(low.min()) >= 0.5 and bool((low < 1).any())
    searched = rounding.finish()
    assert float(((searched - rounding.weight) ** 2).sum()) < 0.8 * minmax_error
    with torch.no_grad():
        assert torch.allclose(searched, rounding.fake_quantized(), atol=1e-6)  # trained and final grids agree
        assert torch.equal(layer.quant_weight().value, searched)


def test_clip_init_is_checked_and_serialised_only_when_set() -> None:
    assert "clip_init" not in weight_only_config(INT4_G32, AutoRoundConfig()).to_dict()["algo_config"][0]
    config = weight_only_config(INT4_G32, AutoRoundConfig(clip_init="mse"))
    assert Config.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"algo_config\[0\].clip_init: must be one of \[None, 'mse'\]"):
        ModelQuantizer(weight_only_config(INT4_G32, AutoRoundConfig(clip_init="max")))
    with pytest.raises(ConfigError, match=r"algo_config\[0\].clip_init: 'mse' needs enable_minmax_tuning=True"):
        ModelQuantizer(weight_only_config(INT4_G32, AutoRoundConfig(clip_init="mse", enable_minmax_tuning=False)))
