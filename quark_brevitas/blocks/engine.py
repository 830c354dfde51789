"""The block-by-block walker: one block at a time on its cached inputs, total work linear in depth.

A model made of repeated blocks (the decoder layers of a causal LM, the layers of a BERT encoder) is
calibrated the way llm-compressor's sequential pipeline, GPTQModel and AutoAWQ do it:

1. the inputs of the first block are captured once for every calibration batch, including what the model
   passes to it by keyword (attention masks, rotary position embeddings, position ids);
2. for each block, a :class:`~quark_brevitas.blocks.protocol.UnitQuantizer` processes that block alone, fed
   with its cached inputs (:class:`~quark_brevitas.calibration.data.BlockInputs`): the pipeline's data-phase stages
   (:meth:`quark_brevitas.pipeline.Pipeline.quantize_unit`), or one LLM algorithm on its whole-model path
   (:meth:`quark_brevitas.algorithms.blocks.BlockwiseHandler.apply`); then the processed block's outputs become
   the next block's inputs (for a stack that is not chained, each block's inputs are captured instead, with
   a pass of the model up to it);
3. the layers outside the blocks that the config quantizes (``lm_head``, a pooler, a classifier head) are
   handled the same way, one layer at a time, on inputs captured by a pass of the model in which every block
   replays its cached output instead of computing (layers before the first block, if any, come first).

Every pass over the data therefore runs one block (or one layer), never the model: the work grows
linearly with the depth instead of with its square (GPTQ on the whole model replays the model once per
layer). Cached activations stay on CPU, or go to disk (:class:`~quark_brevitas.blocks.store.ActivationStore`).
Each algorithm sees, for a block, the inputs the processed earlier blocks produce (under the quantizer's
``inputs_context``, if it has one), as on the whole-model path.

Where blocks come from and where they go is a :class:`~quark_brevitas.blocks.sources.BlockSource`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.capture import BlockCapture, Clock, CountingRunner, Replay, main_output
from quark_brevitas.blocks.protocol import Branches, UnitQuantizer
from quark_brevitas.blocks.sources import BlockSink, BlockSource, SoloLayer
from quark_brevitas.blocks.stack import outside_layers
from quark_brevitas.blocks.stacked_outputs import stacked_forward
from quark_brevitas.blocks.store import ActivationStore, StoreFactory, detached
from quark_brevitas.brevitas_adapter import layer_output_budget, outputs_handed_over, weight_cache_budget
from quark_brevitas.calibration.data import BlockInputs, CalibrationData
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["BlockwiseEngine"]

#: Keyword names under which a block may take its hidden state when the model passes it by keyword.
_HIDDEN_KEYWORDS = ("hidden_states", "hidden_state", "x", "src", "tgt")


# ===================================================================== the engine
class BlockwiseEngine:
    """Runs the data phase block by block on ``model`` (whose block stack is ``stack_name``); see the module
    docstring.

    - ``quantizer``: processes each block and layer (:class:`~quark_brevitas.blocks.protocol.UnitQuantizer`: the
      pipeline, or one algorithm); ``None`` only for :meth:`evaluate`;
    - ``data``: the user's calibration data, or ``None`` when no stage needs data (blocks are then only
      converted, one at a time);
    - ``source``: where blocks come from (:class:`~quark_brevitas.blocks.sources.BlockSource`); ``sink``: where
      each finished block goes (:class:`~quark_brevitas.blocks.sources.BlockSink`; default: it stays in the model);
      ``stores``: where activations go;
    - ``on_block``: called as ``on_block(index, count)`` after each block is finished;
    - ``inputs_context``: ``inputs_context(model)`` is entered around every pass that computes a block's inputs
      (the quantization state under which the earlier blocks run; default: as they are);
    - ``chained``: whether each block's inputs are the previous block's outputs plus the first block's other
      arguments (Hugging Face stacks; :func:`~quark_brevitas.blocks.capture.blocks_are_chained` checks it);
      otherwise each block's inputs are captured with a pass of the model up to it.
    """

    def __init__(self, quantizer: UnitQuantizer | None, model: nn.Module, stack_name: str,
                 data: CalibrationData | None, source: BlockSource | None = None, *,
                 sink: BlockSink | None = None, stores: StoreFactory | None = None,
                 on_block: Callable[[int, int], None] | None = None,
                 inputs_context: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] | None = None,
                 chained: bool = True) -> None:
        self.quantizer = quantizer
        self.model = model
        self.stack_name = stack_name
        self.stack = model.get_submodule(stack_name)
        if not isinstance(self.stack, nn.ModuleList):
            raise ModelError(f"{stack_name!r} is a {type(self.stack).__name__}, not an nn.ModuleList of blocks")
        self.data = data
        self.source = source if source is not None else BlockSource()
        self.sink = sink if sink is not None else BlockSink()
        self.stores = stores if stores is not None else StoreFactory()
        self.on_block = on_block
        self.inputs_context = inputs_context if inputs_context is not None else _as_they_are
        self.chained = chained
        self.clock = Clock()
        self.runner = CountingRunner(model, self.clock)
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
        return outside_layers(self._quantizer(), self.model, self.stack_name)

    def _quantizer(self) -> UnitQuantizer:
        if self.quantizer is None:
            raise ModelError("this BlockwiseEngine has no quantizer (it was built to evaluate); pass one to run it")
        return self.quantizer

    def run(self, *, start: int = 0, hidden: ActivationStore | None = None) -> nn.Module:
        """Quantize every block from ``start`` (earlier ones are done: ``hidden`` then holds block ``start``'s
        cached inputs) and the layers outside the blocks; return the model. Layers before the first block are
        quantized again when resuming (from the same float weights and data: the same result)."""
        remaining = self.outside_layers()
        count = len(self.stack)
        if self.data is None:
            return self._run_without_data(remaining, start)
        if not self.chained:
            return self._run_unchained(remaining)
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
            self.stack[index] = self._quantizer().quantize_unit(block, name, None)
            self.stack[index] = self._finish(index, self.stack[index])
            self._release()
            if self.on_block is not None:
                self.on_block(index, count)
        return self.model

    def _run_unchained(self, remaining: dict[str, nn.Module]) -> nn.Module:
        """Each block on the inputs a pass of the model (its earlier blocks processed) gives it: quadratic in
        depth, for stacks whose blocks are not simply chained. Outside layers are not supported here."""
        if remaining:
            raise ModelError(f"{self.stack_name}: the blocks are not chained, and layers outside them "
                             f"({', '.join(remaining)}) cannot be processed from cached block outputs")
        count = len(self.stack)
        for index in range(count):
            name = f"{self.stack_name}.{index}"
            block = self.source.load(index, self.stack[index])
            self.stack[index] = block
            hit, store = self._pass({name: block}, f"inputs of {name}")
            if hit is None:
                raise ModelError(f"no calibration batch reached block {name}")
            data = BlockInputs(store.__getitem__, len(store), self.data, name)
            self.stack[index] = self._quantizer().quantize_unit(block, name, data)
            store.close()
            self.stack[index] = self._finish(index, self.stack[index])
            self._release()
            if self.on_block is not None:
                self.on_block(index, count)
        return self.model

    def _finish(self, index: int, block: nn.Module) -> nn.Module:
        """A finished block goes to the sink (kept, or written and dropped), then back to its source."""
        return self.source.finish(index, self.sink.finish(index, block))

    def _release(self) -> None:
        """A dropped block sits in reference cycles (Brevitas's quantizers): collect them now, so that memory
        stays at one block (a full collection takes a fraction of a second, so only when blocks are dropped)."""
        if self.source.releases or self.sink.releases:
            gc.collect()

    # ------------------------------------------------------------------ capture passes
    def _pass(self, targets: dict[str, nn.Module], label: str) -> tuple[str | None, ActivationStore]:
        """One pass of the model that stops in each batch at the first target called; returns which target
        that was (the same in every batch, or ``None`` if no batch reached any) and the inputs it got."""
        store = self.stores.create(label)
        capture = BlockCapture(targets, store)
        self.clock.calls = 0
        try:
            with self.inputs_context(self.model):
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
        # Offloaded activations: the user asked for memory, so the algorithms keep no layer outputs in memory.
        budget = layer_output_budget(0) if self.stores.directory is not None else contextlib.nullcontext()
        # An algorithm may hand over the outputs its last passes computed (the layers it finished): the pass that
        # computes the block's outputs then recomputes only what changed since.
        with budget, weight_cache_budget(working_weight_bytes(block)), outputs_handed_over() as handoff:
            block = self._quantizer().quantize_unit(block, name, self._block_inputs(hidden, name))
            self.stack[index] = block
            with handoff.replaying():
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

        with self.inputs_context(self.model):
            inputs = self._block_inputs(hidden, name)
            # Stacked into a few calls where the block treats rows independently, unless the user asked for
            # memory (activations on disk); otherwise (or if a layer reads other rows) one call per batch.
            results = stacked_forward(block, inputs, f"{name}: outputs") if self.stores.directory is None else None
            if results is None:
                inputs.forward(block, f"{name}: outputs", on_output=keep)
            for position, output in enumerate(results or ()):
                keep(position, output)
        hidden.close()
        self.stack[index] = self._finish(index, block)
        return outputs

    @contextlib.contextmanager
    def _replaying(self, hidden: ActivationStore) -> Iterator[None]:
        """Every block replays the last block's cached output while the context lasts."""
        kept = list(self.stack)
        replay = Replay(hidden, self.clock)
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
        solo = SoloLayer(attribute, layer)
        data = None
        if store is not None and self.data is not None:
            data = BlockInputs(store.__getitem__, len(store), self.data, name)
        logger.info("Layer outside the blocks: %s", name)
        solo = self._quantizer().quantize_unit(solo, parent_name, data, block=False)
        setattr(parent, attribute, getattr(solo, attribute))
        if store is not None:
            store.close()


def working_weight_bytes(block: nn.Module) -> int | None:
    """The quantized weights a pass over ``block`` keeps (:func:`~quark_brevitas.brevitas_adapter.
    weight_cache_budget`): a mixture-of-experts block's without its containers of branches (the experts), so that
    a pass over the whole block quantizes the experts' weights at each call rather than hold them twice, float and
    quantized (a pass over one expert still keeps that expert's: it is smaller than the rest of the block);
    ``None`` (all) for a block without such containers."""
    def nbytes(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    containers = [module for module in block.modules() if isinstance(module, Branches) and len(module)]
    if not containers:
        return None
    return nbytes(block) - sum(nbytes(module) for module in containers)


@contextlib.contextmanager
def _as_they_are(_model: nn.Module) -> Iterator[None]:
    yield
