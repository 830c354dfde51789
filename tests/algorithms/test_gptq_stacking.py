"""GPTQConfig on stacked batches (issue 32): the same codes as batch by batch, bit for bit.

A block's cached batches after the first are stacked into a few calls
(:func:`~quark_brevitas.calibration.stacking.stacked_batches`); the Hessians are still summed one original batch
at a time, and the block engine's per-batch outputs pass is served from the stacked calls' rows by the layer
memo. The codes, scales and the quantized model's logits must be those of the batch-by-batch run.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import INT4_G32, UINT4_G32, VOCAB, tiny_llama  # noqa: E402

from quark_brevitas.algorithms import gptq  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402
from quark_brevitas.calibration import stacking  # noqa: E402
from quark_brevitas.calibration.data import BlockInputs, CalibrationData  # noqa: E402
from quark_brevitas.config import Config, GPTQConfig, QuantizationConfig  # noqa: E402


def _batches() -> list[torch.Tensor]:
    """Rows of uneven batch sizes, as a loader with a short last batch gives them."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (rows, 24), generator=generator) for rows in (2, 1, 3, 2, 1, 2)]


def _run(weight, algo) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.set_num_threads(1)
    config = Config(QuantizationConfig(weight=weight), algo_config=[algo], exclude=["lm_head"])
    model = ModelQuantizer(config).quantize_model(tiny_llama(2), _batches())
    codes = {}
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, QuantLayer) and name != "lm_head":
                quant = layer.quant_weight()
                codes[f"{name}.codes"], codes[f"{name}.scale"] = quant.int(), quant.scale.detach().clone()
        logits = model(_batches()[0]).logits
    return codes, logits


@pytest.mark.slow
@pytest.mark.parametrize(("weight", "algo"), [
    (UINT4_G32, GPTQConfig(group_size=32)),
    (INT4_G32, GPTQConfig(bit=4, sym=True, group_size=32, static_groups=True, desc_act=False)),
], ids=["uint4-dynamic-act-order", "int4-static"])
def test_stacked_batches_give_the_codes_of_batch_by_batch(monkeypatch, weight, algo) -> None:
    used = []
    original = stacking.stacked_batches

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        used.append(result is not None and any(len(p) > 1 for p in result.parts))
        return result

    monkeypatch.setattr(gptq, "stacked_batches", spy)
    stacked_codes, stacked_logits = _run(weight, algo)
    assert used and all(used), "the batches were not stacked"
    monkeypatch.setattr(stacking, "STACK_BYTES", 0)
    used.clear()
    plain_codes, plain_logits = _run(weight, algo)
    assert used and not any(used)
    assert stacked_codes.keys() == plain_codes.keys()
    for key, value in plain_codes.items():
        assert torch.equal(stacked_codes[key], value), key
    assert torch.equal(stacked_logits, plain_logits)


def _inputs(calls) -> BlockInputs:
    return BlockInputs.of(calls, CalibrationData([torch.zeros(1)]), "block")


def test_stacking_keeps_the_first_batch_alone_and_stacks_row_tensors() -> None:
    shared = torch.arange(5.0)  # not per row: passed once
    calls = [((torch.full((rows, 3, 4), float(i)),), {"mask": torch.full((rows, 3), float(i)), "positions": shared,
                                                      "flag": False})
             for i, rows in enumerate((1, 2, 1, 3))]
    result = stacking.stacked_batches(_inputs(calls), budget_bytes=2**20)
    assert result is not None and result.parts == [[1], [2, 1, 3]] and result.dims == 3
    (first_args, _), (args, kwargs) = list(result.data.loader)
    assert first_args[0] is calls[0][0][0]
    assert torch.equal(args[0], torch.cat([c[0][0] for c in calls[1:]]))
    assert torch.equal(kwargs["mask"], torch.cat([c[1]["mask"] for c in calls[1:]]))
    assert kwargs["positions"] is shared and kwargs["flag"] is False
    budget = 3 * 3 * 4 * 4  # three rows of hidden state per call at most
    assert stacking.stacked_batches(_inputs(calls), budget_bytes=budget).parts == [[1], [2, 1], [3]]
    assert stacking.stacked_batches(_inputs(calls), budget_bytes=4) is None  # every call would hold one batch


def test_batches_that_differ_otherwise_are_not_stacked() -> None:
    calls = [((torch.zeros(1, 3, 4),), {"positions": torch.arange(5.0) + i}) for i in range(4)]
    assert stacking.stacked_batches(_inputs(calls)) is None  # a per-batch value that is not per row
    calls = [((torch.zeros(1, 3, 4),), {"flag": i % 2 == 0}) for i in range(4)]
    assert stacking.stacked_batches(_inputs(calls)) is None
    assert stacking.stacked_batches(_inputs(calls[:2])) is None  # nothing to stack


@pytest.mark.slow
def test_an_mlp_reading_rows_that_are_not_the_batchs_falls_back_to_batch_by_batch(monkeypatch) -> None:
    """The MLP's layers read the hidden state flattened to tokens: once the passes have narrowed to the MLP (on
    inputs captured from the stacked calls), its Hessians cannot be split per batch, and the pass is run again
    on the MLP's inputs captured batch by batch, with the codes of the unstacked run."""
    from transformers.models.llama import modeling_llama

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.down_proj(self.act_fn(self.gate_proj(rows)) * self.up_proj(rows)).reshape(x.shape)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", flat)
    fallbacks = []
    original = gptq.GPTQConfigHandler._hessians

    def spy(*args, **kwargs):
        collected = original(*args, **kwargs)
        fallbacks.append(collected.unstackable and bool(args[1].unit.path))
        return collected

    monkeypatch.setattr(gptq.GPTQConfigHandler, "_hessians", staticmethod(spy))
    algo = GPTQConfig(group_size=32)
    stacked_codes, stacked_logits = _run(UINT4_G32, algo)
    assert any(fallbacks), "no narrowed pass fell back to batch by batch"
    monkeypatch.setattr(stacking, "STACK_BYTES", 0)
    plain_codes, plain_logits = _run(UINT4_G32, algo)
    for key, value in plain_codes.items():
        assert torch.equal(stacked_codes[key], value), key
    assert torch.equal(stacked_logits, plain_logits)
