"""Capture and replay: passes of a model that stop at a module, record its inputs, or replay cached outputs.

The block engine (:mod:`quark_brevitas.blocks.engine`) captures the first block's inputs with a pass that
stops there (:class:`BlockCapture`, :class:`CountingRunner`), runs each block on cached inputs, and lets the
layers after the blocks see the last block's cached output (:class:`Replay`). The algorithms record calls
inside a block with :class:`CallRecorder`. Everything that is cached goes through :func:`replayable` (no
key/value caches) and is read back with :func:`main_output`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.store import ActivationStore, detached
from quark_brevitas.brevitas_adapter import StopFwdException
from quark_brevitas.calibration.data import CACHE_KEYWORDS, BlockInputs, CalibrationData, takes
from quark_brevitas.errors import ModelError

__all__ = ["BlockCapture", "CallRecorder", "Clock", "CountingRunner", "Replay", "UntilStopped", "blocks_are_chained",
           "capture_block_inputs", "first_batch_output", "main_output", "replayable"]


Call = tuple[tuple[Any, ...], dict[str, Any]]


class Clock:
    """Counts the model calls of a pass (one per calibration batch), so that replayed blocks know which
    batch's output to return."""

    def __init__(self) -> None:
        self.calls = 0


class UntilStopped(nn.Module):
    """``model`` whose calls end quietly (returning ``None``) where a hook raised Brevitas's
    :class:`StopFwdException`, also a hook on ``model`` itself, which Brevitas's own catch inside ``forward``
    does not see."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.model(*args, **kwargs)
        except StopFwdException:
            return None


class CountingRunner(UntilStopped):
    """:class:`UntilStopped` that counts its calls on ``clock``; Hugging Face models are asked not to build a
    key/value cache."""

    def __init__(self, model: nn.Module, clock: Clock) -> None:
        super().__init__(model)
        self.clock = clock
        self.no_cache = takes(model, "use_cache")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.calls += 1
        if self.no_cache:
            kwargs.setdefault("use_cache", False)
        return super().forward(*args, **kwargs)


class Replay(nn.Module):
    """Stands in for every block: returns the last block's cached output of the current batch."""

    def __init__(self, outputs: ActivationStore, clock: Clock) -> None:
        super().__init__()
        self.outputs = outputs
        self.clock = clock

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.outputs[self.clock.calls - 1]


def _is_kv_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)


def replayable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """A module call's arguments as they can be cached and replayed: key/value caches dropped (Hugging Face
    ``Cache`` objects wherever they are, and anything under a cache keyword of
    :data:`~quark_brevitas.calibration.data.CACHE_KEYWORDS`, ``cache`` or ``past_key_values`` depending on the
    transformers release; a block replayed on a cache would append to it on every call and attend to the appended keys),
    ``use_cache`` off."""
    kept = {key: None if key in CACHE_KEYWORDS or _is_kv_cache(value) else value for key, value in kwargs.items()}
    if "use_cache" in kept:
        kept["use_cache"] = False
    return tuple(None if _is_kv_cache(arg) else arg for arg in args), kept


def main_output(output: Any, where: str = "the block") -> torch.Tensor:
    """The tensor a block or model call returns first (hidden states, logits): the output itself, the first
    element of a tuple or list, or the first value of a dict or Hugging Face ``ModelOutput``."""
    value = output
    while not isinstance(value, torch.Tensor):
        if isinstance(value, tuple | list) and value:
            value = value[0]
        elif isinstance(value, Mapping) and value:
            value = next(iter(value.values()))
        else:
            raise ModelError(f"{where} returned a {type(output).__name__} without a tensor first; the block engine "
                             "needs blocks whose first output is the next block's hidden state")
    return value


class BlockCapture:
    """Forward pre-hooks on candidate modules: in each batch, the first one called records its inputs
    (replayable, detached on CPU) into ``store`` and stops the pass (run the model in :class:`UntilStopped`)."""

    def __init__(self, targets: dict[str, nn.Module], store: ActivationStore | list[Call]) -> None:
        self.store = store
        self.hits: list[str] = []
        self.handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                        for name, module in targets.items()]

    def _hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self.hits.append(name)
            self.store.append(replayable(detached(args), detached(kwargs)))
            raise StopFwdException

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def capture_block_inputs(model: nn.Module, block: nn.Module, data: CalibrationData, desc: str) -> BlockInputs:
    """The ``(args, kwargs)`` ``block`` is called with, for every batch of ``data`` run through ``model`` (which
    stops at the block), held in memory. Hugging Face's key/value caches are dropped and ``use_cache`` is off."""
    captured: list[Call] = []
    capture = BlockCapture({desc: block}, captured)
    try:
        data.forward(UntilStopped(model), desc)
    finally:
        capture.remove()
    return BlockInputs.of(captured, data, desc)


class CallRecorder:
    """While the context lasts, records every call of some modules: the replayable ``(args, kwargs)``
    (:attr:`calls`) and the main output, detached in float32 (:attr:`outputs`), per module name."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.calls: dict[str, list[Call]] = {name: [] for name in modules}
        self.outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self._handles: list[Any] = []

    def __enter__(self) -> CallRecorder:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, name=name: self.calls[name].append(replayable(args, kwargs)),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                lambda _m, _args, output, name=name: self.outputs[name].append(
                    main_output(output).detach().float().clone())))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _FirstBatchOnly(nn.Module):
    """``model`` called on the first batch only (later calls return ``None`` without running it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs) if self.calls == 1 else None


def first_batch_output(module: nn.Module, data: CalibrationData, desc: str) -> torch.Tensor:
    """``module``'s main output on the first batch of ``data`` (the others are not run)."""
    outputs: list[torch.Tensor] = []

    def keep(_index: int, output: Any) -> None:
        if output is not None:
            outputs.append(main_output(output).detach().clone())

    data.forward(_FirstBatchOnly(module), desc, on_output=keep)
    return outputs[0]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, nn.Module | torch.Tensor) and a == b


def blocks_are_chained(model: nn.Module, blocks: list[nn.Module], data: CalibrationData, desc: str) -> bool:
    """Whether, on the first batch, each block is called once, with the previous block's output as its first
    positional argument and otherwise with the same arguments as the first block (Hugging Face decoder stacks:
    ``hidden = layer(hidden, attention_mask=..., position_embeddings=...)``): then a block's inputs are the
    previous block's outputs and the first block's other arguments, which is what the engine feeds it."""
    calls: list[list[Call]] = [[] for _ in blocks]
    outputs: list[list[torch.Tensor]] = [[] for _ in blocks]
    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(
            lambda _m, args, kwargs, i=index: calls[i].append((args, kwargs)), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda _m, _a, out, i=index: outputs[i].append(main_output(out))))
    try:
        first_batch_output(model, data, desc)
    finally:
        for handle in handles:
            handle.remove()
    if any(len(c) != 1 for c in calls):
        return False
    (first_args, first_kwargs), = calls[0]
    for index in range(1, len(blocks)):
        (args, kwargs), = calls[index]
        if not (args and isinstance(args[0], torch.Tensor) and _same(args[0], outputs[index - 1][0])
                and _same(args[1:], first_args[1:]) and kwargs.keys() == first_kwargs.keys()
                and all(_same(kwargs[key], first_kwargs[key]) for key in kwargs)):
            return False
    return True
