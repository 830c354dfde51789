"""Loading a block-by-block checkpoint without its float model: the model rebuilt from the Hugging Face config the
checkpoint records (:func:`quantized_skeleton`), and its quantized blocks as a block source (:class:`CheckpointBlocks`):
each block rebuilt (the structure the data-free steps leave in it, then the pipeline's structure phase on the block)
and loaded from its own file just before it is needed, by the block engine (streamed evaluation, streamed export) or
by :func:`load_pretrained_quantized` (the whole quantized model, checked against the manifest like
:func:`~quark_brevitas.checkpoint.load_quantized`).

It sits in the checkpoint room rather than with the engine's other sources (:mod:`quark_brevitas.blocks.disk`)
because it reads checkpoint files (checked against their recorded SHA-256) and restricts the checkpoint's saved
structure to one block (:func:`~quark_brevitas.pipeline.restrict_structure`); the engine imports neither.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms import SavedStructure
from quark_brevitas.blocks.disk import block_file, load_skeleton, random_fill, tie_embeddings
from quark_brevitas.blocks.protocol import BlockStep, UnitRebuilder
from quark_brevitas.blocks.sources import BlockPlaceholder, BlockSource, SoloLayer
from quark_brevitas.blocks.stack import outside_layers
from quark_brevitas.brevitas_adapter import ignore_missing_keys, load_quant_model_mode
from quark_brevitas.checkpoint.files import checksums, read_checkpoint, read_safetensors
from quark_brevitas.checkpoint.load import check_state, check_structure
from quark_brevitas.checkpoint.manifest import CHECKSUMS_KEY, FLOAT_MODEL_DIR, REST_FILE, CheckpointError
from quark_brevitas.container import Container
from quark_brevitas.orchestration.block_runs import prepare_streamed
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE, Pipeline, restrict_structure

__all__ = ["CheckpointBlocks", "load_pretrained_quantized", "quantized_skeleton", "read_block_file"]

logger = logging.getLogger(__name__)


def read_block_file(path: Path, name: str, checksum: str | None) -> dict[str, torch.Tensor]:
    """A block's tensors from its file (checked against its recorded SHA-256), with the block's name taken off
    the keys."""
    return {key.removeprefix(name + "."): tensor for key, tensor in read_safetensors(path, checksum).items()}



class CheckpointBlocks(BlockSource):
    """The quantized blocks of a streamed checkpoint, each rebuilt (the structure the data-free steps leave in it,
    ``prepare``, then the pipeline's structure phase on the block) and loaded just before it is needed; dropped
    after unless ``keep``."""

    def __init__(self, rebuilder: UnitRebuilder, directory: Path, stack: str, saved: SavedStructure,
                 keep: bool, prepare: BlockStep | None = None) -> None:
        self.rebuilder, self.directory, self.stack, self.saved, self.keep = rebuilder, directory, stack, saved, keep
        self.prepare = prepare
        self.releases = not keep
        self.checksums: dict[str, str] = checksums(directory)

    def load(self, index: int, current: nn.Module) -> nn.Module:
        name = f"{self.stack}.{index}"
        random_fill(current, index)
        if self.prepare is not None:
            current = self.prepare(current, name)
        block = self.rebuilder.rebuild_unit(current, name, restrict_structure(self.saved, name, name))
        state = read_block_file(self.directory / block_file(index), name, self.checksums.get(block_file(index)))
        with ignore_missing_keys(), load_quant_model_mode(block):
            block.load_state_dict(state, strict=True)
        return block.eval()

    def finish(self, index: int, block: nn.Module) -> nn.Module:
        return block if self.keep else BlockPlaceholder()


def quantized_skeleton(directory: str | os.PathLike[str], container: Container | None,
                       keep: bool) -> tuple[nn.Module, str, CheckpointBlocks, Any]:
    """A block-by-block checkpoint's model with everything but the blocks rebuilt and loaded, its block stack, the
    source of its quantized blocks (dropped after use unless ``keep``) and the checkpoint's description."""
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
    tie_embeddings(model, hf_config)
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
    """The quantized model of a checkpoint written by :func:`~quark_brevitas.hf.streaming.quantize_pretrained`,
    rebuilt from the Hugging Face config it records one block at a time (no float weights needed) and checked
    against its manifest. Returns the model in eval mode, ready for ``generate()``."""
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
