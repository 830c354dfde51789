"""GPTQ's Hessian pass holds only the Hessians of the group it is for (issue 30: in a mixture-of-experts block the
first batch of every pass used to compute every expert's Hessians, about one block's weights, only to drop them)."""

from __future__ import annotations

import torch

from quark_brevitas.algorithms.gptq import HessianPass


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
