"""benchmarks/roofline.py: the floor's arithmetic, counted by hand for one Llama block (issue 32)."""

from __future__ import annotations

import pytest

from benchmarks import roofline

BLOCK = roofline.Block(width=256, intermediate=768, tokens=8192, sequence=128)
PARAMETERS = 4 * 256 * 256 + 3 * 256 * 768  # q, k, v, o; gate, up, down
FORWARD = 2 * 8192 * PARAMETERS + 4 * 8192 * 128 * 256  # Linear layers, then Q K^T and P V
HESSIANS = 3 * 2 * 8192 * 256 ** 2 + 2 * 8192 * 768 ** 2  # q/k/v, o, gate/up share 256-wide inputs; down 768
UPDATES = sum(2 * o * d * d + d ** 3 / 3 for d, o in [(256, 256)] * 4 + [(256, 768)] * 2 + [(768, 256)])


def test_gptq_floor_is_two_forwards_hessians_and_updates_per_block() -> None:
    assert roofline.flops("gptq", BLOCK, 4) == pytest.approx(4 * (2 * FORWARD + HESSIANS + UPDATES))
    assert 160e9 < roofline.flops("gptq", BLOCK, 4) < 180e9  # the "about 165 GFLOP" for 4 blocks


def test_other_floors() -> None:
    assert roofline.flops("qronos", BLOCK, 1) == pytest.approx(2 * FORWARD + 2 * HESSIANS + UPDATES)
    assert roofline.flops("smoothquant", BLOCK, 2) == pytest.approx(2 * 2 * FORWARD)
    assert roofline.flops("awq", BLOCK, 1) == pytest.approx(2 * FORWARD + 20 * 2 * 8192 * PARAMETERS)
    with pytest.raises(KeyError, match="no floor"):
        roofline.floor_parts("unknown", BLOCK, 1, roofline.GemmRate())


def test_gemm_rate_is_positive_and_cached() -> None:
    rate = roofline.GemmRate(repeats=1)
    first = rate(64, 32, 16)
    assert first > 0 and rate(64, 32, 16) == first and list(rate.rates) == [(64, 32, 16)]
