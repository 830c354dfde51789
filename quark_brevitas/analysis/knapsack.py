"""The 0/1 multiple-choice knapsack behind automatic mixed precision: one candidate per layer, summed noise
minimised under a summed cost, solved by dynamic programming over cost steps (numpy only, no model)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["knapsack", "knapsack_steps"]


def knapsack(costs: np.ndarray, noise: np.ndarray, capacity: float, forced: Mapping[int, int],
              resolution: int) -> list[int] | None:
    """Costs are rounded to steps of ``capacity / resolution``; an optimum whose exact cost exceeds the capacity
    (rounding) is solved again with the capacity lowered by the excess, so the result always fits exactly."""
    if capacity <= 0:
        return None
    rows = np.arange(costs.shape[0])
    limit = capacity
    for _ in range(8):
        assignment = knapsack_steps(costs, noise, limit, capacity / resolution, forced)
        if assignment is None:
            return None
        excess = float(costs[rows, assignment].sum()) - capacity
        if excess <= 0:
            return assignment
        limit -= excess + capacity / resolution
    return None


def knapsack_steps(costs: np.ndarray, noise: np.ndarray, limit: float, step: float,
                    forced: Mapping[int, int]) -> list[int] | None:
    layers, choices = costs.shape
    slots = int(limit / step)
    if slots < 0:
        return None
    units = np.rint(costs / step).astype(np.int64)
    # Among choices of equal noise, the cheaper one (a tie-break far below any measured difference).
    value = noise + costs * (1e-12 / max(float(costs.max()), 1.0))
    best = np.full(slots + 1, np.inf)
    best[0] = 0.0
    picked = np.full((layers, slots + 1), -1, dtype=np.int32)
    for i in range(layers):
        new = np.full(slots + 1, np.inf)
        for c in range(choices):
            if (i in forced and forced[i] != c) or units[i, c] > slots:
                continue
            shift = units[i, c]
            candidate = np.full(slots + 1, np.inf)
            candidate[shift:] = best[:slots + 1 - shift] + value[i, c]
            better = candidate < new
            new[better] = candidate[better]
            picked[i, better] = c
        best = new
    end = int(np.argmin(best))
    if not np.isfinite(best[end]):
        return None
    assignment = [0] * layers
    for i in range(layers - 1, -1, -1):
        c = int(picked[i, end])
        assignment[i] = c
        end -= int(units[i, c])
    return assignment
