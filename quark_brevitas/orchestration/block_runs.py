"""Running a recipe block by block: the orchestration above the block engine.

:func:`run_blocks` is the one orchestrator of every block-by-block run: a model in memory
(:meth:`~quark_brevitas.pipeline.Pipeline.quantize`, through :func:`quantize_blocks`) and a Hugging Face folder
quantized into a checkpoint (:func:`~quark_brevitas.hf.streaming.quantize_pretrained`) differ only in their block
*source* (the model's blocks, copies of them, a safetensors folder) and *sink* (the model in memory, a
block-by-block checkpoint), see :mod:`quark_brevitas.blocks.sources`.

:mod:`quark_brevitas.blocks` is the engine (capture, replay, activation stores, block sources, the stack finder)
and knows nothing of configs or algorithms; :class:`~quark_brevitas.pipeline.Pipeline` keeps the stages. What
ties a config to the engine lives here: what the one stack finder
(:func:`~quark_brevitas.blocks.stack.find_block_stack`) is told of a config (the algorithms' ``model_decoder_layers``,
:func:`named_decoder_layers`, and why the config cannot run block by block, :func:`blockwise_obstacle`, asked of the
algorithm handlers), the run with the right block source and activation stores (:func:`quantize_blocks`; a model
without a block stack is its own one block) and the data-free steps of a run whose blocks load one at a time
(:func:`prepare_streamed`). The pipeline is reached only through
:class:`~quark_brevitas.blocks.protocol.UnitQuantizer` and a ``prepare`` callable, so this module does not import
it (the pipeline imports this one).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from quark_brevitas.algorithms import BlockStep, handler_for
from quark_brevitas.algorithms.ties import run_untied
from quark_brevitas.blocks.engine import BlockwiseEngine
from quark_brevitas.blocks.protocol import UnitQuantizer
from quark_brevitas.blocks.sources import BlockSink, BlockSource, CopiedBlocks, copy_without_blocks
from quark_brevitas.blocks.store import ActivationStore, StoreFactory
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.errors import ModelError
from quark_brevitas.orchestration.collector import existing_objects_frozen

logger = logging.getLogger(__name__)

__all__ = ["WholeModelQuantizer", "blockwise_obstacle", "named_decoder_layers", "prepare_streamed", "quantize_blocks",
           "run_blocks"]


def _algorithm_name(algo: Any) -> str:
    return algo.name or type(algo).__name__


def _algorithms(config: Any) -> list[Any]:
    return [*config.pre_quant_opt_config, *config.algo_config]


def named_decoder_layers(config: Any) -> list[str]:
    """The ``model_decoder_layers`` named by the config's algorithms (Quark's field), if any."""
    return [a.model_decoder_layers for a in _algorithms(config)
            if isinstance(getattr(a, "model_decoder_layers", None), str) and a.model_decoder_layers]


def blockwise_obstacle(config: Any) -> str | None:
    """Why ``config`` cannot run block by block (``None`` if it can)."""
    whole = [_algorithm_name(a) for a in _algorithms(config) if not getattr(handler_for(a), "blockwise", True)]
    if whole:
        return f"{', '.join(whole)} needs the whole model in every pass"
    seen_data = False
    for algo in config.pre_quant_algorithms():
        if algo.needs_data:
            seen_data = True
        elif seen_data:
            return (f"the data-free pre-quantization step {_algorithm_name(algo)} comes after a data-driven one "
                    "(block by block, data-free steps run on the whole model first)")
    return None


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


class WholeModelQuantizer(UnitQuantizer, Protocol):
    """A :class:`~quark_brevitas.blocks.protocol.UnitQuantizer` that can also take a model without a block stack as
    its one unit (the pipeline: its stages in list order on the whole model, each algorithm's whole-model path)."""

    def quantize_whole(self, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """Every stage of the run on ``model`` at once, fed by ``data`` (``None`` when nothing needs data)."""
        ...


def quantize_blocks(quantizer: WholeModelQuantizer, model: nn.Module, stack: str | None,
                    data: CalibrationData | None, *, inplace: bool, offload: str | os.PathLike[str] | None,
                    prepare: Callable[[nn.Module], nn.Module] | None = None, prepared_by: str = "") -> nn.Module:
    """A run of a model in memory (:meth:`~quark_brevitas.pipeline.Pipeline.quantize`, with or without data): on a
    copy of ``model`` unless ``inplace``, through :func:`run_blocks`.

    With a block stack: ``prepare`` (the data-free steps that need the whole model, named ``prepared_by``) on the
    whole model, then the engine; without such steps the blocks of the caller's model are copied one at a time.
    Without one (``stack`` is ``None``: a model that is not made of repeated blocks, ``blocks=False``, or a config
    that needs the whole model in every pass), the whole model is the one block, and ``prepare`` is not used: the
    quantizer's whole-model stages run every step in list order."""
    source: BlockSource
    if stack is None:
        work = model if inplace else copy.deepcopy(model)
        return run_blocks(quantizer, work, None, data, BlockSource())  # nothing is cached: ``offload`` has no use
    if inplace or prepare is not None:
        work = model if inplace else copy.deepcopy(model)
        if prepare is not None:
            work = prepare(work)
            if not _has_submodule(work, stack):
                raise ModelError(f"the pre-quantization steps {prepared_by} changed the model's structure ({stack} "
                                 "is gone); pass blocks=False for the whole-model path")
        source = BlockSource()
    else:
        work, originals = copy_without_blocks(model, stack)
        source = CopiedBlocks(originals)
    return run_blocks(quantizer, work, stack, data, source, stores=StoreFactory.for_offload(offload))


def run_blocks(quantizer: WholeModelQuantizer, model: nn.Module, stack: str | None, data: CalibrationData | None,
               source: BlockSource, *, sink: BlockSink | None = None, stores: StoreFactory | None = None,
               on_block: Callable[[int, int], None] | None = None, start: int = 0,
               hidden: ActivationStore | None = None, on_captured: Callable[[str], None] | None = None) -> nn.Module:
    """The one run of a recipe: each block of ``stack`` taken from ``source``, quantized by ``quantizer`` on its
    cached inputs (from ``data``, kept by ``stores``), handed to ``sink`` (default: kept in the model), then the
    layers outside the blocks; returns the model. ``start``/``hidden``: resume at block ``start`` with its cached
    inputs; ``on_block(index, count)`` after each block; ``on_captured(digest)`` once the first block's inputs are
    captured. The stores are cleaned up however the run ends.

    ``stack`` ``None``: the whole model is the one block (the quantizer's
    :meth:`WholeModelQuantizer.quantize_whole` on ``data`` itself, nothing is cached); only the model's own source
    and the in-memory sink take it, since a folder's source or a checkpoint sink address the blocks of a stack."""
    stores = stores if stores is not None else StoreFactory()
    # The collector does not walk the objects that existed before the run (the libraries', the model's) at each
    # full collection the run's many new objects set off (see quark_brevitas.orchestration.collector).
    with existing_objects_frozen():
        try:
            if stack is None:
                return _run_whole(quantizer, model, data, source, sink, on_block)
            logger.info("%s block by block (%d blocks in %s)", "Calibrating" if data is not None else "Quantizing",
                        len(model.get_submodule(stack)), stack)
            engine = BlockwiseEngine(quantizer, model, stack, data, source, sink=sink, stores=stores,
                                     on_block=on_block)
            engine.on_captured = on_captured
            return engine.run(start=start, hidden=hidden)
        finally:
            stores.cleanup()


def _run_whole(quantizer: WholeModelQuantizer, model: nn.Module, data: CalibrationData | None, source: BlockSource,
               sink: BlockSink | None, on_block: Callable[[int, int], None] | None) -> nn.Module:
    """:func:`run_blocks` on a model that is its own one block."""
    others = [type(part).__name__ for part in (source, sink) if type(part) not in (BlockSource, BlockSink, type(None))]
    if others:
        raise ModelError(f"a run without a block stack quantizes the model in memory as one block; {', '.join(others)} "
                         "takes or writes the blocks of a stack: name the stack (blocks=)")
    model = quantizer.quantize_whole(source.load(0, model), data)
    model = source.finish(0, (sink or BlockSink()).finish(0, model))
    if on_block is not None:
        on_block(0, 1)
    return model


def prepare_streamed(config: Any, model: nn.Module, stack: str, *,
                     values: bool = True) -> tuple[nn.Module, BlockStep | None]:
    """The data-free pre-quantization steps of ``config`` on a model whose blocks (``stack``) load one at a time
    (streaming from a folder, or a streamed checkpoint): each step's part outside the blocks runs now, in list
    order; their parts in the blocks come back as one step, for the block source to run on each block as it loads,
    before the data phase touches it (:meth:`~quark_brevitas.algorithms.AlgorithmHandler.apply_streamed`).
    ``values``: compute the new values (quantizing) or only the structure the steps leave (loading)."""
    steps: list[BlockStep] = []
    for algo in config.pre_quant_algorithms():
        if algo.needs_data:
            continue
        # Once per run: loading a streamed checkpoint (values=False) rebuilds the same steps at DEBUG.
        logger.log(logging.INFO if values else logging.DEBUG, "Applying %s (outside the blocks now, each block as "
                   "it loads)", _algorithm_name(algo))
        handler = handler_for(algo)

        def apply(algo: Any, model: nn.Module, _data: Any, handler: Any = handler) -> nn.Module:
            model, step = handler.apply_streamed(algo, model, stack, values=values)
            if step is not None:
                steps.append(step)
            return model

        model = run_untied(model, _algorithm_name(algo), apply, algo, None)
    if not steps:
        return model, None

    def each_block(block: nn.Module, name: str) -> nn.Module:
        for step in steps:
            block = step(block, name)
        return block

    return model, each_block
