"""The block engine's outputs pass on stacked batches (issue 32).

After a block is processed, the engine runs it once more over its cached inputs: the outputs become the next
block's inputs. With batches of one row, that pass is mostly per-call overhead; GPTQConfig's Hessian passes
already run stacked (:func:`~quark_brevitas.calibration.stacking.stacked_batches`), and this pass stacks the
same way, so that the memo GPTQ hands over (:func:`~quark_brevitas.brevitas_adapter.outputs_handed_over`) is
matched call for call, and splits each stacked output back into its batches' rows.

The outputs must be those of the batches run one by one, bit for bit, so this pass stacks only where rows stay
independent in the state the block runs in:

- no enabled quantizer other than weight and bias quantizers: an activation quantizer with a per-call (dynamic)
  scale mixes the rows of a call, and a static one may be collecting statistics;
- every quantized layer reads the stacked call's rows (the rule the Hessian passes use): a layer fed other rows
  (a mixture of experts' routed tokens) could round differently with more of them beside it;
- every tensor of the block's output has the call's rows first (so each batch's part can be cut out).

Otherwise the pass runs one batch per call (the caller's fallback: :func:`stacked_forward` returns ``None``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quark_brevitas.brevitas_adapter import iter_quantizers
from quark_brevitas.calibration.data import BlockInputs
from quark_brevitas.calibration.stacking import rows_first, stacked_batches
from quark_brevitas.errors import CalibrationDataError

__all__ = ["stacked_forward"]


class _NotRows(Exception):
    """A layer input or an output does not have the stacked call's rows first."""


def _rows_independent(block: nn.Module) -> bool:
    """Whether no enabled quantizer of ``block`` looks at activations (see the module docstring)."""
    return all(site.kind in ("weight", "bias") for site in iter_quantizers(block))


@contextlib.contextmanager
def _reading_rows(block: nn.Module, rows: list[int], dims: int) -> Iterator[None]:
    """Every quantized layer of ``block`` must read a tensor of ``dims`` dimensions with ``sum(rows[0])`` rows
    first, where ``rows[0]`` holds the current call's batches' rows (the caller updates it per call)."""

    def check(_module: nn.Module, args: tuple[Any, ...]) -> None:
        value = args[0] if args else None
        if not rows_first(value, rows[0], dims):
            raise _NotRows

    layers = {id(site.layer): site.layer for site in iter_quantizers(block, enabled_only=False)
              if site.kind == "weight"}
    handles = [layer.register_forward_pre_hook(check) for layer in layers.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _split(output: Any, parts: list[int]) -> list[Any]:
    """``output`` of a stacked call cut into one output per batch (``parts``: their rows, in order)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != sum(parts):
            raise _NotRows
        # Copies, not views: a view kept (or saved by an activation store spilling to disk) would hold the
        # whole stacked output.
        return [piece.clone() for piece in output.split(parts)]
    if isinstance(output, tuple | list) and type(output) in (tuple, list):
        pieces = [_split(item, parts) for item in output]
        return [type(output)(piece[i] for piece in pieces) for i in range(len(parts))]
    if output is None:
        return [None] * len(parts)
    raise _NotRows  # a dict, a ModelOutput, another value: not cut apart here


def stacked_forward(block: nn.Module, inputs: BlockInputs, desc: str) -> list[Any] | None:
    """``block``'s output for each batch of ``inputs``, computed on stacked batches, or ``None`` when they cannot
    be stacked safely (see the module docstring; the caller then runs the batches one by one)."""
    if not _rows_independent(block):
        return None
    stacked = stacked_batches(inputs)
    if stacked is None:
        return None
    results: list[Any] = []
    current = [sum(stacked.parts[0])]

    def keep(position: int, output: Any) -> None:
        results.extend(_split(output, stacked.parts[position]))
        if position + 1 < len(stacked.parts):
            current[0] = sum(stacked.parts[position + 1])

    try:
        with _reading_rows(block, current, stacked.dims):
            stacked.data.forward(block, desc, on_output=keep)
    except _NotRows:
        return None
    except CalibrationDataError as exc:  # the layer check raised inside the block's call
        if isinstance(exc.__cause__, _NotRows):
            return None
        raise
    return results
