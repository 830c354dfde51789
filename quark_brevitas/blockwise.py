"""The block-by-block data phase: one block at a time on its cached inputs, total work linear in depth.

A model made of repeated blocks (the decoder layers of a causal LM, the layers of a BERT encoder) is
calibrated the way llm-compressor's sequential pipeline, GPTQModel and AutoAWQ do it:

1. the inputs of the first block are captured once for every calibration batch, including what the model
   passes to it by keyword (attention masks, rotary position embeddings, position ids);
2. for each block, the pipeline's data-phase stages (:meth:`quark_brevitas.pipeline.Pipeline.quantize_unit`:
   data-driven pre-quantization algorithms, layer replacement, activation calibration, post-quantization
   algorithms) run on that block alone, fed with its cached inputs (:class:`~quark_brevitas.data.BlockInputs`);
   then the quantized block's outputs become the next block's inputs;
3. the layers outside the blocks that the config quantizes (``lm_head``, a pooler, a classifier head) are
   handled the same way, one layer at a time, on inputs captured by a pass of the model in which every block
   replays its cached output instead of computing (layers before the first block, if any, come first).

Every pass over the data therefore runs one block (or one layer), never the model: the work grows
linearly with the depth instead of with its square (GPTQ on the whole model replays the model once per
layer). Cached activations stay on CPU, or go to disk (:class:`~quark_brevitas.activation_store.ActivationStore`).
Each algorithm sees, for a block, the inputs the quantized earlier blocks produce, as on the whole-model
path; for weight-only configs the two paths compute the same thing.

Where blocks come from and where they go is a :class:`BlockSource`: the blocks of a model in memory
(quantized in place, or copied one at a time so that the caller's model is never modified), or a
Hugging Face folder read and written one block at a time (:mod:`quark_brevitas.hf.streaming`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.activation_store import ActivationStore, detached
from quark_brevitas.brevitas_adapter import StopFwdException
from quark_brevitas.data import CACHE_KEYWORDS, BlockInputs, CalibrationData, takes
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["BlockSource", "BlockwiseEngine", "CopiedBlocks", "StoreFactory", "UntilStopped", "copy_without_blocks",
           "find_block_stack", "main_output", "replayable", "resolve_block_stack"]

#: Keyword names under which a block may take its hidden state when the model passes it by keyword.
_HIDDEN_KEYWORDS = ("hidden_states", "hidden_state", "x", "src", "tgt")


# ===================================================================== which blocks
def _is_hugging_face(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def find_block_stack(model: nn.Module) -> str | None:
    """The qualified name of the ``nn.ModuleList`` holding a Hugging Face model's repeated blocks (decoder
    layers of a causal LM, the layers of an encoder), or ``None``.

    A stack is a ModuleList of at least two modules of one class, not inside another such list; the model
    must have exactly one stack holding parameters (encoder-decoder models, with two, are not detected:
    name one with ``blocks=``). This is the one place that decides it, so that a finder that knows
    model families can replace it.
    """
    if not _is_hugging_face(model):
        return None
    stacks: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
            continue
        if any(name.startswith(outer + ".") for outer in stacks):
            continue
        if any(True for _ in module.parameters()):
            stacks.append(name)
    if len(stacks) != 1:
        logger.debug("%s: %d candidate block stacks (%s); block-by-block calibration needs one",
                     type(model).__name__, len(stacks), ", ".join(stacks) or "none")
        return None
    return stacks[0]


def resolve_block_stack(model: nn.Module, blocks: str | bool | None, decoder_layers: Sequence[str] = ()) -> str | None:
    """The block stack to calibrate block by block, or ``None`` for the whole-model path.

    ``blocks``: ``None`` (detect: Quark's ``model_decoder_layers`` of an algorithm config if one names it,
    else :func:`find_block_stack`), ``True`` (detect, and fail if nothing is found), ``False`` (whole model),
    or the qualified name of the ``nn.ModuleList`` of blocks. ``decoder_layers``: the
    ``model_decoder_layers`` values of the config's algorithms.
    """
    if blocks is False:
        return None
    named = blocks if isinstance(blocks, str) else None
    if named is None and decoder_layers:
        if len(set(decoder_layers)) > 1:
            raise ModelError(f"the algorithms name different decoder layers ({sorted(set(decoder_layers))}); "
                             "model_decoder_layers must agree")
        named = decoder_layers[0]
    if named is None:
        found = find_block_stack(model)
        if found is None and blocks is True:
            raise ModelError(f"blocks=True but no stack of repeated blocks was found in {type(model).__name__}; "
                             "name the nn.ModuleList of blocks, e.g. blocks='model.layers'")
        return found
    try:
        stack = model.get_submodule(named)
    except AttributeError:
        raise ModelError(f"blocks / model_decoder_layers {named!r}: {type(model).__name__} has no submodule of "
                         "that name; name the nn.ModuleList holding the repeated blocks, e.g. 'model.layers'"
                         ) from None
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        raise ModelError(f"blocks / model_decoder_layers {named!r} is a {type(stack).__name__}; it must name a "
                         "non-empty nn.ModuleList of blocks")
    return named


# ===================================================================== where blocks come from
class BlockSource:
    """Where the engine takes each block from and what it does with the quantized one.

    The default works on the model's own blocks in place. Subclasses copy them (:class:`CopiedBlocks`) or
    read and write them one at a time (a Hugging Face folder).
    """

    #: Whether :meth:`finish` drops the block (the engine then frees its memory at once).
    releases = False

    def load(self, index: int, current: nn.Module) -> nn.Module:
        """The float block ``index``, ready to quantize (``current`` is what the model holds there now)."""
        return current

    def finish(self, index: int, block: nn.Module) -> nn.Module:
        """Called once block ``index`` is quantized and its outputs are cached; returns what the model keeps."""
        return block


class CopiedBlocks(BlockSource):
    """The blocks of the caller's model, each copied just before it is quantized: the caller's model is
    never modified, and no float copy of the whole model is made."""

    def __init__(self, originals: Sequence[nn.Module]) -> None:
        self.originals = list(originals)

    def load(self, index: int, current: nn.Module) -> nn.Module:
        return copy.deepcopy(self.originals[index])


class _Placeholder(nn.Module):
    """Holds a block's place in a model whose blocks are elsewhere (not loaded yet, or written out)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelError("a block that is not loaded was called")


def copy_without_blocks(model: nn.Module, stack_name: str) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of ``model`` whose blocks are placeholders, and the original blocks (not copied)."""
    stack = model.get_submodule(stack_name)
    originals = list(stack)
    memo: dict[int, Any] = {id(block): _Placeholder() for block in originals}
    return copy.deepcopy(model, memo), originals


class StoreFactory:
    """Where cached activations go: ``None`` (memory, spilling to a temporary directory beyond half of the
    available memory), or a directory (every entry on disk, one subdirectory per store, removed when the
    store is closed; ``temporary``: the directory itself is removed by :meth:`cleanup`)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, memory_budget: int | None = -1,
                 temporary: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.memory_budget = memory_budget
        self.temporary = temporary
        self._count = 0

    def create(self, label: str) -> ActivationStore:
        if self.directory is None:
            return ActivationStore(memory_budget=self.memory_budget)
        self._count += 1
        return ActivationStore(self.directory / f"{self._count:04d}_{label}")

    def cleanup(self) -> None:
        if self.temporary and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def for_offload(cls, offload: str | os.PathLike[str] | None) -> StoreFactory:
        """``offload`` of ``quantize_model``: ``None`` (memory), ``"disk"`` (a temporary directory) or a path."""
        if offload is None:
            return cls()
        if offload == "disk":
            return cls(tempfile.mkdtemp(prefix="quark_brevitas_offload_"), temporary=True)
        if isinstance(offload, str | os.PathLike):
            return cls(offload)
        raise TypeError(f"offload must be None, 'disk' or a directory path, got {type(offload).__name__}")


# ===================================================================== passes over the model
class _Clock:
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


class _Until(UntilStopped):
    """:class:`UntilStopped` that counts its calls on ``clock``; Hugging Face models are asked not to build a
    key/value cache."""

    def __init__(self, model: nn.Module, clock: _Clock) -> None:
        super().__init__(model)
        self.clock = clock
        self.no_cache = takes(model, "use_cache")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.calls += 1
        if self.no_cache:
            kwargs.setdefault("use_cache", False)
        return super().forward(*args, **kwargs)


class _Replay(nn.Module):
    """Stands in for every block: returns the last block's cached output of the current batch."""

    def __init__(self, outputs: ActivationStore, clock: _Clock) -> None:
        super().__init__()
        self.outputs = outputs
        self.clock = clock

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.outputs[self.clock.calls - 1]


class _Solo(nn.Module):
    """One layer outside the blocks, under its own attribute name, as a unit of the data phase (so that the
    config resolves it with its full name and algorithms that wrap layers can wrap it)."""

    def __init__(self, attribute: str, layer: nn.Module) -> None:
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, layer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.attribute)(*args, **kwargs)


def _is_kv_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)


def replayable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A module call's arguments as they can be cached and replayed: key/value caches dropped (Hugging Face
    ``Cache`` objects wherever they are, and anything under a cache keyword of
    :data:`~quark_brevitas.data.CACHE_KEYWORDS`, ``cache`` or ``past_key_values`` depending on the transformers
    release; a block replayed on a cache would append to it on every call and attend to the appended keys),
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


class _Capture:
    """Forward pre-hooks on candidate modules: in each batch, the first one called records its inputs into a
    store and stops the pass."""

    def __init__(self, targets: dict[str, nn.Module], store: ActivationStore) -> None:
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


# ===================================================================== the engine
class BlockwiseEngine:
    """Runs the data phase block by block on ``model`` (whose block stack is ``stack_name``); see the module
    docstring.

    - ``pipeline``: the :class:`~quark_brevitas.pipeline.Pipeline` whose stages run on each block and layer
      (its ``quantize_unit`` and ``backend``);
    - ``data``: the user's calibration data, or ``None`` when no stage needs data (blocks are then only
      converted, one at a time);
    - ``source``: where blocks come from (:class:`BlockSource`); ``stores``: where activations go;
    - ``on_block``: called as ``on_block(index, count)`` after each block is finished.
    """

    def __init__(self, pipeline: Any, model: nn.Module, stack_name: str, data: CalibrationData | None,
                 source: BlockSource | None = None, *, stores: StoreFactory | None = None,
                 on_block: Callable[[int, int], None] | None = None) -> None:
        self.pipeline = pipeline
        self.model = model
        self.stack_name = stack_name
        self.stack = model.get_submodule(stack_name)
        if not isinstance(self.stack, nn.ModuleList):
            raise ModelError(f"{stack_name!r} is a {type(self.stack).__name__}, not an nn.ModuleList of blocks")
        self.data = data
        self.source = source if source is not None else BlockSource()
        self.stores = stores if stores is not None else StoreFactory()
        self.on_block = on_block
        self.clock = _Clock()
        self.runner = _Until(model, self.clock)
        # Shared inputs of the first block per batch (the hidden state's slot emptied) and where the hidden
        # state sits: position 0, or a keyword.
        self.templates: ActivationStore | None = None
        self.hidden_key: str | None = None
        self.hidden_shapes: list[torch.Size] = []
        #: sha256 of the first block's captured hidden states (a resumed run checks it has the same inputs).
        self.first_inputs_digest = ""
        #: ``on_captured(digest)``: called once the first block's inputs are captured, before any block runs.
        self.on_captured: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ the run
    def outside_layers(self) -> dict[str, nn.Module]:
        """The layers outside the block stack that the config quantizes, in model order."""
        rows = self.pipeline.backend.plan(self.model, self.pipeline.config, check_names=False)
        modules = dict(self.model.named_modules())
        inside = self.stack_name + "."
        return {row.name: modules[row.name] for row in rows
                if row.quantized and row.name and not row.name.startswith(inside) and row.name != self.stack_name}

    def run(self, *, start: int = 0, hidden: ActivationStore | None = None) -> nn.Module:
        """Quantize every block from ``start`` (earlier ones are done: ``hidden`` then holds block ``start``'s
        cached inputs) and the layers outside the blocks; return the model. Layers before the first block are
        quantized again when resuming (from the same float weights and data: the same result)."""
        remaining = self.outside_layers()
        count = len(self.stack)
        if self.data is None:
            return self._run_without_data(remaining, start)
        captured = self._before_blocks(remaining)
        if start == 0:
            hidden = captured
        else:
            captured.close()
            if hidden is None or len(hidden) != len(self.templates):
                raise ModelError(f"resuming at block {start} needs the cached inputs of all "
                                 f"{len(self.templates)} calibration batches")
        for index in range(start, count):
            hidden = self._block(index, hidden)
            self._release()
            if self.on_block is not None:
                self.on_block(index, count)
        self._after_blocks(remaining, hidden)
        hidden.close()
        self.templates.close()
        return self.model

    def _run_without_data(self, remaining: dict[str, nn.Module], start: int) -> nn.Module:
        for name in list(remaining):
            self._outside_unit(name, remaining.pop(name), None)
        count = len(self.stack)
        for index in range(start, count):
            name = f"{self.stack_name}.{index}"
            block = self.source.load(index, self.stack[index])
            self.stack[index] = self.pipeline.quantize_unit(block, name, None)
            self.stack[index] = self.source.finish(index, self.stack[index])
            self._release()
            if self.on_block is not None:
                self.on_block(index, count)
        return self.model

    def _release(self) -> None:
        """A dropped block sits in reference cycles (Brevitas's quantizers): collect them now, so that memory
        stays at one block (a full collection takes a fraction of a second, so only when blocks are dropped)."""
        if self.source.releases:
            gc.collect()

    # ------------------------------------------------------------------ capture passes
    def _pass(self, targets: dict[str, nn.Module], label: str) -> tuple[str | None, ActivationStore]:
        """One pass of the model that stops in each batch at the first target called; returns which target
        that was (the same in every batch, or ``None`` if no batch reached any) and the inputs it got."""
        store = self.stores.create(label)
        capture = _Capture(targets, store)
        self.clock.calls = 0
        try:
            self.data.forward(self.runner, f"Capturing inputs ({label})")
        finally:
            capture.remove()
        batches = self.clock.calls
        if not capture.hits:
            store.close()
            return None, store
        if len(capture.hits) != batches or len(set(capture.hits)) != 1:
            reached = sorted(set(capture.hits))
            store.close()
            raise ModelError(f"calibration batches reach different parts of the model first ({', '.join(reached)}"
                             f"{' or none' if len(capture.hits) != batches else ''}); block-by-block calibration "
                             "needs every batch to take the same path (pass blocks=False for the whole-model path)")
        return capture.hits[0], store

    def _before_blocks(self, remaining: dict[str, nn.Module]) -> ActivationStore:
        """Quantize the outside layers the model calls before its first block, then capture the first block's
        inputs; returns the hidden states (and keeps the shared inputs as templates)."""
        first = f"{self.stack_name}.0"
        while True:
            targets = {**remaining, first: self.stack[0]}
            hit, store = self._pass(targets, "first block")
            if hit is None:
                raise ModelError(f"no calibration batch reached the first block ({first}); block-by-block "
                                 "calibration needs the blocks to be called")
            if hit == first:
                break
            self._outside_unit(hit, remaining.pop(hit), store)
        return self._split_first_inputs(store)

    def _split_first_inputs(self, captured: ActivationStore) -> ActivationStore:
        hidden = self.stores.create("hidden_0")
        self.templates = self.stores.create("shared_inputs")
        digest = hashlib.sha256()
        for args, kwargs in captured:
            if args:
                self.hidden_key = None
                state, args = args[0], (None, *args[1:])
            else:
                key = next((k for k in _HIDDEN_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)), None)
                if key is None:
                    raise ModelError(f"{self.stack_name}.0 is called without a positional input or a hidden-state "
                                     f"keyword ({', '.join(_HIDDEN_KEYWORDS)}); the block engine cannot tell which "
                                     "input the previous block produces")
                self.hidden_key = key
                state, kwargs = kwargs[key], {**kwargs, key: None}
            if not isinstance(state, torch.Tensor):
                raise ModelError(f"{self.stack_name}.0's first input is a {type(state).__name__}, not a tensor")
            hidden.append(state)
            self.hidden_shapes.append(state.shape)
            self.templates.append((args, kwargs))
            digest.update(str((tuple(state.shape), state.dtype)).encode())
            digest.update(state.contiguous().numpy().tobytes() if state.dtype != torch.bfloat16
                          else state.float().numpy().tobytes())
        captured.close()
        self.first_inputs_digest = digest.hexdigest()
        if self.on_captured is not None:
            self.on_captured(self.first_inputs_digest)
        return hidden

    def _block_inputs(self, hidden: ActivationStore, label: str) -> BlockInputs:
        def get(position: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args, kwargs = self.templates[position]
            state = main_output(hidden[position], label)
            if self.hidden_key is None:
                return (state, *args[1:]), kwargs
            return args, {**kwargs, self.hidden_key: state}

        return BlockInputs(get, len(hidden), self.data, label)

    # ------------------------------------------------------------------ one block
    def _block(self, index: int, hidden: ActivationStore) -> ActivationStore:
        name = f"{self.stack_name}.{index}"
        logger.info("Block %d/%d (%s)", index + 1, len(self.stack), name)
        block = self.source.load(index, self.stack[index])
        self.stack[index] = block
        block = self.pipeline.quantize_unit(block, name, self._block_inputs(hidden, name))
        self.stack[index] = block
        return self._propagate(index, block, hidden)

    def _propagate(self, index: int, block: nn.Module, hidden: ActivationStore) -> ActivationStore:
        """Run ``block`` on its cached inputs; its outputs become the next block's inputs."""
        name = f"{self.stack_name}.{index}"
        outputs = self.stores.create(f"hidden_{index + 1}")

        def keep(position: int, output: Any) -> None:
            state = main_output(output, name)
            if state.shape != self.hidden_shapes[position]:
                raise ModelError(f"{name} turns a hidden state of shape {list(self.hidden_shapes[position])} into "
                                 f"{list(state.shape)}; the block engine needs blocks that keep its shape")
            if not torch.isfinite(state).all():
                raise ModelError(f"{name} produced NaN/Inf values on calibration batch {position}; keep it in float "
                                 "(Config.exclude) or use a wider format")
            outputs.append(detached(output))

        self._block_inputs(hidden, name).forward(block, f"{name}: outputs", on_output=keep)
        hidden.close()
        self.stack[index] = self.source.finish(index, block)
        return outputs

    @contextlib.contextmanager
    def _replaying(self, hidden: ActivationStore) -> Iterator[None]:
        """Every block replays the last block's cached output while the context lasts."""
        kept = list(self.stack)
        replay = _Replay(hidden, self.clock)
        for index in range(len(self.stack)):
            self.stack[index] = replay
        try:
            yield
        finally:
            for index, block in enumerate(kept):
                self.stack[index] = block

    # ------------------------------------------------------------------ forward only
    def evaluate(self, on_output: Callable[[int, Any], None], desc: str = "Evaluating") -> None:
        """Run the data through the model one block at a time, taking each block from the source, without
        quantizing anything: ``on_output(position, output)`` gets the model's output for each batch. The
        way to evaluate a model that does not fit in memory."""
        hidden = self._before_blocks({})
        for index in range(len(self.stack)):
            block = self.source.load(index, self.stack[index])
            self.stack[index] = block
            hidden = self._propagate(index, block, hidden)
            del block
            self._release()
        with self._replaying(hidden):
            self.clock.calls = 0
            self.data.forward(self.runner, desc, on_output=on_output)
        hidden.close()
        self.templates.close()

    # ------------------------------------------------------------------ layers outside the blocks
    def _after_blocks(self, remaining: dict[str, nn.Module], hidden: ActivationStore) -> None:
        """Quantize the remaining outside layers while every block replays the last block's cached output."""
        if not remaining:
            return
        with self._replaying(hidden):
            while remaining:
                hit, store = self._pass(dict(remaining), "after the blocks")
                if hit is None:
                    logger.warning("No calibration batch reaches %s; quantized without calibration",
                                   ", ".join(remaining))
                    for name in list(remaining):
                        self._outside_unit(name, remaining.pop(name), None)
                    break
                self._outside_unit(hit, remaining.pop(hit), store)

    def _outside_unit(self, name: str, layer: nn.Module, store: ActivationStore | None) -> None:
        parent_name, _, attribute = name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        solo = _Solo(attribute, layer)
        data = None
        if store is not None and self.data is not None:
            data = BlockInputs(store.__getitem__, len(store), self.data, name)
        logger.info("Layer outside the blocks: %s", name)
        solo = self.pipeline.quantize_unit(solo, parent_name, data, block=False)
        setattr(parent, attribute, getattr(solo, attribute))
        if store is not None:
            store.close()
