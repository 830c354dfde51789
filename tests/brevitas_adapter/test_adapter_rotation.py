"""Canary for :mod:`quark_brevitas.brevitas_adapter.rotation`: Brevitas's Hadamard blocks (``get_hadK``)."""

from __future__ import annotations

import pytest
import torch
from brevitas.graph import hadamard

from quark_brevitas.brevitas_adapter import hadamard_supported, rotation_matrix


@pytest.mark.parametrize("k", [12, 20, 28, 36, 40, 52, 60, 108, 140, 172])
def test_brevitas_ships_the_hadamard_blocks_rotations_are_built_from(k: int) -> None:
    block, size = hadamard.get_hadK(k)
    assert size == k, "brevitas.graph.hadamard.get_hadK no longer returns (block, K) for a size K it ships"
    assert torch.equal(block.abs(), torch.ones(k, k)), "Brevitas's Hadamard block is no longer +-1"
    assert torch.allclose(block @ block.T, k * torch.eye(k)), "Brevitas's block is no longer a Hadamard matrix"


def test_sizes_without_a_block_are_reported_not_asserted() -> None:
    assert hadamard_supported(96) and hadamard_supported(4096) and not hadamard_supported(88)
    with pytest.raises(ValueError, match="no Hadamard matrix of size 88"):
        rotation_matrix(88)
