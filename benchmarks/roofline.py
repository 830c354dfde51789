"""The arithmetic floor of block-by-block LLM quantization on this machine, one thread.

A floor is the essential arithmetic of an algorithm (the matrix products it cannot avoid, counted in flops) divided
by this machine's measured single-thread float32 matrix-multiply rate *at the shapes involved*. Everything else an
implementation spends (Python, copies, quantizer calls, extra passes) is above it, so ``measured / floor`` says how
far a tool is from what the hardware allows. Counted, for a Llama block of ``P`` Linear parameters, ``T`` calibration
tokens and the Linear layers' input widths ``d`` (layers sharing an input count once):

* ``forward``: one pass of the block's Linear layers over the tokens, ``2 T P``, plus attention's two score
  products ``4 T s w`` (``s`` tokens per row, ``w`` wide). GPTQ, AWQ, Qronos and SmoothQuant need two per block
  (statistics from the block's inputs, then the block's quantized outputs for the next block); AutoRound adds its
  training steps (forward and backward, 3 forwards each, on ``batch x s`` tokens).
* ``hessian``: ``2 T d^2`` per distinct Linear input (GPTQ's ``X^T X``); Qronos twice (it also needs the product of
  the float and the quantized inputs).
* ``update``: GPTQ's column sweep, ``2 o d^2`` per layer (``o`` outputs), and the Cholesky factorisation ``d^3 / 3``.
* ``search``: AWQ's scale search, ``grid`` (20) evaluations of each scaled group's Linear layers on the tokens.

The rate is the best of a few timed products per shape (CPU time, so a loaded machine slows it less than the wall
clock); each part of the floor is divided by the rate of its own shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """The Linear layers of one Llama block and the data it is calibrated on."""

    width: int
    intermediate: int
    tokens: int
    sequence: int

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, inputs, outputs) of each Linear layer."""
        w, i = self.width, self.intermediate
        return [("q", w, w), ("k", w, w), ("v", w, w), ("o", w, w), ("gate", w, i), ("up", w, i), ("down", i, w)]

    def distinct_inputs(self) -> list[int]:
        """Input widths of the Linear layers, one per shared input (q/k/v share one, gate/up another)."""
        return [self.width, self.width, self.width, self.intermediate]


class GemmRate:
    """Single-thread float32 matrix-multiply rate (flop/s) at given shapes, measured once per shape."""

    def __init__(self, repeats: int = 5) -> None:
        self.repeats = repeats
        self.rates: dict[tuple[int, int, int], float] = {}

    def __call__(self, m: int, k: int, n: int) -> float:
        """Rate of an ``(m, k) @ (k, n)`` product: the best of ``repeats`` timings, CPU seconds."""
        key = (m, k, n)
        if key not in self.rates:
            generator = torch.Generator().manual_seed(0)
            a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
            out = torch.empty(m, n)
            torch.mm(a, b, out=out)  # warm-up
            best = float("inf")
            for _ in range(self.repeats):
                start = time.process_time()
                torch.mm(a, b, out=out)
                best = min(best, time.process_time() - start)
            self.rates[key] = 2 * m * k * n / max(best, 1e-6)
        return self.rates[key]


def _linear_seconds(block: Block, rate: GemmRate, tokens: int) -> float:
    return sum(2 * tokens * d * o / rate(tokens, d, o) for _, d, o in block.linears())


def _forward_seconds(block: Block, rate: GemmRate, tokens: int) -> float:
    # attention: Q K^T and P V, per row of ``sequence`` tokens (timed at one row's shape, all heads together)
    attention = 4 * tokens * block.sequence * block.width
    return _linear_seconds(block, rate, tokens) + attention / rate(block.sequence, block.width, block.sequence)


def _hessian_seconds(block: Block, rate: GemmRate) -> float:
    return sum(2 * block.tokens * d * d / rate(d, block.tokens, d) for d in block.distinct_inputs())


def _update_seconds(block: Block, rate: GemmRate) -> float:
    return sum((2 * o * d * d + d ** 3 / 3) / rate(o, d, d) for _, d, o in block.linears())


def floor_parts(recipe: str, block: Block, blocks: int, rate: GemmRate, *, grid: int = 20, iters: int = 200,
                batch_rows: int = 8) -> dict[str, float]:
    """Seconds of each part of ``recipe``'s floor for ``blocks`` blocks (see the module docstring)."""
    forward = 2 * _forward_seconds(block, rate, block.tokens)
    parts = {"forward": forward}
    if recipe in ("gptq", "qronos"):
        parts["hessian"] = _hessian_seconds(block, rate) * (2 if recipe == "qronos" else 1)
        parts["update"] = _update_seconds(block, rate)
    elif recipe == "awq":
        parts["search"] = grid * _linear_seconds(block, rate, block.tokens)
    elif recipe == "autoround":
        parts["train"] = iters * 3 * _forward_seconds(block, rate, batch_rows * block.sequence)
    elif recipe != "smoothquant":
        raise KeyError(f"no floor for recipe {recipe!r}")
    return {name: seconds * blocks for name, seconds in parts.items()}


def floor_seconds(recipe: str, block: Block, blocks: int, rate: GemmRate) -> float:
    return sum(floor_parts(recipe, block, blocks, rate).values())


def flops(recipe: str, block: Block, blocks: int) -> float:
    """The floor's arithmetic in flops (for the table), at a rate of 1 flop/s."""

    class _Unit(GemmRate):
        def __call__(self, m: int, k: int, n: int) -> float:
            return 1.0

    return floor_seconds(recipe, block, blocks, _Unit())
