"""The candidate-weight fast path (brevitas_adapter/candidate_grids.py) gives bit for bit what Brevitas's weight
quantizer gives when re-initialised from each candidate, and declines the quantizers it does not cover."""

from __future__ import annotations

import pytest
import torch

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.brevitas_adapter import candidate_quantizer, weight_grid
from quark_brevitas.types import QSchemeType


def _quantized_linear(weight: QTensorConfig, in_features: int, out_features: int = 48) -> torch.nn.Module:
    torch.manual_seed(in_features)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features))
    return dict(ModelQuantizer(Config(QLayerConfig(weight=weight))).quantize_model(model).named_modules())["0"]


def _candidates(shape: tuple[int, int], generator: torch.Generator) -> list[torch.Tensor]:
    """Random weights of several kinds: plain, heavy-tailed (AWQ's scaled weights), with all-zero and tiny groups
    (the scale floor), with ties at half steps (round half to even)."""
    plain = torch.randn(shape, generator=generator)
    tails = plain * torch.rand(shape[1], generator=generator).pow(-2)
    zeros = plain.clone()
    zeros[: shape[0] // 2] = 0
    tiny = plain * 1e-12
    steps = torch.randint(-16, 17, shape, generator=generator).float() / 4  # many exact half steps
    return [plain, tails, zeros, tiny, steps, -steps]


@pytest.mark.parametrize("bit_width", [2, 3, 4, 8])
@pytest.mark.parametrize(("group_size", "in_features"), [(32, 96), (64, 200), (128, 256), (128, 688)])
def test_fast_path_equals_brevitas_bit_for_bit(bit_width: int, group_size: int, in_features: int) -> None:
    layer = _quantized_linear(QTensorConfig(qscheme=QSchemeType.per_group, group_size=group_size,
                                            bit_width=bit_width, pad_groups=in_features % group_size != 0 or None),
                              in_features)
    quantize = candidate_quantizer(layer)
    assert quantize is not None, "the plain symmetric per-group quantizer is the one the fast path covers"
    generator = torch.Generator().manual_seed(bit_width * 1000 + in_features)
    for weight in _candidates(tuple(layer.weight.shape), generator):
        for scale in (1.0, 0.37, 123.0):
            candidate = weight * scale
            expected = weight_grid(layer, candidate).quantize(candidate)
            got = quantize(candidate)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            # bit for bit: equal values and equal signs of zeros
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_fast_path_leaves_the_quantizer_state_to_the_caller() -> None:
    """Quantizing candidates does not re-initialise the layer's grid (weight_grid does, from the final weight)."""
    layer = _quantized_linear(QTensorConfig(qscheme=QSchemeType.per_group, group_size=32, bit_width=4), 64)
    quantize = candidate_quantizer(layer)
    assert quantize is not None
    before = layer.quant_weight().value.clone()
    quantize(layer.weight.detach() * 7)
    assert torch.equal(layer.quant_weight().value, before)


@pytest.mark.parametrize("spec", [
    QTensorConfig(qscheme=QSchemeType.per_group, group_size=32, bit_width=4, symmetric=False),
    QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
    QTensorConfig(qscheme=QSchemeType.per_tensor, bit_width=8),
])
def test_other_quantizers_are_declined(spec: QTensorConfig) -> None:
    assert candidate_quantizer(_quantized_linear(spec, 64)) is None
