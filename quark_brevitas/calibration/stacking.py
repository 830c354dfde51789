"""A block's cached batches stacked into fewer, larger forward calls (issue 32).

Block-by-block GPTQ runs a block four times over its cached inputs (one pass per group of layers). With
batches of one row (a usual way to feed a Llama 128-token rows), each call is mostly Python and module overhead:
the block's arithmetic on one row is a few hundred microseconds, its Python a few milliseconds. Stacking the
batches along the batch dimension makes one call of many rows instead.

The results must stay those of the batches run one by one, bit for bit, which holds when the block treats rows
independently and its kernels give a row the same values whatever the rows beside it (Linear layers, norms,
attention and element-wise functions on the CPU do; ``tests/algorithms/test_gptq_stacking.py`` checks a
Llama block's codes both ways). Statistics summed per batch (GPTQ's Hessians) are still summed per original
batch, in the same order: :func:`stacked_batches` says which rows came from which batch.

Stacking is conservative: the first batch stays alone (an algorithm learns the block's call structure from it,
running the whole block once), every batch's first positional argument is the hidden state (a tensor whose first
dimension counts its rows), and every other tensor either has as many rows as its batch (it is stacked too: an
attention mask, rotary embeddings) or is equal in every batch (it is passed once); any other value must be equal in
every batch. Otherwise nothing is stacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from quark_brevitas.calibration.data import BlockInputs, CalibrationData

__all__ = ["STACK_BYTES", "Stacked", "rows_first", "split_rows", "stacked_batches"]

#: At most this many bytes of stacked hidden state per call; 0 turns stacking off. Small on purpose: a call's
#: intermediate tensors (a few times larger) then stay in the CPU's caches. On the 4-block Llama of issue 32 (64
#: rows of 128 tokens, 256 wide) 2 MiB (16 rows) took 4.2 s against 5.1 s unstacked, 4.7 s with 32 MiB (all rows).
STACK_BYTES = 2 * 2**20


class Stacked(NamedTuple):
    """Stacked calibration data: ``data``'s batches are the first original batch, then stacks of the others;
    ``parts[i]`` lists the rows of the original batches in batch ``i`` (in order); ``dims`` is the number of
    dimensions of the hidden state."""

    data: CalibrationData
    parts: list[list[int]]
    dims: int


def rows_first(value: Any, rows: int, dims: int) -> bool:
    """Whether ``value`` is a tensor of ``dims`` dimensions with ``rows`` rows first: what a layer of a stacked
    call must read (or a block return) for its batches' parts to be cut apart again."""
    return isinstance(value, torch.Tensor) and value.dim() == dims and value.shape[0] == rows


def split_rows(rows: torch.Tensor, raw: Any, parts: Sequence[int], dims: int) -> list[torch.Tensor] | None:
    """A layer input of a stacked call, flattened to ``rows`` (tokens x features) from ``raw``, cut into its
    original batches' pieces (``parts``: their rows, in order; one part: ``[rows]`` as it is). ``None`` when
    ``raw`` does not have the call's rows first (``dims`` dimensions): a layer fed other rows (routed tokens)."""
    if len(parts) == 1:
        return [rows]
    total = sum(parts)
    if not rows_first(raw, total, dims):
        return None
    per_row = rows.shape[0] // total
    return list(rows.split([part * per_row for part in parts]))


class _Unstackable(Exception):
    """The batches differ in a way stacking cannot keep."""


def _same(values: Sequence[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and (v is first or (v.shape == first.shape and v.dtype == first.dtype
                                                                    and torch.equal(v, first))) for v in values)
    return all(v is first or (type(v) is type(first) and v == first) for v in values)


def _stack(values: Sequence[Any], rows: Sequence[int]) -> Any:
    """One value standing for ``values`` (the same leaf of each batch) in the stacked call."""
    first = values[0]
    if isinstance(first, tuple | list):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise _Unstackable
        return type(first)(_stack([v[i] for v in values], rows) for i in range(len(first)))
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise _Unstackable
        return {key: _stack([v[key] for v in values], rows) for key in first}
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == r and v.shape[1:] == first.shape[1:]
               and v.dtype == first.dtype for v, r in zip(values, rows)):
            return torch.cat(list(values))
        if _same(values):
            return first
        raise _Unstackable
    if _same(values):
        return first
    raise _Unstackable


def stacked_batches(data: CalibrationData, budget_bytes: int | None = None, *,
                    first_alone: bool = True) -> Stacked | None:
    """``data`` (a block's cached inputs) with its batches after the first stacked into calls of at most
    ``budget_bytes`` of hidden state (default :data:`STACK_BYTES`), or ``None`` when nothing would be stacked or
    the batches cannot be (see the module docstring). ``first_alone=False``: the first batch is stacked too (for
    an algorithm that does not learn the block's call structure from it)."""
    budget = STACK_BYTES if budget_bytes is None else budget_bytes
    # Exactly the block engine's cached inputs: a subclass may do more per pass than run its batches.
    if type(data) is not BlockInputs or len(data) < 3 or budget <= 0:
        return None
    calls = list(data.loader)
    hidden = [args[0] if args else None for args, _ in calls]
    if not all(isinstance(h, torch.Tensor) and h.dim() >= 2 for h in hidden):
        return None
    groups: list[list[int]] = [[0]]
    size = 0 if first_alone else hidden[0].numel() * hidden[0].element_size()
    for position in range(1, len(calls)):
        nbytes = hidden[position].numel() * hidden[position].element_size()
        if (position == 1 and first_alone) or size + nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(position)
        size += nbytes
    if all(len(group) == 1 for group in groups):
        return None
    stacked: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    parts: list[list[int]] = []
    try:
        for group in groups:
            rows = [int(hidden[p].shape[0]) for p in group]
            if len(group) == 1:
                stacked.append(calls[group[0]])
            else:
                args = _stack([calls[p][0] for p in group], rows)
                kwargs = _stack([calls[p][1] for p in group], rows)
                stacked.append((args, kwargs))
            parts.append(rows)
    except _Unstackable:
        return None
    return Stacked(BlockInputs.of(stacked, data.parent, data.label), parts, hidden[0].dim())
