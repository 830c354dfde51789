"""A Hugging Face model folder quantized one block at a time: bounded memory, a block-by-block checkpoint, resume.

:func:`quantize_pretrained` never holds the float model. It builds the model's skeleton without weights
(``accelerate.init_empty_weights``: parameters on the ``meta`` device, buffers real), reads the layers outside
the block stack (embeddings, final norm, ``lm_head``) from the folder's safetensors files, and then runs the
block-by-block data phase (:mod:`quark_brevitas.blocks`) with a block source that reads each block's
weights just before it is quantized and, once its outputs are cached, writes the quantized block to the
output checkpoint and drops it. Peak memory is about one block (float, then quantized, plus what the
algorithms need for it), the layers outside the blocks and the cached activations (in memory, or on disk with
``offload="disk"``), not the model.

The output directory is a quark_brevitas checkpoint (:mod:`quark_brevitas.checkpoint`) in Hugging Face's
sharded layout: one safetensors file per block plus one for the rest, ``model.safetensors.index.json``,
``config.json`` (the quantization Config), ``manifest.json`` and ``float_model/`` (the model's Hugging Face
config, so that :func:`load_pretrained_quantized` can rebuild it without the float weights).
:func:`~quark_brevitas.checkpoint.load_quantized` also loads it into a float model in memory.

The manifest records every weight file's SHA-256; loading checks it (a damaged file is a CheckpointError naming
it). While a run is in progress it writes into ``<output>.partial`` (moved to the output directory once
finished: an existing output is never half-overwritten, see :mod:`quark_brevitas.outputs`), whose
``.progress/`` records the last finished block (and each block file's SHA-256) and keeps the cached inputs of
the next one; a run started again on the same output with the same model, config and data resumes after the
last finished block (re-checking the finished blocks' files: a damaged one is redone) and writes the same
checkpoint as an uninterrupted run.

Under ``torch.distributed`` every process reads the model and takes its share of the batches (see
:class:`~quark_brevitas.calibration.data.Shard`); the first process writes the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.disk import (
    FolderBlocks,
    FolderWeights,
    block_file,
    materialise,
    meta_parameters,
    random_fill,
)
from quark_brevitas.blocks.engine import BlockwiseEngine
from quark_brevitas.blocks.sources import BlockSource, SoloLayer
from quark_brevitas.blocks.stack import detect_block_stack, outside_layers
from quark_brevitas.blocks.store import ActivationStore, StoreFactory
from quark_brevitas.brevitas_adapter import barrier, current_shard, ignore_missing_keys, load_quant_model_mode
from quark_brevitas.calibration.data import BatchToInputs, CalibrationData, Shard
from quark_brevitas.checkpoint import (
    CHECKSUMS_KEY,
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    read_checkpoint,
    read_safetensors,
)
from quark_brevitas.checkpoint.load import check_state, check_structure
from quark_brevitas.checkpoint.manifest import dtype_name, library_versions, module_structure, state_tensors
from quark_brevitas.checkpoint.streamed_blocks import CheckpointBlocks
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import ModelError
from quark_brevitas.extras import require
from quark_brevitas.orchestration.block_runs import choose_block_stack, prepare_streamed
from quark_brevitas.outputs import check_output_dir, commit, file_sha256, open_work_dir, reserve, work_dir
from quark_brevitas.outputs import write_file as _write_atomic
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE, Pipeline, SavedStructure, restrict_structure
from quark_brevitas.version import __version__

logger = logging.getLogger(__name__)

__all__ = ["FLOAT_MODEL_DIR", "FolderWeights", "evaluate_pretrained", "load_pretrained_quantized", "load_skeleton",
           "quantize_pretrained"]

#: Subdirectory of a streamed checkpoint holding the float model's Hugging Face config (and the tokenizer).
FLOAT_MODEL_DIR = "float_model"
PROGRESS_DIR = ".progress"
REST_FILE = "model-rest.safetensors"
_STATE_FILE = "state.json"
#: How a user starts an interrupted run over, in the Python API and on the command line.
_RESTART_HINT = "pass resume=False (--no-resume on the command line)"


def load_skeleton(folder: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """The model of a Hugging Face folder without its weights (parameters on ``meta``) and its config.

    The class is the config's first ``architectures`` entry (``AutoModel`` if it names none).
    """
    transformers = require("transformers", "a Hugging Face model folder")
    init_empty_weights = require("accelerate", "a Hugging Face model folder").init_empty_weights

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (no config.json)")
    hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    architectures = getattr(hf_config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with init_empty_weights():
        model = transformers.AutoModel.from_config(hf_config) if model_class is None else model_class(hf_config)
    return model.eval(), hf_config


def _tie(model: nn.Module, hf_config: Any) -> None:
    """Tie the output embedding to the input embedding if the config says so (the folder stores one)."""
    if getattr(hf_config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()


def _materialise_outside(model: nn.Module, stack: str, weights: FolderWeights, hf_config: Any) -> None:
    materialise(model, "", weights, skip=stack)
    _tie(model, hf_config)
    missing = meta_parameters(model, skip=stack)
    if missing:
        raise CheckpointError(f"{weights.folder} lacks tensor {missing[0]!r} of {type(model).__name__}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


# ===================================================================== writing, block by block
def _record(module: nn.Module, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The manifest entries of one part (modules, tensors, frozen parameters) under its full name, and its
    tensors."""

    def full(key: str) -> str:
        return f"{name}.{key}" if key else name

    tensors = {full(k): v for k, v in state_tensors(module.state_dict()).items()}
    record = {
        "modules": {full(k): v for k, v in module_structure(module).items()},
        "tensors": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in tensors.items()},
        "frozen": [full(n) for n, p in module.named_parameters() if not p.requires_grad],
    }
    return record, tensors


class _Writer:
    """Writes a streamed run's checkpoint one block at a time, with the progress a later run resumes from."""

    def __init__(self, directory: Path, output: Path, stack: str, shard: Shard | None, fingerprint: str) -> None:
        """``directory``: the work folder written until the run finishes, then moved to ``output``."""
        self.directory, self.output, self.stack, self.shard = directory, output, stack, shard
        self.fingerprint = fingerprint
        self.rank = shard.rank if shard is not None else 0
        self.progress = directory / PROGRESS_DIR
        self.on_block: Callable[[int, int], None] | None = None

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def inputs_dir(self, index: int) -> Path:
        return self.progress / f"inputs-r{self.rank}-{index:05d}"

    def state(self) -> dict[str, Any] | None:
        path = self.progress / _STATE_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def start(self, resume: bool) -> int:
        """The first block to quantize: after the last finished one of an interrupted run with the same
        fingerprint (if ``resume``), else 0 (and any earlier progress is cleared)."""
        state = self.state() if resume else None
        if state is not None and state.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"{self.directory} holds an unfinished run of another model, config or calibration data; "
                f"{_RESTART_HINT} to start over (its progress is then discarded) or choose another output folder"
            )
        damaged = self._damaged_block(int(state["done"])) if state is not None else None
        if damaged is not None:
            logger.warning("%s; quantizing again from block 0 (the inputs of the blocks after it are no longer "
                           "cached)", damaged)
            state = None
        if state is None:
            barrier(self.shard)
            if self.writes and self.progress.exists():
                shutil.rmtree(self.progress)
            barrier(self.shard)
            self.progress.mkdir(parents=True, exist_ok=True)
            return 0
        logger.info("Resuming %s after block %d", self.directory, state["done"])
        return int(state["done"]) + 1

    def _damaged_block(self, done: int) -> str | None:
        """Why a finished block of the interrupted run cannot be reused (missing, or its bytes differ from
        those written, by the SHA-256 recorded then), or ``None`` if blocks ``0..done`` are intact."""
        for index in range(done + 1):
            path = self.directory / block_file(index)
            try:
                recorded = json.loads((self.progress / f"block-{index:05d}.json").read_text()).get("sha256")
            except (OSError, ValueError, AttributeError):
                return f"the record of finished block {index} ({path.name}) in {self.progress} is missing or damaged"
            if not path.is_file():
                return f"finished block {index}'s file {path} is missing"
            if recorded is None or file_sha256(path) != recorded:
                return f"finished block {index}'s file {path} has changed since it was written (SHA-256 differs)"
        return None

    def check_inputs(self, digest: str, resumed: bool) -> None:
        """A resumed run must start from the same first-block inputs (same data, same embeddings)."""
        path = self.progress / f"digest-r{self.rank}.txt"
        if resumed:
            if not path.is_file() or path.read_text() != digest:
                raise CheckpointError(f"{self.directory}: the calibration data differ from the interrupted run's "
                                      f"(the first block's inputs do not match); {_RESTART_HINT} to start over")
        else:
            path.write_text(digest)

    def block_done(self, index: int, block: nn.Module) -> None:
        name = f"{self.stack}.{index}"
        if self.writes:
            from safetensors.torch import save_file

            record, tensors = _record(block, name)
            path = _write_atomic(self.directory / block_file(index),
                                 lambda p: save_file(tensors, str(p), metadata={"format": FORMAT}))
            record["sha256"] = file_sha256(path)  # checked on resume and, through the manifest, on load
            _write_atomic(self.progress / f"block-{index:05d}.json", lambda p: p.write_text(json.dumps(record)))
        barrier(self.shard)  # every process has the next block's inputs on disk
        if self.writes:
            state = {"fingerprint": self.fingerprint, "done": index}
            _write_atomic(self.progress / _STATE_FILE, lambda p: p.write_text(json.dumps(state)))
        barrier(self.shard)
        for old in self.progress.glob(f"inputs-r{self.rank}-*"):
            if int(old.name.rsplit("-", 1)[1]) <= index:
                shutil.rmtree(old, ignore_errors=True)

    def finalize(self, model: nn.Module, config: Config, hf_config: Any, count: int) -> None:
        """The rest of the model, the index, the config and the manifest; then the progress goes and the
        finished folder is moved to the output folder."""
        if self.writes:
            from safetensors.torch import save_file

            inside = self.stack + "."
            rest_state = {k: v for k, v in model.state_dict().items() if not k.startswith(inside)}
            rest = state_tensors(rest_state)
            _write_atomic(self.directory / REST_FILE, lambda p: save_file(rest, str(p), metadata={"format": FORMAT}))
            modules = {k: v for k, v in module_structure(model).items() if not k.startswith(inside)}
            tensors = {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in rest.items()}
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad and not n.startswith(inside)]
            weight_map = dict.fromkeys(rest, REST_FILE)
            digests = {REST_FILE: file_sha256(self.directory / REST_FILE)}
            for index in range(count):
                record = json.loads((self.progress / f"block-{index:05d}.json").read_text())
                modules.update(record["modules"])
                tensors.update(record["tensors"])
                frozen.extend(record["frozen"])
                weight_map.update(dict.fromkeys(record["tensors"], block_file(index)))
                digests[block_file(index)] = record["sha256"]
            manifest = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "versions": library_versions(),
                "model_class": type(model).__name__, "training": False, "modules": modules, "graph_code": {},
                "tensors": tensors, "frozen_parameters": frozen, "example_input": None, "block_stack": self.stack,
                CHECKSUMS_KEY: digests,
            }
            index_file = {"metadata": {"format": FORMAT}, "weight_map": weight_map}
            _write_atomic(self.directory / WEIGHTS_INDEX_FILE, lambda p: p.write_text(json.dumps(index_file, indent=1)))
            _write_atomic(self.directory / CONFIG_FILE, lambda p: p.write_text(config.to_json() + "\n"))
            hf_config.save_pretrained(self.directory / FLOAT_MODEL_DIR)
            _write_atomic(self.directory / MANIFEST_FILE, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))
        barrier(self.shard)
        if self.writes:
            shutil.rmtree(self.progress, ignore_errors=True)
            commit(self.directory, self.output)
        barrier(self.shard)


class _ProgressStores(StoreFactory):
    """Activations of a streamed run: each block's inputs in the progress directory (kept for resuming,
    removed by the writer once the block is done); everything else as ``scratch`` says."""

    def __init__(self, writer: _Writer, scratch: StoreFactory) -> None:
        super().__init__()
        self.writer, self.scratch = writer, scratch

    def create(self, label: str) -> ActivationStore:
        if label.startswith("hidden_"):
            directory = self.writer.inputs_dir(int(label.removeprefix("hidden_")))
            shutil.rmtree(directory, ignore_errors=True)  # a partial one from an interrupted run
            return ActivationStore(directory, keep=True)
        return self.scratch.create(label)

    def cleanup(self) -> None:
        self.scratch.cleanup()


def _fingerprint(config: Config, hf_config: Any, folder: Path, stack: str, data: CalibrationData | None) -> str:
    """What must not change between an interrupted run and its resumption (the data's own identity is
    checked separately, on the first block's inputs)."""
    files = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors*"))
    world = data.shard.world_size if data is not None and data.shard is not None else 1
    text = json.dumps({"config": config.to_dict(), "model": hf_config.to_dict(), "files": files, "stack": stack,
                       "world_size": world, "quark_brevitas": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# ===================================================================== the entry points
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
        stack = choose_block_stack(model, pipeline.config, blocks if blocks is not None else True, needs_data=True)
        if stack is None:
            raise ModelError(f"{type(model).__name__} cannot be streamed block by block "
                             f"({pipeline.blockwise_obstacle()}); load it and use ModelQuantizer.quantize_model")
        weights = FolderWeights(model_dir, getattr(model, "base_model_prefix", ""))
        _materialise_outside(model, stack, weights, hf_config)
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
        writer = _Writer(work, output, stack, shard, _fingerprint(config, hf_config, model_dir, stack, plan.data))
        start = writer.start(resume)
        writer.on_block = on_block
        stores = _ProgressStores(writer, StoreFactory.for_offload(offload))
        blocks = FolderBlocks(weights, stack, writer.block_done, prepare)
        engine = BlockwiseEngine(pipeline, model, stack, plan.data, blocks, stores=stores, on_block=on_block)
        engine.on_captured = lambda digest: writer.check_inputs(digest, resumed=start > 0)
        count = len(engine.stack)
        hidden = ActivationStore.open(writer.inputs_dir(start)) if start > 0 and plan.data is not None else None
        try:
            engine.run(start=start, hidden=hidden)
        finally:
            stores.cleanup()
        writer.finalize(model, config, hf_config, count)
    logger.info("Wrote %s (%d blocks)", output, count)
    return output


def quantized_skeleton(directory: str | os.PathLike[str], container: Container | None,
                        keep: bool) -> tuple[nn.Module, str, CheckpointBlocks, Any]:
    """A streamed checkpoint's model with everything but the blocks rebuilt and loaded, its block stack, the
    source of its quantized blocks and the checkpoint's description."""
    info = read_checkpoint(directory)
    stack = info.manifest.get("block_stack")
    if not isinstance(stack, str):
        raise CheckpointError(f"{info.directory} was not written block by block (quantize_pretrained); load it with "
                              "load_quantized and its float model")
    model, hf_config = load_skeleton(info.directory / FLOAT_MODEL_DIR)
    pipeline = Pipeline(info.config, container)
    model, prepare = prepare_streamed(info.config, model, stack, values=False)
    saved = SavedStructure(modules=dict(info.manifest["modules"]),
                           tensors={k: tuple(v["shape"]) for k, v in info.manifest["tensors"].items()})
    random_fill(model, -1, skip=stack)
    _tie(model, hf_config)
    for name in outside_layers(pipeline, model, stack):
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        solo = SoloLayer(attribute, getattr(parent, attribute))
        solo = pipeline.rebuild_unit(solo, parent_name, restrict_structure(saved, name, parent_name))
        setattr(parent, attribute, getattr(solo, attribute))
    rest = read_safetensors(info.directory / REST_FILE, info.manifest.get(CHECKSUMS_KEY, {}).get(REST_FILE))
    with ignore_missing_keys(), load_quant_model_mode(model):
        _, unexpected = model.load_state_dict(rest, strict=False)
    if unexpected:
        raise CheckpointError(f"{info.directory}: tensor {unexpected[0]!r} does not fit the rebuilt model")
    model.eval()
    setattr(model, CONFIG_ATTRIBUTE, info.config)
    return model, stack, CheckpointBlocks(pipeline, info.directory, stack, saved, keep, prepare), info


def load_pretrained_quantized(directory: str | os.PathLike[str], *, container: Container | None = None) -> nn.Module:
    """The quantized model of a checkpoint written by :func:`quantize_pretrained`, rebuilt from the Hugging Face
    config it records one block at a time (no float weights needed) and checked against its manifest.
    Returns the model in eval mode, ready for ``generate()``."""
    model, stack, blocks, info = quantized_skeleton(directory, container, keep=True)
    modules = model.get_submodule(stack)
    for index in range(len(modules)):
        modules[index] = blocks.load(index, modules[index])
    prefix = f"checkpoint {str(info.directory)!r} does not fit its recorded model"
    check_structure(model, info.manifest, prefix)
    recorded = {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]), device="meta")
                for k, v in info.manifest["tensors"].items()}
    check_state(model, recorded, prefix)
    logger.info("Loaded %s (%d blocks)", info.directory, len(modules))
    return model


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
        found = detect_block_stack(model)
        if found is None:
            raise ModelError(f"{type(model).__name__} has no block stack to stream")
        stack = found
        weights = FolderWeights(source, getattr(model, "base_model_prefix", ""))
        _materialise_outside(model, stack, weights, hf_config)
        blocks = FolderBlocks(weights, stack)
    BlockwiseEngine(None, model, stack, data, blocks).evaluate(on_output)
