"""MagR before GPTQ's rounding (``GPTQConfig(magr_alpha=...)``, quark_brevitas.algorithms.magr): the l1-ball
projection and the proximal step by hand, the reduced maxima on a real layer's Hessian, the config field."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark_brevitas import ModelQuantizer
from quark_brevitas.algorithms.magr import magnitude_reduced, project_l1_ball
from quark_brevitas.config import Config, GPTQConfig, QLayerConfig, QTensorConfig
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import QSchemeType


def test_l1_ball_projection_by_hand() -> None:
    values = torch.tensor([[3.0, 1.0, 0.0], [1.0, -1.0, 1.0], [0.5, -0.5, 0.0]])
    radius = torch.tensor([[2.0], [1.5], [2.0]])
    # row 0: theta 1 -> [2, 0, 0]; row 1: theta 0.5 -> [0.5, -0.5, 0.5]; row 2 is inside the ball: unchanged
    assert project_l1_ball(values, radius).tolist() == [[2.0, 0.0, 0.0], [0.5, -0.5, 0.5], [0.5, -0.5, 0.0]]


def test_identity_hessian_gives_the_proximal_step_of_each_group() -> None:
    """With H = I the minimiser is the l-inf proximal step of w0 itself: each group's top values are lowered
    until an l1 mass of ``alpha`` is removed (``[3, 1, 0]``, alpha 2 -> ``[1, 1, 0]``)."""
    weight = torch.tensor([[3.0, 1.0, 0.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0, -1.0, 1.0]])
    reduced = magnitude_reduced(weight, torch.eye(6), alpha=2.0, group_size=3)
    # group [-2, 0.5, 0]: theta 0.25 -> projection [-1.75, 0.25, 0], so both lowered to 0.25; group [1, -1, 1]:
    # theta 1/3, each loses 2/3; the zero groups stay zero
    expected = torch.tensor([[1.0, 1.0, 0.0, -0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1 / 3, -1 / 3, 1 / 3]])
    torch.testing.assert_close(reduced, expected)


def test_group_maxima_shrink_while_the_output_barely_moves() -> None:
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(64, 64, generator=generator) * torch.logspace(0, -3, 64)  # a decaying input spectrum
    inputs = torch.randn(2048, 64, generator=generator) @ mixing
    hessian = inputs.T @ inputs / inputs.shape[0]
    weight = torch.randn(32, 64, generator=generator) * 0.05
    reduced = magnitude_reduced(weight, hessian, alpha=1e-2, group_size=16)
    before = weight.abs().reshape(32, 4, 16).amax(-1)
    after = reduced.abs().reshape(32, 4, 16).amax(-1)
    assert bool((after <= before + 1e-7).all()) and float(after.mean()) < 0.9 * float(before.mean())
    relative = (inputs @ (reduced - weight).T).norm() / (inputs @ weight.T).norm()
    assert float(relative) < 0.1  # the group maxima drop by over 10 %, the outputs by a few per cent


def test_magr_alpha_is_checked_and_serialised() -> None:
    layer = QLayerConfig(weight=QTensorConfig(bit_width=3, qscheme=QSchemeType.per_channel))
    for bad in (0.0, -1e-3):
        with pytest.raises(ConfigError, match=r"algo_config\[0\]\.magr_alpha.*> 0"):
            ModelQuantizer(Config(layer, algo_config=[GPTQConfig(magr_alpha=bad)]))
    config = Config(layer, algo_config=[GPTQConfig(magr_alpha=1e-3)])
    assert config.to_dict()["algo_config"][0]["magr_alpha"] == 1e-3
    assert Config.from_json(config.to_json()) == config
    assert "magr_alpha" not in Config(layer, algo_config=[GPTQConfig()]).to_dict()["algo_config"][0]


def test_gptq_rounds_the_magnitude_reduced_weight_on_a_finer_grid() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    data = [torch.randn(64, 32) @ torch.diag(torch.logspace(0, -2, 32)) for _ in range(4)]
    layer = QLayerConfig(weight=QTensorConfig(bit_width=3, qscheme=QSchemeType.per_channel))

    def first_layer_scale(algo: GPTQConfig) -> torch.Tensor:
        quant = ModelQuantizer(Config(layer, algo_config=[algo])).quantize_model(model, data)
        return [m for m in quant.modules() if hasattr(m, "quant_weight")][0].quant_weight().scale.detach()

    plain, magr = first_layer_scale(GPTQConfig()), first_layer_scale(GPTQConfig(magr_alpha=1e-2))
    assert bool((magr <= plain + 1e-7).all()) and float(magr.mean()) < float(plain.mean())
