"""Brevitas door (issue 20): a quantized layer's output remembered across GPTQ passes while nothing it depends on
changed.

Brevitas's GPTQ optimises the layers of a block one group at a time, each after a pass over the calibration data
that stops at it: the pass for a block's last Linear recomputes every layer before it, which GPTQ finished
passes ago (on MiniLM the repeated layers were a third of the passes' arithmetic). :class:`LayerOutputs` wraps
each quantized layer's ``forward`` while a GPTQ run lasts and, for the ``k``-th call of a layer in a pass, returns
the output of its ``k``-th call in an earlier pass when

- the input is equal, element for element (``torch.equal``; inputs recomputed upstream are new tensors),
- the layer was not optimised since (the caller :meth:`~LayerOutputs.forget`\\ s the layers it optimises: GPTQ
  writes weights through ``.data``, which no version counter sees),
- its quantizers are switched on or off as then, it is in the same mode (``training``), and neither the stored
  input nor the stored output was modified in place since (their version counters).

Otherwise the layer runs, and its output is kept while the kept tensors stay within ``budget_bytes`` (then later
calls simply run: the cache trades memory for time, never results). Only calls with one tensor argument and no
gradients are remembered. A weight set in place through its parameter (``copy_``) is also seen, by its version
counter.

GPTQConfig's last pass over a block computes, with their final weights, every layer but the last group; the block
engine's next pass (the block's outputs, for the next block) would compute them again. Inside
:func:`outputs_handed_over` (opened by the engine around a block), a memo opened with ``hand_over=True`` stays
installed after its context for that one pass (:meth:`Handoff.replaying`); the pipeline drops it
(:func:`discard_handed_over_outputs`) before any further algorithm, which might change the layers.

Part of the one door to Brevitas internals; re-exported by
:mod:`quark_brevitas.brevitas_adapter`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer
from torch import nn

from quark_brevitas.brevitas_adapter.cache import quant_layers

__all__ = ["LAYER_OUTPUT_BUDGET", "Handoff", "LayerOutputs", "discard_handed_over_outputs", "layer_output_budget",
           "layer_outputs_remembered", "outputs_handed_over"]

#: Bytes of inputs and outputs :func:`layer_outputs_remembered` keeps at most unless told otherwise (512 MiB; read
#: at each call, so a user short of memory can lower it, 0 turning the memo off).
LAYER_OUTPUT_BUDGET = 512 * 2**20

#: The budget :func:`layer_output_budget` sets for the code it wraps (``None``: :data:`LAYER_OUTPUT_BUDGET`).
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("layer_output_budget", default=None)


@contextlib.contextmanager
def layer_output_budget(budget_bytes: int) -> Iterator[None]:
    """Memos opened while the context lasts keep at most ``budget_bytes`` (0: none). The block engine sets 0 when
    the user offloads cached activations to disk: that user asked for memory, not speed."""
    token = _BUDGET.set(budget_bytes)
    try:
        yield
    finally:
        _BUDGET.reset(token)


class _Entry(NamedTuple):
    state: tuple[Any, ...]
    input: torch.Tensor
    input_version: int
    output: torch.Tensor
    output_version: int
    nbytes: int


def _state(layer: QuantWeightBiasInputOutputLayer) -> tuple[Any, ...]:
    """What a layer's output depends on besides its input: which quantizers are on, its mode, and its weight's
    storage and version counter (a weight set in place through the parameter, e.g. ``copy_``, is seen; one written
    through ``.data`` is not: the caller forgets such layers)."""
    weight = getattr(layer, "weight", None)
    stamp = (weight.data_ptr(), weight._version) if isinstance(weight, torch.Tensor) else None
    return (layer.training, stamp, *(bool(getattr(getattr(layer, name, None), "is_quant_enabled", False))
                                     for name in ("weight_quant", "input_quant", "output_quant", "bias_quant")))


class LayerOutputs:
    """The remembered outputs of the quantized layers of a model (see the module docstring)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self.entries: dict[nn.Module, list[_Entry | None]] = {}
        self.calls: dict[nn.Module, int] = {}
        #: Rows of the current remembered call already read by calls of fewer rows (see :meth:`_part`).
        self.offsets: dict[nn.Module, int] = {}
        #: Whether new outputs are kept (the caller may turn it off in the middle of a pass, once it knows that
        #: no later pass will reuse them).
        self.keep_new = True
        self.unfinished: frozenset[nn.Module] = frozenset()

    def new_pass(self, *, keep_new: bool = True, unfinished: Iterable[nn.Module] = ()) -> None:
        """The next calls start a new pass over the data: call ``k`` of a layer is matched with its call ``k``.
        ``keep_new=False``: the caller's last pass, whose new outputs nothing would reuse (they are not kept).
        ``unfinished``: layers the caller has still to optimise; their outputs are not kept this pass (their
        weights change before a later pass could reuse them, and a first batch that runs the whole block would
        otherwise keep every such layer's output until then)."""
        self.calls.clear()
        self.offsets.clear()
        self.keep_new = keep_new
        self.unfinished = frozenset(unfinished)

    def keep_only(self, layers: Iterable[nn.Module]) -> None:
        """Drop what every layer but ``layers`` computed (the caller's later passes run no other layer)."""
        keep = set(layers)
        self.forget([layer for layer in self.entries if layer not in keep])

    def forget(self, layers: Iterable[nn.Module]) -> None:
        """Drop what ``layers`` computed: their weights are about to change."""
        for layer in layers:
            for entry in self.entries.pop(layer, []):
                self.used -= entry.nbytes if entry is not None else 0

    def call(self, layer: QuantWeightBiasInputOutputLayer, forward: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        value = args[0] if len(args) == 1 else None
        if kwargs or not isinstance(value, torch.Tensor) or torch.is_grad_enabled():
            return forward(*args, **kwargs)
        ordinal = self.calls.get(layer, 0)
        entries = self.entries.setdefault(layer, [])
        entry = entries[ordinal] if ordinal < len(entries) else None
        state = _state(layer)
        offset = self.offsets.get(layer, 0)
        if entry is not None and value.dim() > 0 and (offset > 0 or _stacked_over(entry, value)):
            return self._part(layer, entry, ordinal, offset, state, value, forward)
        self.calls[layer] = ordinal + 1
        if entry is not None and self._matches(entry, state, value):
            return entry.output
        output = forward(value)
        if entry is not None:
            self.used -= entry.nbytes
            entries[ordinal] = None
        if not self.keep_new or type(output) is not torch.Tensor or layer in self.unfinished:
            return output
        nbytes = value.numel() * value.element_size() + output.numel() * output.element_size()
        if self.used + nbytes <= self.budget:
            entries.extend([None] * (ordinal + 1 - len(entries)))
            entries[ordinal] = _Entry(state, value, value._version, output, output._version, nbytes)
            self.used += nbytes
        return output

    def _part(self, layer: nn.Module, entry: _Entry, ordinal: int, offset: int, state: tuple[Any, ...],
              value: torch.Tensor, forward: Any) -> Any:
        """A call reading some of the rows of a remembered call (whose batches were stacked, see
        :mod:`quark_brevitas.calibration.stacking`): the rows ``offset:`` onwards of that call, in order."""
        end = offset + value.shape[0]
        if end >= entry.input.shape[0]:
            self.calls[layer], self.offsets[layer] = ordinal + 1, 0
        else:
            self.offsets[layer] = end
        if end <= entry.input.shape[0] and entry.output.dim() > 0 and entry.output.shape[0] == entry.input.shape[0] \
                and self._matches(entry, state, value, slice(offset, end)):
            return entry.output[offset:end]
        return forward(value)

    @staticmethod
    def _matches(entry: _Entry, state: tuple[Any, ...], value: torch.Tensor, rows: slice | None = None) -> bool:
        remembered = entry.input if rows is None else entry.input[rows]
        return (entry.state == state and entry.input._version == entry.input_version
                and entry.output._version == entry.output_version and remembered.shape == value.shape
                and entry.input.dtype == value.dtype and entry.input.device == value.device
                and (entry.input is value or torch.equal(remembered, value)))


def _stacked_over(entry: _Entry, value: torch.Tensor) -> bool:
    """Whether ``value`` may be the first rows of the remembered call (it has fewer rows, the same others)."""
    return entry.input.dim() == value.dim() and entry.input.shape[0] > value.shape[0] \
        and entry.input.shape[1:] == value.shape[1:]


def _remembering(memo: LayerOutputs, layer: QuantWeightBiasInputOutputLayer, forward: Any) -> Any:
    """``layer.forward`` through ``memo``, with the original's signature (Brevitas's equalization wrapper binds
    the arguments of its layer's ``forward``)."""

    @functools.wraps(forward)
    def remembering(*args: Any, **kwargs: Any) -> Any:
        return memo.call(layer, forward, args, kwargs)

    return remembering


def _install(model: nn.Module, memo: LayerOutputs) -> list[nn.Module]:
    installed = []
    for layer in quant_layers(model):
        if "forward" not in layer.__dict__:
            object.__setattr__(layer, "forward", _remembering(memo, layer, layer.forward))
            installed.append(layer)
    return installed


def _uninstall(memo: LayerOutputs, installed: list[nn.Module]) -> None:
    for layer in installed:
        layer.__dict__.pop("forward", None)
    memo.entries.clear()
    memo.used = 0


@contextlib.contextmanager
def layer_outputs_remembered(model: nn.Module, budget_bytes: int | None = None, *,
                             hand_over: bool = False) -> Iterator[LayerOutputs]:
    """While the context lasts, the quantized layers of ``model`` return remembered outputs where they can
    (:class:`LayerOutputs`, keeping at most ``budget_bytes``, by default the budget of the enclosing
    :func:`layer_output_budget`, else :data:`LAYER_OUTPUT_BUDGET`); the caller
    marks passes (``new_pass``) and the layers it changes (``forget``).

    ``hand_over``: when the context ends normally inside :func:`outputs_handed_over`, the memo stays installed
    for the enclosing code's next pass (:meth:`Handoff.replaying`) instead of being dropped: the block engine's
    pass that computes a block's outputs then reuses what the algorithm's last passes computed."""
    if budget_bytes is None:
        budget_bytes = _BUDGET.get()
    memo = LayerOutputs(LAYER_OUTPUT_BUDGET if budget_bytes is None else budget_bytes)
    installed = _install(model, memo)
    handoff = _HANDOFF.get()
    kept = False
    try:
        yield memo
        if hand_over and handoff is not None and memo.budget > 0:
            handoff.keep(memo, installed)
            kept = True
    finally:
        if not kept:
            _uninstall(memo, installed)


class Handoff:
    """A memo an algorithm left installed on a block for the block engine's next pass (see
    :func:`outputs_handed_over`)."""

    def __init__(self) -> None:
        self.kept: tuple[LayerOutputs, list[nn.Module]] | None = None

    def keep(self, memo: LayerOutputs, installed: list[nn.Module]) -> None:
        self.discard()
        self.kept = (memo, installed)

    def discard(self) -> None:
        """Drop the kept memo (uninstall it): something may change the layers before the next pass."""
        if self.kept is not None:
            _uninstall(*self.kept)
            self.kept = None

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """One more pass through the kept memo, if any (keeping nothing new), then drop it."""
        try:
            if self.kept is not None:
                self.kept[0].new_pass(keep_new=False)
            yield
        finally:
            self.discard()


#: The handoff :func:`outputs_handed_over` opened (``None``: memos are never kept beyond their context).
_HANDOFF: contextvars.ContextVar[Handoff | None] = contextvars.ContextVar("layer_outputs_handoff", default=None)


@contextlib.contextmanager
def outputs_handed_over() -> Iterator[Handoff]:
    """Opened by the block engine around a block's quantization and its outputs' pass: an algorithm whose
    :func:`layer_outputs_remembered` says ``hand_over`` leaves its memo for that pass (the block's layers, as the
    algorithm left them, then return the outputs they computed in the algorithm's last passes). Anything that may
    change the block's layers in between calls :func:`discard_handed_over_outputs` first."""
    handoff = Handoff()
    token = _HANDOFF.set(handoff)
    try:
        yield handoff
    finally:
        _HANDOFF.reset(token)
        handoff.discard()


def discard_handed_over_outputs() -> None:
    """Drop a memo handed over in the current :func:`outputs_handed_over` (before a step that may change layers)."""
    handoff = _HANDOFF.get()
    if handoff is not None:
        handoff.discard()
