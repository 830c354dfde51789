"""The integer codes and scales of the LLM algorithms on a small model, against a stored snapshot (issue 20).

The snapshot (``tests/data/llm_codes.pt``) was written by this file before the algorithms were made faster
(``PYTHONPATH=. python tests/algorithms/test_llm_codes_snapshot.py`` from the repository root), so it records what they
computed before: speed-ups must not change a single code. Each recipe (``tests/helpers/llm_recipes.py``)
quantizes the tiny 2-block Llama of :mod:`llm_models` (seeded, with outlier channels) on four batches of 4 x 32
tokens, one thread, and every quantized layer's weight codes (``quant_weight().int()``) and per-group scales are
compared exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.llm_models import tiny_llama, token_batches  # noqa: E402
from helpers.llm_recipes import RECIPES  # noqa: E402

from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "llm_codes.pt"


def quantized_codes(recipe: str) -> dict[str, torch.Tensor]:
    """``{layer.codes, layer.scale}`` of every quantized layer after ``recipe`` (scales once per group)."""
    torch.set_num_threads(1)
    model = ModelQuantizer(RECIPES[recipe]()).quantize_model(tiny_llama(2), token_batches())
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, QuantLayer) or getattr(layer, "weight_quant", None) is None:
                continue
            weight = layer.quant_weight()
            scale = weight.scale.detach().float()
            if scale.shape == weight.value.shape:  # groupwise, expanded: one value per group
                scale = scale.reshape(scale.shape[0], -1, 32)[..., 0]
            out[f"{name}.codes"] = weight.int().to(torch.int16)
            out[f"{name}.scale"] = scale.clone()
    return out


def _pack(codes: torch.Tensor) -> tuple[int, torch.Tensor] | torch.Tensor:
    """4-bit codes two to a byte, so that the snapshot stays small: ``(offset, bytes)`` with the codes shifted
    by ``offset`` into 0..15; 8-bit codes as int8/uint8, wider ones as int16."""
    offset = 8 if codes.min() < 0 else 0
    if codes.min() + offset < 0 or codes.max() + offset > 15 or codes.shape[-1] % 2:
        for dtype in (torch.int8, torch.uint8):
            if torch.iinfo(dtype).min <= codes.min() and codes.max() <= torch.iinfo(dtype).max:
                return codes.to(dtype)
        return codes.to(torch.int16)
    flat = (codes + offset).to(torch.uint8).flatten()
    return offset, (flat[0::2] | (flat[1::2] << 4)).reshape(codes.shape[0], -1)


def _unpack(stored: tuple[int, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    if isinstance(stored, torch.Tensor):
        return stored.to(torch.int16)
    offset, packed = stored
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return pairs.reshape(packed.shape[0], -1).to(torch.int16) - offset


@pytest.fixture(scope="module")
def snapshot() -> dict[str, dict[str, torch.Tensor]]:
    stored = torch.load(SNAPSHOT)
    return {recipe: {k: _unpack(v) if k.endswith(".codes") else v for k, v in codes.items()}
            for recipe, codes in stored.items()}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_codes_and_scales_equal_the_snapshot(recipe: str, snapshot: dict[str, dict[str, torch.Tensor]]) -> None:
    expected = snapshot[recipe]
    got = quantized_codes(recipe)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), \
            f"{recipe}: {key} differs in {int((got[key] != value).sum())} of {value.numel()} entries"


if __name__ == "__main__":  # regenerate the snapshot (only when the numerics are meant to change)
    snapshots = {}
    for name in RECIPES:
        codes = quantized_codes(name)
        snapshots[name] = {k: _pack(v) if k.endswith(".codes") else v for k, v in codes.items()}
    SNAPSHOT.parent.mkdir(exist_ok=True)
    torch.save(snapshots, SNAPSHOT)
    print(f"wrote {SNAPSHOT} ({SNAPSHOT.stat().st_size // 1024} KB)")
