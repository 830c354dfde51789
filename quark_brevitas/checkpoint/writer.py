"""The one checkpoint writer, and the block-by-block checkpoint as a sink of the block engine.

Every checkpoint is written by :class:`CheckpointWriter`: its weights as *parts* (one safetensors file each, with
the manifest's record of the part: module types, tensor shapes and dtypes, frozen parameters, the file's SHA-256),
then the config, the index of a sharded checkpoint and the manifest built from the parts' records. A model in
memory (:func:`~quark_brevitas.checkpoint.save_quantized`) is one part, ``model.safetensors``; a block-by-block run
writes one part per block as the engine finishes it and one for the rest of the model at the end
(:class:`BlockCheckpoint`, a :class:`~quark_brevitas.blocks.sources.BlockSink`), in Hugging Face's sharded layout
(``model.safetensors.index.json``) with ``float_model/`` holding the model's Hugging Face config. Both are the same
format, read by the same loaders (:mod:`quark_brevitas.checkpoint.load`,
:mod:`quark_brevitas.checkpoint.streamed_blocks`).

A block-by-block run writes into ``<output>.partial`` (moved to the output once finished), whose ``.progress/``
records the last finished block (each block's record and SHA-256) and keeps the cached inputs of the next one, so
that a run started again with the same model, config and data resumes after the last finished block (re-checking
the finished blocks' files: a damaged one is redone) and writes the same checkpoint as an uninterrupted run.
Under ``torch.distributed`` every process computes, the first one writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.blocks.disk import block_file
from quark_brevitas.blocks.sources import BlockPlaceholder, BlockSink
from quark_brevitas.blocks.store import ActivationStore, StoreFactory
from quark_brevitas.brevitas_adapter import barrier
from quark_brevitas.calibration.data import CalibrationData, Shard
from quark_brevitas.checkpoint.manifest import (
    CHECKSUMS_KEY,
    CONFIG_FILE,
    FLOAT_MODEL_DIR,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    REST_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    dtype_name,
    graph_code,
    huggingface_architecture,
    library_versions,
    model_dtype_name,
    module_structure,
    state_tensors,
)
from quark_brevitas.config import Config
from quark_brevitas.outputs import commit, file_sha256, write_file
from quark_brevitas.version import __version__

__all__ = ["PROGRESS_DIR", "BlockCheckpoint", "CheckpointWriter", "ProgressStores", "run_fingerprint"]

logger = logging.getLogger(__name__)

PROGRESS_DIR = ".progress"
_STATE_FILE = "state.json"
#: How a user starts an interrupted run over, in the Python API and on the command line.
_RESTART_HINT = "pass resume=False (--no-resume on the command line)"


def part_record(module: nn.Module, name: str, skip: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's record of one part of a model (``module``, named ``name`` in the model; ``skip``: a submodule
    left out, the block stack of the rest) and its tensors, under their full names."""

    def full(key: str) -> str:
        return f"{name}.{key}" if name and key else key or name

    def kept(key: str) -> bool:
        return skip is None or not key.startswith(skip + ".")

    state = {k: v for k, v in module.state_dict().items() if kept(k)}  # a resumed run's skipped blocks: on meta
    tensors = {full(k): v for k, v in state_tensors(state).items()}
    record = {
        "modules": {full(k): v for k, v in module_structure(module).items() if kept(k)},
        "tensors": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in tensors.items()},
        "frozen": [full(n) for n, p in module.named_parameters() if not p.requires_grad and kept(n)],
    }
    return record, tensors


class CheckpointWriter:
    """Writes a checkpoint's files into ``directory`` (a work folder, moved into place by the caller), each
    atomically (:func:`~quark_brevitas.outputs.write_file`): the weights part by part, then the config and the
    manifest built from the parts' records."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def write_part(self, file_name: str, module: nn.Module, name: str = "", skip: str | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """One safetensors file holding ``module``'s tensors (see :func:`part_record`); returns its record, with
        the file's name and SHA-256 (checked on resume and, through the manifest, on load)."""
        from safetensors.torch import save_file

        record, tensors = part_record(module, name, skip)
        path = write_file(self.directory / file_name,
                          lambda p: save_file(tensors, str(p), metadata={"format": FORMAT}))
        record.update(extra or {}, file=file_name, sha256=file_sha256(path))
        return record

    def write_tensors(self, file_name: str, tensors: dict[str, Any]) -> str:
        """A safetensors file of other tensors (the example input); returns its SHA-256."""
        from safetensors.torch import save_file

        path = write_file(self.directory / file_name, lambda p: save_file(tensors, str(p), metadata={"format": FORMAT}))
        return file_sha256(path)

    def write_json(self, file_name: str, content: Any) -> None:
        write_file(self.directory / file_name, lambda p: p.write_text(json.dumps(content, indent=1) + "\n"))

    def finish(self, model: nn.Module, config: Config, parts: list[dict[str, Any]], *,
               example: dict[str, Any] | None = None, checksums: Mapping[str, str] | None = None,
               block_stack: str | None = None) -> dict[str, Any]:
        """The config, the index (for several parts) and the manifest; returns the manifest. ``block_stack``: the
        stack of a block-by-block checkpoint, whose ``model`` holds placeholders there (its dtype and Hugging Face
        architecture are then not recorded: the float model's config is in ``float_model/``)."""
        modules: dict[str, str] = {}
        tensors: dict[str, Any] = {}
        frozen: list[str] = []
        digests: dict[str, str] = {}
        weight_map: dict[str, str] = {}
        for part in parts:
            modules.update(part["modules"])
            tensors.update(part["tensors"])
            frozen.extend(part["frozen"])
            digests[part["file"]] = part["sha256"]
            weight_map.update(dict.fromkeys(part["tensors"], part["file"]))
        whole = block_stack is None
        manifest: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": library_versions(),
                                    "model_class": type(model).__name__, "training": model.training}
        if whole:
            manifest["dtype"] = model_dtype_name(model)
        manifest.update({"modules": modules, "graph_code": graph_code(model), "tensors": tensors,
                         "frozen_parameters": frozen, "example_input": example})
        manifest["huggingface" if whole else "block_stack"] = huggingface_architecture(model) if whole else block_stack
        manifest[CHECKSUMS_KEY] = {**digests, **(checksums or {})}
        if len(parts) > 1:
            index = {"metadata": {"format": FORMAT}, "weight_map": weight_map}
            write_file(self.directory / WEIGHTS_INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=1)))
        write_file(self.directory / CONFIG_FILE, lambda p: p.write_text(config.to_json() + "\n"))
        self.write_json(MANIFEST_FILE, manifest)
        return manifest


class BlockCheckpoint(BlockSink):
    """The sink of a block-by-block run: each finished block is written into the checkpoint (with the progress a
    later run resumes from) and dropped; :meth:`finalize` writes the rest of the model and moves the finished
    folder to ``output``."""

    releases = True

    def __init__(self, directory: Path, output: Path, stack: str, shard: Shard | None, fingerprint: str) -> None:
        """``directory``: the work folder written until the run finishes, then moved to ``output``."""
        self.writer = CheckpointWriter(directory)
        self.directory, self.output, self.stack, self.shard = directory, output, stack, shard
        self.fingerprint = fingerprint
        self.rank = shard.rank if shard is not None else 0
        self.progress = directory / PROGRESS_DIR

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def inputs_dir(self, index: int) -> Path:
        return self.progress / f"inputs-r{self.rank}-{index:05d}"

    def _record_path(self, index: int) -> Path:
        return self.progress / f"block-{index:05d}.json"

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
                recorded = json.loads(self._record_path(index).read_text()).get("sha256")
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

    def finish(self, index: int, block: nn.Module) -> nn.Module:
        """Write block ``index`` and its record, then the progress saying it is done; the block is dropped."""
        if self.writes:
            record = self.writer.write_part(block_file(index), block, f"{self.stack}.{index}")
            write_file(self._record_path(index), lambda p: p.write_text(json.dumps(record)))
        barrier(self.shard)  # every process has the next block's inputs on disk
        if self.writes:
            state = {"fingerprint": self.fingerprint, "done": index}
            write_file(self.progress / _STATE_FILE, lambda p: p.write_text(json.dumps(state)))
        barrier(self.shard)
        for old in self.progress.glob(f"inputs-r{self.rank}-*"):
            if int(old.name.rsplit("-", 1)[1]) <= index:
                shutil.rmtree(old, ignore_errors=True)
        return BlockPlaceholder()

    def finalize(self, model: nn.Module, config: Config, hf_config: Any, count: int) -> None:
        """The rest of the model, the index, the config and the manifest; then the progress goes and the
        finished folder is moved to the output folder."""
        if self.writes:
            rest = self.writer.write_part(REST_FILE, model, skip=self.stack)
            blocks = [json.loads(self._record_path(index).read_text()) for index in range(count)]
            for index, record in enumerate(blocks):
                record.setdefault("file", block_file(index))
            self.writer.finish(model, config, [rest, *blocks], block_stack=self.stack)
            hf_config.save_pretrained(self.directory / FLOAT_MODEL_DIR)
        barrier(self.shard)
        if self.writes:
            shutil.rmtree(self.progress, ignore_errors=True)
            commit(self.directory, self.output)
        barrier(self.shard)


class ProgressStores(StoreFactory):
    """Activations of a block-by-block run: each block's inputs in the progress directory (kept for resuming,
    removed by the sink once the block is done); everything else as ``scratch`` says."""

    def __init__(self, sink: BlockCheckpoint, scratch: StoreFactory) -> None:
        super().__init__()
        self.sink, self.scratch = sink, scratch

    def create(self, label: str) -> ActivationStore:
        if label.startswith("hidden_"):
            directory = self.sink.inputs_dir(int(label.removeprefix("hidden_")))
            shutil.rmtree(directory, ignore_errors=True)  # a partial one from an interrupted run
            return ActivationStore(directory, keep=True)
        return self.scratch.create(label)

    def cleanup(self) -> None:
        self.scratch.cleanup()


def run_fingerprint(config: Config, hf_config: Any, folder: Path, stack: str, data: CalibrationData | None) -> str:
    """What must not change between an interrupted run and its resumption (the data's own identity is
    checked separately, on the first block's inputs)."""
    files = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors*"))
    world = data.shard.world_size if data is not None and data.shard is not None else 1
    text = json.dumps({"config": config.to_dict(), "model": hf_config.to_dict(), "files": files, "stack": stack,
                       "world_size": world, "quark_brevitas": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()

