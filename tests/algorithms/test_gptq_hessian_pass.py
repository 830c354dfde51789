"""GPTQ's Hessian pass holds only the Hessians of the group it is for (issue 30: in a mixture-of-experts block the
first batch of every pass used to compute every expert's Hessians, about one block's weights, only to drop them)."""

from __future__ import annotations

import pytest
import torch

from quark_brevitas.algorithms.gptq import HessianPass
from quark_brevitas.brevitas_adapter import StopFwdException


def test_a_sequential_pass_computes_only_its_groups_hessians_on_the_first_batch() -> None:
    shared, other = torch.randn(5, 4), torch.randn(3, 8)
    collected = HessianPass(sequential=True)
    collected.add("q_proj", shared, shared)
    collected.add("k_proj", shared, shared)
    collected.add("experts.0.gate_proj", other, other)  # reads another input: not this pass's group
    collected.add("q_proj", shared, shared)  # a group layer called again in the batch still accumulates
    assert sorted(collected.hessians) == ["k_proj", "q_proj"]
    torch.testing.assert_close(collected.hessians["q_proj"], 2 * shared.t() @ shared)
    collected.batch_done(0, None)
    assert collected.group == ["q_proj", "k_proj"]
    assert collected.calls_per_batch == {"q_proj": 2, "k_proj": 1}
    assert collected.counts == {"q_proj": 10, "k_proj": 5}


def test_a_pass_over_all_layers_still_computes_every_hessian() -> None:
    first, other = torch.randn(5, 4), torch.randn(3, 8)
    collected = HessianPass(sequential=False)
    collected.add("q_proj", first, first)
    collected.add("down_proj", other, other)
    collected.batch_done(0, None)
    assert collected.group == ["q_proj", "down_proj"] and sorted(collected.hessians) == ["down_proj", "q_proj"]


def test_taken_hands_layers_sharing_one_sum_the_same_average_and_holds_nothing_after() -> None:
    from quark_brevitas.calibration.data import CalibrationData

    data = CalibrationData([])  # one process: all_reduce leaves the sums as they are
    shared, later = torch.randn(5, 4), torch.randn(5, 4)
    collected = HessianPass(sequential=True)
    for name in ("q_proj", "k_proj", "v_proj"):  # one call each, of one input: the sums are one (aliases)
        collected.add(name, shared, shared)
    collected.batch_done(0, None)
    with pytest.raises(StopFwdException):
        collected.add("q_proj", later, later)
    samples, first = collected.taken(data, "q_proj")
    assert samples == 10 and collected.hessians == {}  # the sum, averaged, is not held any longer
    torch.testing.assert_close(first, (shared.t() @ shared + later.t() @ later) / 10)
    assert collected.taken(data, "k_proj")[1] is first and collected.averages  # v_proj still to take it
    assert collected.taken(data, "v_proj")[1] is first and not collected.averages


@pytest.mark.slow
def test_gptq_factors_each_shared_hessian_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers reading one input (q/k/v, gate/up) share one Hessian object and its factor (issue 32), also now
    that GPTQ drops each Hessian sum once averaged (issue 30)."""
    pytest.importorskip("transformers")
    from helpers.llm_models import INT4_G32, llm_config, tiny_llama, token_batches

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.algorithms import gptq
    from quark_brevitas.config.algorithms import GPTQConfig

    factored: list[int] = []
    original = gptq.inverse_hessian_factor

    def counting(hessian: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        factored.append(hessian.shape[0])
        return original(hessian, *args, **kwargs)

    monkeypatch.setattr(gptq, "inverse_hessian_factor", counting)
    config = llm_config(INT4_G32, GPTQConfig(bit=4, sym=True, group_size=32, desc_act=False))
    ModelQuantizer(config).quantize_model(tiny_llama(1), token_batches())
    # One block: q/k/v (one factor), o_proj, gate/up (one factor), down_proj; not one per layer (7).
    assert factored == [64, 64, 64, 128]
