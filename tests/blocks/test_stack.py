"""One block-stack finder (issue 28): what a run walks, what an algorithm searches, a named stack and a config's
obstacle are parameters of :func:`~quark_brevitas.blocks.stack.find_block_stack`, not other functions."""

from __future__ import annotations

import logging
import warnings

import pytest
from torch import nn

from quark_brevitas.blocks.stack import ANY_STACK, RUN_STACK, find_block_stack, resolve_block_stack
from quark_brevitas.errors import ModelError


class Stacked(nn.Module):
    """Not a Hugging Face model: its stack is found only at a path of the family table (``layers``)."""

    def __init__(self, count: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(count))


def test_the_search_policy_decides_what_is_found_without_a_name() -> None:
    model = Stacked()
    assert find_block_stack(model) == find_block_stack(model, policy=ANY_STACK) == "layers"
    assert find_block_stack(model, policy=RUN_STACK) is None  # a run walks only Hugging Face models unasked
    assert find_block_stack(model, False) is None
    with pytest.raises(ModelError, match="blocks=True but no stack"):
        find_block_stack(model, True, policy=RUN_STACK)


def test_a_named_stack_is_checked_and_the_algorithms_must_agree() -> None:
    model = Stacked()
    assert find_block_stack(model, "layers", policy=RUN_STACK) == "layers"
    assert find_block_stack(model, None, ["layers"], policy=RUN_STACK) == "layers"
    with pytest.raises(ModelError, match="'embed' is a Linear"):
        find_block_stack(model, "embed")
    with pytest.raises(ModelError, match="must agree"):
        find_block_stack(model, None, ["layers", "embed"])


def test_an_obstacle_declines_a_found_stack_and_refuses_a_named_one(caplog) -> None:
    model = Stacked()
    with caplog.at_level(logging.INFO, logger="quark_brevitas.blocks.stack"):
        assert find_block_stack(model, None, ["layers"], obstacle="X needs the whole model") is None
    assert "Calibrating the whole model at once: X needs the whole model" in caplog.text
    with pytest.raises(ModelError, match="blocks='layers': cannot calibrate block by block: X"):
        find_block_stack(model, "layers", obstacle="X needs the whole model")


def test_the_old_resolver_warns_and_is_the_finder_with_a_runs_policy() -> None:
    model = Stacked()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_block_stack(model, None, ["layers"]) == "layers"
        assert resolve_block_stack(model, None) is None
    assert any(issubclass(w.category, DeprecationWarning) and "policy=RUN_STACK" in str(w.message) for w in caught)
