"""AWQ's statistics pass on stacked batches, and where each original call's rows sit in the stacked calls.

AWQ's scale search runs each group's inspected module (``self_attn``, ``mlp``) on every call recorded during the
statistics pass, once per ratio candidate. With batches of one row (a usual way to feed a Llama 128-token rows),
that is twenty times the block's calls per group, each mostly Python and module overhead. When the block's cached
batches can be stacked (:func:`~quark_brevitas.calibration.stacking.stacked_batches`), the statistics pass runs on
the stacked calls instead, so the recorded calls, and every candidate's forwards, are a few large ones.

The choices must stay those of the batches run one by one, bit for bit: everything AWQ sums over the calls is
still summed per original batch, in the original order. The hooks split a stacked call's rows per original batch
before the channel statistics and the clip search's token sample see them (:func:`split_per_batch`), and each
inspected module's calls carry a :class:`CallLayout` that gives the error sums, and the Gram matrices of a layer
judged alone, back in the order of the original calls. This holds as long as the block's kernels give a row the
same values whatever the rows beside it (the stacking module's assumption, checked by the codes snapshot). A
layer or inspected module called with rows that are not the call's (tokens routed to an expert) cannot be split
per batch: the pass then runs again unstacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from quark_brevitas.algorithms.scaling import Consumer
from quark_brevitas.blocks.capture import CallRecorder
from quark_brevitas.calibration.data import CalibrationDataError
from quark_brevitas.calibration.stacking import Stacked, rows_first, split_rows

__all__ = ["BatchTracker", "CallLayout", "NotPerRow", "not_per_row", "split_per_batch"]

T = TypeVar("T")


class NotPerRow(Exception):
    """A layer of a stacked call was called with rows that are not the call's rows."""


def split_per_batch(consume: Consumer, stacked: Stacked, current: list[int]) -> Consumer:
    """``consume`` (a :func:`~quark_brevitas.algorithms.scaling.layer_inputs` consumer) called once per original
    batch of the stacked call ``current[0]``, with that batch's rows; raises :class:`NotPerRow` for an input that
    does not have the call's rows first."""

    def split(name: str, rows: torch.Tensor, raw: Any) -> None:
        chunks = split_rows(rows, raw, stacked.parts[current[0]], stacked.dims)
        if chunks is None:
            raise NotPerRow(name)
        for chunk in chunks:
            consume(name, chunk, raw)

    return split


@dataclass(frozen=True)
class CallLayout:
    """The recorded (possibly stacked) calls of one module: ``parts[c]`` the rows of each original batch in call
    ``c`` along its first dimension, and ``order`` the ``(call, part)`` pairs in the order of the original calls
    (batch by batch, and within a batch the module's calls in order)."""

    parts: list[list[int]]
    order: list[tuple[int, int]]

    @classmethod
    def unstacked(cls, calls: int) -> CallLayout:
        return cls([[0]] * calls, [(call, 0) for call in range(calls)])

    @property
    def stacked(self) -> bool:
        return any(len(parts) > 1 for parts in self.parts)

    def split(self, call: int, tensor: torch.Tensor, per_row: int = 1) -> Sequence[torch.Tensor]:
        """``tensor`` (call ``call``'s input or output, with ``per_row`` leading entries per row of the call) cut
        into its original batches' pieces."""
        parts = self.parts[call]
        return (tensor,) if len(parts) == 1 else tensor.split([part * per_row for part in parts])

    def in_order(self, pieces: Sequence[Sequence[T]]) -> list[T]:
        """``pieces[c][p]`` (one per part of each call) in the order of the original calls."""
        return [pieces[call][part] for call, part in self.order]


class BatchTracker:
    """Follows a statistics pass over ``stacked.data`` (or unstacked data when ``stacked`` is ``None``): which
    stacked call is running (:meth:`on_output` counts them), the per-batch split of the hooks' consumers
    (:meth:`per_batch`), and the layouts of the calls a :class:`CallRecorder` (:attr:`recorder`, set before the
    pass) recorded."""

    def __init__(self, stacked: Stacked | None) -> None:
        self.stacked = stacked
        self.current = [0]
        self.recorder: CallRecorder | None = None
        self.starts: dict[str, list[int]] = {}  # per module: its calls recorded when each stacked call began

    def per_batch(self, consume: Consumer) -> Consumer:
        return consume if self.stacked is None else split_per_batch(consume, self.stacked, self.current)

    def on_output(self, position: int, _output: Any) -> None:
        self.current[0] = position + 1
        if self.recorder is not None:
            for name, calls in self.recorder.calls.items():
                self.starts.setdefault(name, [0]).append(len(calls))

    def layouts(self) -> dict[str, CallLayout]:
        """The :class:`CallLayout` of each recorded module. Raises :class:`NotPerRow` for a module whose input or
        output in a stacked call does not have the call's rows first."""
        assert self.recorder is not None
        result = {}
        for name, calls in self.recorder.calls.items():
            if self.stacked is None:
                result[name] = CallLayout.unstacked(len(calls))
                continue
            starts = self.starts[name]
            parts: list[list[int]] = []
            keys: list[tuple[int, int, int, int]] = []  # (original batch, call within it, call, part)
            first_batch = 0
            for batch, batch_parts in enumerate(self.stacked.parts):
                rows = sum(batch_parts)
                for within, call in enumerate(range(starts[batch], starts[batch + 1])):
                    args, kwargs = calls[call]
                    hidden = args[0] if args else next(iter(kwargs.values()), None)
                    if len(batch_parts) > 1 and not (rows_first(hidden, rows, self.stacked.dims) and rows_first(
                            self.recorder.outputs[name][call], rows, self.recorder.outputs[name][call].dim())):
                        raise NotPerRow(name)
                    parts.append(list(batch_parts))
                    keys.extend((first_batch + part, within, call, part) for part in range(len(batch_parts)))
                first_batch += len(batch_parts)
            result[name] = CallLayout(parts, [(call, part) for _, _, call, part in sorted(keys)])
        return result


def not_per_row(exc: BaseException) -> bool:
    """Whether ``exc`` (from a pass over stacked data) says that the stacked calls cannot be split per batch."""
    return isinstance(exc, NotPerRow) or isinstance(exc, CalibrationDataError) and isinstance(exc.__cause__,
                                                                                              NotPerRow)
