"""The quantized blocks of a streamed checkpoint as a block source: each block rebuilt (the structure the
data-free steps leave in it, then the pipeline's structure phase on the block) and loaded from its own file just
before the block engine needs it.

It sits in the checkpoint room rather than with the engine's other sources (:mod:`quark_brevitas.blocks.disk`)
because it reads checkpoint files (checked against their recorded SHA-256) and restricts the checkpoint's saved
structure to one block (:func:`~quark_brevitas.pipeline.restrict_structure`); the engine imports neither.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quark_brevitas.algorithms import SavedStructure
from quark_brevitas.blocks.disk import block_file, random_fill
from quark_brevitas.blocks.protocol import BlockStep, UnitRebuilder
from quark_brevitas.blocks.sources import BlockPlaceholder, BlockSource
from quark_brevitas.brevitas_adapter import ignore_missing_keys, load_quant_model_mode
from quark_brevitas.checkpoint.files import checksums, read_safetensors
from quark_brevitas.pipeline import restrict_structure

__all__ = ["CheckpointBlocks", "read_block_file"]


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
