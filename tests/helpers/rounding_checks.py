"""What every learned-rounding algorithm of ``algo_config`` (QronosConfig, AutoRoundConfig) must do on the tiny
models of :mod:`helpers.llm_models`, one check each, so that their test modules ask it the same way.

References: round to nearest through the same Config without the algorithm, the float model's output, Brevitas's
own quantized weight (the grid), and the in-memory model for the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from helpers.llm_models import relative_error, tiny_llama, weight_only_config
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.brevitas_adapter import QuantLayer
from quark_brevitas.config import Config, QuantizationSpec


def block_layers(model: nn.Module) -> list[nn.Module]:
    """The quantized layers inside the model's blocks (``...layers.N...`` / ``...layer.N...``)."""
    return [m for n, m in model.named_modules() if isinstance(m, QuantLayer) and ".layer" in n]


def assert_beats_rounding_on_brevitas_grid(build: Callable[[], nn.Module], weight: QuantizationSpec, algo: object,
                                           batches: list[torch.Tensor]) -> None:
    """``algo`` on ``build()``'s model ends below 0.8 times round to nearest's output error, and every weight of
    the blocks lies on the grid of the layer's own quantizer (``lm_head`` of a Llama excluded, as Quark does)."""
    model = build()
    exclude = ("lm_head",) if build is tiny_llama else ()
    quantized = ModelQuantizer(weight_only_config(weight, algo, exclude)).quantize_model(model, batches)
    rounded = ModelQuantizer(weight_only_config(weight, exclude=exclude)).quantize_model(model, batches)
    assert relative_error(quantized, model, batches) < 0.8 * relative_error(rounded, model, batches)
    layers = block_layers(quantized)
    assert layers
    for layer in layers:
        assert torch.equal(layer.quant_weight().value, layer.weight)  # the codes are Brevitas's, bit for bit


def assert_block_and_whole_model_paths_agree(config: Config, batches: list[torch.Tensor]) -> None:
    """Block by block (the default) and on the whole model at once (``blocks=False``): the same weights."""
    blocks = ModelQuantizer(config).quantize_model(tiny_llama(), batches)
    whole = ModelQuantizer(config).quantize_model(tiny_llama(), batches, blocks=False)
    for (name, a), b in zip(blocks.named_parameters(), whole.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def assert_survives_a_checkpoint(config: Config, batches: list[torch.Tensor], folder: Path) -> None:
    """``save_quantized`` into ``folder`` and ``load_quantized`` onto a fresh float model: the same logits."""
    from quark_brevitas import load_quantized, save_quantized

    quantized = ModelQuantizer(config).quantize_model(tiny_llama(), batches)
    save_quantized(quantized, folder)
    loaded = load_quantized(tiny_llama(), folder)
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]).logits, quantized(batches[0]).logits)
