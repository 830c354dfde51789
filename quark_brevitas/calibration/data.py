"""Calibration data: any loader, any batch shape, checked and moved to the model.

:class:`CalibrationData` is the pipeline's view of the user's calibration loader, and
:meth:`CalibrationData.forward` is the one loop over calibration data in the library: calibration,
every algorithm and QAT threshold initialisation run their forward passes through it, so every loop
gets the same batch conventions, the same checks (non-finite values, empty loaders, batches the
model rejects, all reported with the batch index) and a tqdm progress bar.

Batch conventions (one batch = one forward call):

- a tensor: ``model(batch)``;
- a tuple or list: Quark's ``(inputs, target)`` convention, the first element is the input
  (a tensor, a tuple/list of positional tensors, or a dict of keyword arguments);
- a mapping (e.g. a Hugging Face tokenizer's ``BatchEncoding``): ``model(**batch)``;
- anything else, or another reading of tuples (a model with two positional inputs), through a
  ``batch_to_inputs(batch) -> (args, kwargs)`` callable given to ``quantize_model``.

Floating-point tensors are cast to the model's floating dtype; integer tensors (token ids,
attention masks) keep their dtype. Everything moves to the model's device.

Two more kinds of calibration data serve the block-by-block data phase and distributed calibration:

- :class:`Shard` (defined in :mod:`quark_brevitas.brevitas_adapter.distributed`, with everything else that
  talks to ``torch.distributed``; re-exported here): under ``torch.distributed`` each process takes every
  ``world_size``-th batch. Its :meth:`CalibrationData.all_reduce` is ``torch.distributed.all_reduce``, and at
  the end of every :meth:`~CalibrationData.forward` pass the statistics Brevitas accumulated inside the
  model (activation ranges, GPTQ/GPFQ Hessians, activation-equalization ranges) are combined across the
  processes (:func:`quark_brevitas.brevitas_adapter.all_reduce_statistics`), so every process ends
  with the same quantized model.
- :class:`BlockInputs`: the cached inputs of one block (or of one layer outside the blocks), which the
  block-by-block engine (:mod:`quark_brevitas.blocks`) gives the algorithms instead of the user's
  loader. Its batches are the block's ``(args, kwargs)``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.brevitas_adapter import Shard, StopFwdException, all_reduce_statistics, weights_quantized_once
from quark_brevitas.errors import CalibrationDataError, ModelError

logger = logging.getLogger(__name__)

__all__ = ["ALLOWED_BATCHES", "CACHE_KEYWORDS", "BatchToInputs", "BlockInputs", "CalibrationData", "Shard",
           "cache_keyword", "map_tensors", "model_device_dtype", "output_cache", "prepare_batch", "run_batches",
           "split_batch", "takes"]

ALLOWED_BATCHES = "a tensor, an (inputs, target) tuple/list, or a dict of keyword arguments"

def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a nest of tuples, lists and dicts; other values and the container
    types unchanged, except a Hugging Face ``ModelOutput``, which becomes the tuple of its non-None fields."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if hasattr(value, "to_tuple"):
        return tuple(map_tensors(v, fn) for v in value.to_tuple())
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


#: ``batch -> (args, kwargs)``: how one batch becomes the model's forward call.
BatchToInputs = Callable[[Any], "tuple[tuple[Any, ...], dict[str, Any]]"]


def takes(model: nn.Module, keyword: str) -> bool:
    """Whether ``model.forward`` has a parameter named ``keyword`` (e.g. ``use_cache``, to turn a decoder's
    key/value cache off)."""
    try:
        return keyword in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


#: The names transformers has given a forward's key/value cache argument (and its output field), newest first:
#: ``cache`` (transformers 5.24 renamed ``past_key_values`` to it; the old name is a deprecated alias, absent from
#: the signature), ``past_key_values`` (models before 5.24), ``past_key_value`` and ``layer_past`` (the attention
#: layers and blocks of 4.x releases and of GPT-2-like families). Every check of "does this call carry a cache"
#: goes through this one tuple, so that the next rename is one edit.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def cache_keyword(model: nn.Module) -> str | None:
    """The name under which ``model.forward`` takes its key/value cache (the first of :data:`CACHE_KEYWORDS` in its
    signature: ``cache`` on transformers >= 5.24, ``past_key_values`` before), or ``None`` if it takes none.

    The signature, not the installed transformers version, decides: a model's code (remote code, a fork) may
    follow either naming whatever transformers is installed."""
    return next((name for name in CACHE_KEYWORDS if takes(model, name)), None)


def output_cache(output: Any) -> Any:
    """The key/value cache a model call returned (its ``cache`` field on transformers >= 5.24, ``past_key_values``
    before), or ``None``. Read by key, not through the deprecated ``past_key_values`` alias, which logs a warning."""
    if not isinstance(output, Mapping):
        return None
    present = set(output.keys())  # not ``name in output``: transformers maps the old names there, with a warning
    return next((output[name] for name in CACHE_KEYWORDS if name in present), None)


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the model, taken from its first floating parameter or buffer that holds
    values (a model whose blocks are not loaded yet keeps them on the ``meta`` device)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point() and not tensor.is_meta:
            return tensor.device, tensor.dtype
    raise ModelError(f"{type(model).__name__} has no floating-point parameters or buffers: nothing to quantize")


def _move(value: Any, device: torch.device, dtype: torch.dtype, index: int, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            # An additive attention mask (0 or -inf, as nn.Transformer.generate_square_subsequent_mask) is data.
            if not torch.isfinite(value).all() and not ((value == 0) | (value == float("-inf"))).all():
                bad = int((~torch.isfinite(value)).sum())
                raise CalibrationDataError(
                    f"calibration batch {index}: {where} contains {bad} NaN/Inf value(s); "
                    "calibration data must be finite"
                )
            return value.to(device=device, dtype=dtype)
        return value.to(device=device)
    if isinstance(value, Mapping):
        return {k: _move(v, device, dtype, index, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_move(v, device, dtype, index, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def split_batch(batch: Any, index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn one batch into ``(args, kwargs)`` for the model's forward call (the default conventions)."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        if len(batch) == 0:
            raise CalibrationDataError(f"calibration batch {index}: empty {type(batch).__name__}; expected "
                                       f"{ALLOWED_BATCHES}")
        first = batch[0]
        if isinstance(first, Mapping):
            return (), dict(first)
        if isinstance(first, tuple | list):
            return tuple(first), {}
        if isinstance(first, torch.Tensor):
            return (first,), {}
        raise CalibrationDataError(
            f"calibration batch {index}: first element is a {type(first).__name__}; expected a tensor, "
            "a tuple of tensors or a dict of keyword arguments"
        )
    raise CalibrationDataError(f"calibration batch {index}: got a {type(batch).__name__}; expected {ALLOWED_BATCHES} "
                               "(or pass batch_to_inputs to quantize_model)")


def _custom_split(convert: BatchToInputs, batch: Any, index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        result = convert(batch)
    except Exception as exc:
        raise CalibrationDataError(f"calibration batch {index}: batch_to_inputs failed ({type(exc).__name__}: "
                                   f"{exc})") from exc
    if (not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], tuple | list)
            or not isinstance(result[1], Mapping)):
        raise CalibrationDataError(f"calibration batch {index}: batch_to_inputs must return (args, kwargs), a tuple "
                                   f"of positional inputs and a dict of keyword inputs; got {type(result).__name__}")
    return tuple(result[0]), dict(result[1])


def prepare_batch(batch: Any, index: int, device: torch.device, dtype: torch.dtype,
                  batch_to_inputs: BatchToInputs | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split, check and move one batch; see the module docstring for the conventions."""
    if batch_to_inputs is not None:
        args, kwargs = _custom_split(batch_to_inputs, batch, index)
    else:
        args, kwargs = split_batch(batch, index)
    return _move(args, device, dtype, index, "input"), _move(kwargs, device, dtype, index, "input")


def _is_one_shot(loader: Any) -> bool:
    """Whether iterating ``loader`` consumes it (a generator or iterator rather than a collection)."""
    try:
        return iter(loader) is loader
    except TypeError:
        return False


class CalibrationData:
    """The user's calibration loader as the pipeline feeds it: re-iterable, checked, one loop.

    - A one-shot iterator or generator is read once and kept in memory (with a log line), because
      calibration and algorithms such as GPTQ go over the data several times.
    - A bare tensor is rejected: iterating it would feed the model one row at a time.
    - ``batch_to_inputs``: optional ``batch -> (args, kwargs)`` for batches the default conventions
      read wrongly (e.g. a tuple of two positional inputs).
    - ``shard``: this process's share of data sharded over ``torch.distributed`` processes (see
      :class:`Shard`); every process must hold at least one batch.

    Iterating a CalibrationData yields the raw batches (of this process's shard).
    """

    def __init__(self, loader: Iterable[Any], batch_to_inputs: BatchToInputs | None = None, *,
                 shard: Shard | None = None) -> None:
        if isinstance(loader, CalibrationData):
            shard = shard if shard is not None else loader.shard
            loader, batch_to_inputs = loader.loader, batch_to_inputs or loader.batch_to_inputs
        if isinstance(loader, torch.Tensor):
            raise CalibrationDataError(
                "calib_loader is a single tensor; iterating it would feed the model one row at a time. Pass a "
                "list of batches ([x] for one batch, or x.split(32) for batches of 32) or a DataLoader"
            )
        if isinstance(loader, Mapping):
            raise CalibrationDataError("calib_loader is a single dict (one batch?); pass a list of batches "
                                       "([batch]) or a DataLoader")
        try:
            iter(loader)
        except TypeError:
            raise CalibrationDataError(
                f"calib_loader must be an iterable of batches (a DataLoader, a list, a generator); got "
                f"{type(loader).__name__}"
            ) from None
        if batch_to_inputs is not None and not callable(batch_to_inputs):
            raise TypeError(f"batch_to_inputs must be a callable batch -> (args, kwargs), got "
                            f"{type(batch_to_inputs).__name__}")
        if _is_one_shot(loader):
            logger.info("calib_loader is a one-shot iterator; its batches are kept in memory so that "
                        "calibration and algorithms can go over them several times")
            loader = list(loader)
        self.loader = loader
        self.batch_to_inputs = batch_to_inputs
        self.shard = shard
        if shard is not None and hasattr(loader, "__len__") and len(loader) < shard.world_size:
            raise CalibrationDataError(
                f"calib_loader has {len(loader)} batch(es) for {shard.world_size} processes; every process needs "
                "at least one batch (use smaller batches, or fewer processes)"
            )

    @classmethod
    def wrap(cls, loader: Any, batch_to_inputs: BatchToInputs | None = None, *,
             shard: Shard | None = None) -> CalibrationData | None:
        """``loader`` as CalibrationData (``None`` stays ``None``: the pipeline says who needs data)."""
        if loader is None:
            if batch_to_inputs is not None:
                raise CalibrationDataError("batch_to_inputs was given without a calib_loader")
            return None
        return cls(loader, batch_to_inputs, shard=shard)

    def indexed(self) -> Iterator[tuple[int, Any]]:
        """``(index, batch)`` for every batch of this process, ``index`` counting every batch of the loader
        (the number error messages name)."""
        for index, batch in enumerate(self.loader):
            if self.shard is None or self.shard.owns(index):
                yield index, batch

    def __iter__(self) -> Iterator[Any]:
        for _, batch in self.indexed():
            yield batch

    def __len__(self) -> int:
        """The number of batches (of this process), if the loader knows it (a list, a DataLoader);
        ``TypeError`` otherwise."""
        total = len(self.loader)
        if self.shard is None:
            return total
        return len(range(self.shard.rank, total, self.shard.world_size))

    def inputs(self, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Every batch as checked ``(args, kwargs)`` on ``device`` / ``dtype``."""
        for index, batch in self.indexed():
            yield prepare_batch(batch, index, device, dtype, self.batch_to_inputs)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Combine a statistic an algorithm collected on these batches with the same statistic collected by
        the other processes on theirs, in place (``op``: ``"sum"`` or ``"max"``), and return it.

        A no-op unless the data are sharded over ``torch.distributed`` processes (``shard``); then every
        algorithm that reduces its statistics through it (activation ranges, Hessians, ...) ends with the
        same result on every process. Every process must make the same calls in the same order.
        """
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        if self.shard is None:
            return tensor
        return self.shard.all_reduce(tensor, op)

    def _synchronise(self, model: nn.Module) -> None:
        """After a pass over sharded data: combine the statistics Brevitas accumulated in ``model``."""
        if self.shard is not None:
            count = all_reduce_statistics(model, self.all_reduce)
            logger.debug("combined %d statistics across %d processes", count, self.shard.world_size)

    def _progress(self, iterable: Iterable[Any], desc: str) -> Iterable[Any]:
        """A progress bar on the first process only."""
        quiet = self.shard is not None and self.shard.rank != 0
        try:
            total: int | None = len(self)
        except TypeError:
            total = None
        return tqdm(iterable, desc=desc, total=total, leave=False, disable=True if quiet else None)

    def accepted_by(self, model: nn.Module, index: int) -> bool:
        """Whether ``model`` runs batch ``index`` without an error (used to tell whether a batch that a
        quantized model rejected is at fault, or the quantization)."""
        device, dtype = model_device_dtype(model)
        for position, batch in self.indexed():
            if position != index:
                continue
            args, kwargs = prepare_batch(batch, index, device, dtype, self.batch_to_inputs)
            try:
                with torch.no_grad():
                    model(*args, **kwargs)
            except Exception:  # noqa: BLE001 - any failure means "not accepted"; the caller reports the original
                return False
            return True
        return False

    def forward(self, model: nn.Module, desc: str, *, on_output: Callable[[int, Any], None] | None = None) -> int:
        """Run every batch through ``model`` without gradients; return the number of batches.

        ``on_output(position, output)`` sees each output (``position`` counts this process's batches
        from 0). Raises :class:`CalibrationDataError` for an empty loader and for bad batches (naming the
        batch index and the cause). Over sharded data, the statistics Brevitas accumulated in ``model``
        during the pass are combined across the processes before this returns.
        """
        device, dtype = model_device_dtype(model)
        count = 0
        with torch.no_grad(), weights_quantized_once(model) as weights:
            for index, batch in self._progress(self.indexed(), desc):
                args, kwargs = prepare_batch(batch, index, device, dtype, self.batch_to_inputs)
                output = call_model(model, args, kwargs, index)
                weights.batch_done()
                if on_output is not None:
                    on_output(count, output)
                count += 1
        if count == 0:
            raise CalibrationDataError(f"{desc}: the calibration loader yielded no batches")
        logger.debug("%s: %d batches", desc, count)
        self._synchronise(model)
        return count


def failing_module(model: nn.Module, exc: BaseException) -> str | None:
    """The qualified name of the innermost module of ``model`` whose forward ``exc`` (or an exception it was
    raised from) came out of, or ``None`` when none did. A failure deep inside a model is then reported with the
    layer's name, not only the message of the operation that failed (a shape mismatch says nothing about where
    it happened).

    Read from the exception's traceback after the fact (the frames that have a ``self`` among ``model``'s
    modules), so a batch that succeeds costs nothing: registering a forward hook on every module for every
    batch cost more than the block's own arithmetic on small layers (a Brevitas layer has a dozen submodules).
    """
    names = {id(module): name for name, module in model.named_modules()}
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        innermost, traceback = None, exc.__traceback__
        while traceback is not None:
            owner = traceback.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in names:
                innermost = names[id(owner)]
            traceback = traceback.tb_next
        if innermost is not None:
            return innermost
        exc = exc.__cause__ or exc.__context__
    return None


def call_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], index: int,
               who: str = "the model") -> Any:
    """``model(*args, **kwargs)``; a failure is re-raised as a :class:`CalibrationDataError` naming the
    batch index (the pipeline decides whether the data or the quantized model is at fault), ``who``
    rejected it and the innermost module it came out of (:func:`failing_module`)."""
    try:
        return model(*args, **kwargs)
    except StopFwdException:
        raise  # Brevitas's GPxQ algorithms stop the forward pass on purpose.
    except Exception as exc:
        failed = failing_module(model, exc)
        where = f" in module {failed!r}" if failed else ""
        raise CalibrationDataError(
            f"calibration batch {index}: {who} rejected it{where} ({type(exc).__name__}: {exc})", batch_index=index,
            module=failed,
        ) from exc


def _as_is(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``batch_to_inputs`` of cached inputs: each batch already is ``(args, kwargs)``."""
    return batch


class _Batches:
    """A read-only sequence of ``count`` batches produced by ``get(position)``."""

    def __init__(self, get: Callable[[int], Any], count: int) -> None:
        self.get, self.count = get, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, position: int) -> Any:
        if not 0 <= position < self.count:
            raise IndexError(position)
        return self.get(position)

    def __iter__(self) -> Iterator[Any]:
        for position in range(self.count):
            yield self.get(position)


class BlockInputs(CalibrationData):
    """The cached inputs of one part of the model (a block, or a layer outside the blocks) as calibration
    data: what the block-by-block engine gives the calibrator and every algorithm handler.

    - Each batch is the part's ``(args, kwargs)``, exactly as the enclosing model called it (keyword
      inputs such as attention masks and rotary position embeddings included); the tensors were checked
      and converted when the user's batch entered the model, so they are only moved to the part's device.
    - ``get(position)`` returns this process's ``position``-th batch, ``count`` says how many there are.
    - ``parent``: the user's data: its shard (``all_reduce``, statistics synchronisation) and the batch
      numbers that error messages name carry over; ``label`` is the part's qualified name.
    """

    def __init__(self, get: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]], count: int,
                 parent: CalibrationData, label: str) -> None:
        self.loader = _Batches(get, count)
        self.batch_to_inputs = _as_is
        self.shard = parent.shard
        self.parent = parent
        self.label = label

    @classmethod
    def of(cls, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], parent: CalibrationData,
           label: str) -> BlockInputs:
        """Block inputs held in a list of ``(args, kwargs)`` calls (recorded by hooks)."""
        return cls(calls.__getitem__, len(calls), parent, label)

    def indexed(self) -> Iterator[tuple[int, Any]]:
        for position, batch in enumerate(self.loader):
            yield (self.shard.global_index(position) if self.shard is not None else position), batch

    def __len__(self) -> int:
        return len(self.loader)

    def forward(self, model: nn.Module, desc: str, *, on_output: Callable[[int, Any], None] | None = None) -> int:
        """Run every cached batch through ``model`` (the part, or a module that calls it) without gradients;
        same contract as :meth:`CalibrationData.forward`."""
        device = next((t.device for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta),
                      torch.device("cpu"))  # the first tensor decides: no list of every tensor per pass
        count = 0
        with torch.no_grad(), weights_quantized_once(model) as weights:
            for index, (args, kwargs) in self._progress(self.indexed(), desc):
                output = call_model(model, map_tensors(args, lambda t: t.to(device)),
                                    map_tensors(kwargs, lambda t: t.to(device)), index,
                                    f"{self.label} (on its cached input)")
                weights.batch_done()
                if on_output is not None:
                    on_output(count, output)
                count += 1
        if count == 0:
            raise CalibrationDataError(f"{desc}: no cached inputs for {self.label}")
        self._synchronise(model)
        return count


def run_batches(model: nn.Module, loader: Iterable[Any] | None, desc: str) -> int:
    """Forward every batch of ``loader`` through ``model`` (see :meth:`CalibrationData.forward`)."""
    if loader is None:
        raise CalibrationDataError(f"{desc} needs calibration data: pass calib_loader")
    return CalibrationData(loader).forward(model, desc)
