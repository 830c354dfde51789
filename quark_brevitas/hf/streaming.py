"""A Hugging Face model folder quantized one block at a time: bounded memory, a block-by-block checkpoint, resume.

Not a pipeline of its own: :func:`quantize_pretrained` is the pipeline's block-by-block run
(:func:`quark_brevitas.orchestration.block_runs.run_blocks`, the orchestrator a model in memory goes through too)
with another block *source* and *sink*. The float model is never held: its skeleton is built without weights
(:func:`~quark_brevitas.blocks.disk.load_skeleton`, parameters on ``meta``), the layers outside the block stack
are read from the folder's safetensors files, each block is read just before it is quantized
(:class:`~quark_brevitas.blocks.disk.FolderBlocks`) and, once its outputs are cached, written into the checkpoint
and dropped (:class:`~quark_brevitas.checkpoint.writer.BlockCheckpoint`, the sink built on the one checkpoint
writer). Peak memory is about one block (float, then quantized, plus what the algorithms need for it), the layers
outside the blocks and the cached activations (in memory, or on disk with ``offload="disk"``), not the model.

The output directory is a quark_brevitas checkpoint (:mod:`quark_brevitas.checkpoint`) in Hugging Face's sharded
layout; :func:`load_pretrained_quantized` loads it without the float model
(:mod:`quark_brevitas.checkpoint.streamed_blocks`), :func:`~quark_brevitas.checkpoint.load_quantized` with it.
The manifest records every weight file's SHA-256; loading checks it. An interrupted run keeps its work in
``<output>.partial`` and a later run on the same output with the same model, config and data resumes after the
last finished block (see :mod:`quark_brevitas.checkpoint.writer`).

Under ``torch.distributed`` every process reads the model and takes its share of the batches (see
:class:`~quark_brevitas.calibration.data.Shard`); the first process writes the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quark_brevitas.blocks.disk import FolderBlocks, FolderWeights, load_skeleton, materialise_outside
from quark_brevitas.blocks.engine import BlockwiseEngine
from quark_brevitas.blocks.sources import BlockSource
from quark_brevitas.blocks.stack import RUN_STACK, find_block_stack
from quark_brevitas.blocks.store import ActivationStore, StoreFactory
from quark_brevitas.brevitas_adapter import barrier, current_shard
from quark_brevitas.calibration.data import BatchToInputs, CalibrationData
from quark_brevitas.checkpoint import MANIFEST_FILE, CheckpointError
from quark_brevitas.checkpoint.manifest import FLOAT_MODEL_DIR
from quark_brevitas.checkpoint.streamed_blocks import load_pretrained_quantized, quantized_skeleton
from quark_brevitas.checkpoint.writer import BlockCheckpoint, ProgressStores, run_fingerprint
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import ModelError
from quark_brevitas.orchestration.block_runs import prepare_streamed, run_blocks
from quark_brevitas.outputs import check_output_dir, open_work_dir, reserve, work_dir
from quark_brevitas.pipeline import Pipeline

logger = logging.getLogger(__name__)

__all__ = ["FLOAT_MODEL_DIR", "FolderWeights", "evaluate_pretrained", "load_pretrained_quantized", "load_skeleton",
           "quantize_pretrained"]


def quantize_pretrained(
    model_dir: str | os.PathLike[str],
    config: Config,
    calib_loader: Any = None,
    output_dir: str | os.PathLike[str] = "quantized",
    *,
    batch_to_inputs: BatchToInputs | None = None,
    blocks: str | bool | None = True,
    resume: bool = True,
    offload: str | os.PathLike[str] | None = None,
    distributed: bool | None = None,
    container: Container | None = None,
    on_block: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Quantize the Hugging Face model in ``model_dir`` block by block into the checkpoint ``output_dir``.

    The float model is never in memory as a whole (see the module docstring). ``calib_loader``,
    ``batch_to_inputs`` and ``distributed`` are as for :meth:`~quark_brevitas.api.ModelQuantizer.quantize_model`;
    ``blocks``: the block stack (``True``: detect it, the default; or its name); ``offload``: where cached
    activations other than the next block's inputs (which go to the output's progress directory, for
    resuming) live; ``resume``: continue an interrupted run into ``output_dir``; ``on_block(index, count)``:
    called after each block is written; ``overwrite``: also write into an ``output_dir`` holding files
    quark_brevitas did not write (only the checkpoint's entries are replaced; never ``model_dir`` itself).

    The run writes into ``<output_dir>.partial`` (kept if it is interrupted, where a later run resumes; each
    finished block's SHA-256 is re-checked then and a damaged block is redone) and moves it to ``output_dir``
    once finished (:mod:`quark_brevitas.outputs`). The output is claimed before the model is read
    (:func:`~quark_brevitas.outputs.reserve`): a second run on it raises ``OutputBusyError`` naming the process,
    an unwritable or full destination ``OutputNotWritableError`` (an ``OSError``). Returns the output directory, which
    :func:`load_pretrained_quantized` (or :func:`~quark_brevitas.checkpoint.load_quantized`) loads.
    """
    model_dir = Path(model_dir)
    if getattr(config, "kv_cache_quant_config", None):
        raise CheckpointError("quantize_pretrained writes a checkpoint, which does not carry KV-cache quantization "
                              "(kv_cache_quant_config) yet; quantize the model in memory (ModelQuantizer), export it")
    if getattr(config, "softmax_quant_spec", None) is not None:
        raise CheckpointError("quantize_pretrained writes a checkpoint, which does not carry attention quantization "
                              "(softmax_quant_spec) yet; quantize the model in memory (ModelQuantizer), export it")
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise CheckpointError(f"output directory {str(output_dir)!r} exists and is not a directory")
    output = check_output_dir(output_dir, overwrite=overwrite, sources=[model_dir])
    with contextlib.ExitStack() as claim:
        writer_shard = current_shard(distributed)
        if writer_shard is None or writer_shard.rank == 0:  # only the process that writes claims the output
            claim.enter_context(reserve(output))  # a second run is refused, an unwritable output fails: before work
        work = work_dir(output)
        pipeline = Pipeline(config, container)
        model, hf_config = load_skeleton(model_dir)
        stack = find_block_stack(model, blocks if blocks is not None else True, pipeline.decoder_layers(),
                                 policy=RUN_STACK, obstacle=pipeline.blockwise_obstacle())
        if stack is None:
            raise ModelError(f"{type(model).__name__} cannot be streamed block by block "
                             f"({pipeline.blockwise_obstacle()}); load it and use ModelQuantizer.quantize_model")
        weights = FolderWeights(model_dir, getattr(model, "base_model_prefix", ""))
        materialise_outside(model, stack, weights, hf_config)
        plan = pipeline.prepare(model, calib_loader, batch_to_inputs=batch_to_inputs, distributed=distributed,
                                loaded_later=stack)
        shard = (plan.data.shard if plan.data is not None and plan.data.shard is not None
                 else current_shard(distributed))
        before = model
        model, prepare = prepare_streamed(pipeline.config, model, stack)  # a rotation: each block as it loads
        if model is not before:
            raise ModelError("a data-free pre-quantization step (Preprocess) changed the model's structure; a model "
                             "quantized block by block from its folder cannot be traced: set trace_model=False or "
                             "remove Preprocess")
        barrier(shard)  # every process has checked the folders before the first one creates the work folder
        if shard is None or shard.rank == 0:
            open_work_dir(work)
        barrier(shard)
        sink = BlockCheckpoint(work, output, stack, shard, run_fingerprint(config, hf_config, model_dir, stack,
                                                                           plan.data))
        start = sink.start(resume)
        count = len(model.get_submodule(stack))
        hidden = ActivationStore.open(sink.inputs_dir(start)) if start > 0 and plan.data is not None else None
        run_blocks(pipeline, model, stack, plan.data, FolderBlocks(weights, stack, prepare), sink=sink,
                   stores=ProgressStores(sink, StoreFactory.for_offload(offload)), on_block=on_block, start=start,
                   hidden=hidden, on_captured=lambda digest: sink.check_inputs(digest, resumed=start > 0))
        sink.finalize(model, config, hf_config, count)
    logger.info("Wrote %s (%d blocks)", output, count)
    return output


def evaluate_pretrained(
    source: str | os.PathLike[str],
    batches: Any,
    on_output: Callable[[int, Any], None],
    *,
    batch_to_inputs: BatchToInputs | None = None,
    container: Container | None = None,
) -> None:
    """Run ``batches`` through a model one block at a time and give ``on_output(position, output)`` the
    model's output for each batch: ``source`` is a Hugging Face float model folder, or a checkpoint written by
    :func:`quantize_pretrained` (each quantized block rebuilt and loaded in turn). Memory stays at about one
    block plus the activations, as when quantizing."""
    source = Path(source)
    data = CalibrationData(batches, batch_to_inputs)
    blocks: BlockSource
    if (source / MANIFEST_FILE).is_file():
        model, stack, blocks, _ = quantized_skeleton(source, container, keep=False)
    else:
        model, hf_config = load_skeleton(source)
        found = find_block_stack(model, policy=RUN_STACK)
        if found is None:
            raise ModelError(f"{type(model).__name__} has no block stack to stream")
        stack = found
        weights = FolderWeights(source, getattr(model, "base_model_prefix", ""))
        materialise_outside(model, stack, weights, hf_config)
        blocks = FolderBlocks(weights, stack)
    BlockwiseEngine(None, model, stack, data, blocks).evaluate(on_output)
