"""AWQConfig on stacked batches (issue 32): the same weights, codes and scales as batch by batch, bit for bit.

The statistics pass runs on a block's stacked calls (:mod:`quark_brevitas.algorithms.awq_stacking`), so the scale
search runs each inspected module on a few large calls per ratio instead of one call per batch. The channel
statistics, the clip search's token sample, the Gram matrices and the error sums are still taken per original
batch, in the original order: the result must be the batch-by-batch run's. A block whose layers read rows that
are not the call's falls back to the batch-by-batch pass.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import UINT4_G32, VOCAB, llm_config, tiny_llama  # noqa: E402

from quark_brevitas.algorithms import awq, awq_stacking  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402
from quark_brevitas.calibration import stacking  # noqa: E402
from quark_brevitas.config import AWQConfig  # noqa: E402


def _batches() -> list[torch.Tensor]:
    """Rows of uneven batch sizes, as a loader with a short last batch gives them."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (rows, 24), generator=generator) for rows in (2, 1, 3, 2, 1, 2)]


def _run() -> dict[str, torch.Tensor]:
    """Every block parameter (AWQ folds its scales into them), and each quantized layer's codes and scales."""
    torch.set_num_threads(1)
    model = ModelQuantizer(llm_config(UINT4_G32, [AWQConfig(group_size=32)])).quantize_model(tiny_llama(2),
                                                                                               _batches())
    out = {name: p.detach().clone() for name, p in model.named_parameters() if "layers" in name}
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, QuantLayer) and "layers" in name:
                quant = layer.quant_weight()
                out[f"{name}.codes"], out[f"{name}.scale"] = quant.int(), quant.scale.detach().clone()
    return out


def _spy_trackers(monkeypatch: pytest.MonkeyPatch) -> list[awq_stacking.BatchTracker]:
    """The trackers of the statistics passes that finished (stacked or not)."""
    finished = []
    original = awq_stacking.BatchTracker.layouts

    def spy(self):
        result = original(self)
        finished.append(self)
        return result

    monkeypatch.setattr(awq_stacking.BatchTracker, "layouts", spy)
    return finished


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys() and any(k.endswith(".codes") for k in got)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow
def test_stacked_batches_give_the_weights_and_codes_of_batch_by_batch(monkeypatch) -> None:
    finished = _spy_trackers(monkeypatch)
    stacked = _run()
    assert len(finished) == 2 and all(t.stacked is not None for t in finished), "the batches were not stacked"
    layouts = finished[0].layouts()
    assert any(layout.stacked for layout in layouts.values())
    finished.clear()
    monkeypatch.setattr(stacking, "STACK_BYTES", 0)
    plain = _run()
    assert len(finished) == 2 and all(t.stacked is None for t in finished)
    _assert_same(stacked, plain)


@pytest.mark.slow
def test_an_mlp_reading_rows_that_are_not_the_calls_falls_back_to_batch_by_batch(monkeypatch) -> None:
    """The MLP's layers read the hidden state flattened to tokens: their rows cannot be split per batch, so the
    statistics pass runs again unstacked, with the weights of the unstacked run."""
    from transformers.models.llama import modeling_llama

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.down_proj(self.act_fn(self.gate_proj(rows)) * self.up_proj(rows)).reshape(x.shape)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", flat)
    finished = _spy_trackers(monkeypatch)
    fallen_back = _run()
    assert len(finished) == 2 and all(t.stacked is None for t in finished), "no pass fell back"
    monkeypatch.setattr(stacking, "STACK_BYTES", 0)
    _assert_same(fallen_back, _run())


class _Recorded:
    """A stand-in for a CallRecorder: each call's hidden state and output."""

    def __init__(self, rows: list[int]) -> None:
        self.calls = {"m": [((torch.zeros(r, 2, 3),), {}) for r in rows]}
        self.outputs = {"m": [torch.zeros(r, 2, 3) for r in rows]}


def test_the_layout_gives_the_original_calls_order_for_a_module_called_twice_per_batch() -> None:
    """Stacked calls: batch 0 alone, then batches 1-2 (2 and 1 rows); the module is called twice per call.
    The original order is batch by batch, and within a batch the module's calls in order."""
    data = stacking.Stacked(data=None, parts=[[1], [2, 1]], dims=3)
    tracker = awq_stacking.BatchTracker(data)
    tracker.recorder = _Recorded([1, 1, 3, 3])
    tracker.starts = {"m": [0, 2, 4]}
    layout = tracker.layouts()["m"]
    assert layout.parts == [[1], [1], [2, 1], [2, 1]]
    # (call, part): batch 0's two calls, batch 1's (part 0 of calls 2 and 3), batch 2's (part 1)
    assert layout.order == [(0, 0), (1, 0), (2, 0), (3, 0), (2, 1), (3, 1)]
    pieces = [layout.split(c, torch.arange(float(sum(p))).mul(10 ** c)) for c, p in enumerate(layout.parts)]
    assert [piece.tolist() for piece in layout.in_order(pieces)] == [[0.0], [0.0], [0.0, 100.0], [0.0, 1000.0],
                                                                     [200.0], [2000.0]]


def test_a_stacked_call_whose_output_has_other_rows_cannot_be_laid_out() -> None:
    tracker = awq_stacking.BatchTracker(stacking.Stacked(data=None, parts=[[1], [2, 1]], dims=3))
    tracker.recorder = _Recorded([1, 3])
    tracker.recorder.outputs["m"][1] = torch.zeros(6, 3)  # rows flattened to tokens
    tracker.starts = {"m": [0, 1, 2]}
    with pytest.raises(awq_stacking.NotPerRow):
        tracker.layouts()


def test_gram_matrix_from_stacked_calls_sums_the_original_calls_in_order() -> None:
    """_LinearError.of on stacked calls adds each original call's product in the original order: the very same
    float64 Gram matrix as from the unstacked calls. A module called twice per batch, stacked as (first calls,
    second calls): summed in the stacked calls' order, the Gram matrix differs in its last bits (checked here too,
    so the test can tell the two orders apart)."""
    torch.manual_seed(0)
    b0c0, b0c1, b1c0, b1c1 = (torch.randn(r, 16, 8) * s for r, s in ((2, 1.0), (2, 1e3), (3, 1e-3), (3, 1.0)))
    weight = torch.randn(4, 8)
    plain = awq._LinearError.of([((x,), {}) for x in (b0c0, b0c1, b1c0, b1c1)], weight)
    calls = [((torch.cat([b0c0, b1c0]),), {}), ((torch.cat([b0c1, b1c1]),), {})]
    layout = awq_stacking.CallLayout([[2, 3], [2, 3]], [(0, 0), (1, 0), (0, 1), (1, 1)])
    stacked = awq._LinearError.of(calls, weight, layout)
    assert stacked.tokens == plain.tokens == 10 * 16
    assert torch.equal(stacked.gram, plain.gram)
    assert not torch.equal(awq._LinearError.of(calls, weight).gram, plain.gram)  # the stacked calls' order


def test_the_first_batch_is_stacked_too_when_asked() -> None:
    from quark_brevitas.calibration.data import BlockInputs, CalibrationData

    calls = [((torch.zeros(rows, 4, 8),), {"mask": torch.ones(rows, 4)}) for rows in (1, 2, 1, 3)]
    data = BlockInputs.of(calls, CalibrationData([0]), "block")
    budget = 4 * 4 * 8 * 4  # four rows of hidden state
    assert stacking.stacked_batches(data, budget_bytes=budget).parts == [[1], [2, 1], [3]]
    together = stacking.stacked_batches(data, budget_bytes=budget, first_alone=False)
    assert together.parts == [[1, 2, 1], [3]]
    args, kwargs = together.data.loader[0]
    assert args[0].shape == (4, 4, 8) and kwargs["mask"].shape == (4, 4)
