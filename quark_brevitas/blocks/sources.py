"""Where the block engine takes each block from (a *source*) and where each finished block goes (a *sink*).

A run of the block engine is one code path whatever its blocks' origin and destination; only these two objects
differ. Sources: :class:`BlockSource` works on the model's own blocks in place; :class:`CopiedBlocks` copies each
block of the caller's model just before it is quantized (the caller's model is never modified, and no float copy
of the whole model is made); blocks read from a Hugging Face safetensors folder
(:class:`~quark_brevitas.blocks.disk.FolderBlocks`) or rebuilt from a block-by-block checkpoint
(:class:`~quark_brevitas.checkpoint.streamed_blocks.CheckpointBlocks`) hold their place in the model with a
:class:`BlockPlaceholder` until they are needed. Sinks: :class:`BlockSink` keeps the finished block in the model
(a run in memory); :class:`~quark_brevitas.checkpoint.writer.BlockCheckpoint` writes it into a checkpoint and
drops it. A layer outside the blocks is processed alone inside a :class:`SoloLayer`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from quark_brevitas.errors import ModelError

__all__ = ["BlockPlaceholder", "BlockSink", "BlockSource", "CopiedBlocks", "SoloLayer", "copy_without_blocks"]


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


class BlockSink:
    """Where a finished block goes (after its outputs are cached, before the source's :meth:`BlockSource.finish`).

    The default keeps it in the model: the run ends with the quantized model in memory. A sink that writes each
    block out (a block-by-block checkpoint) returns a :class:`BlockPlaceholder` instead and sets
    :attr:`releases`."""

    #: Whether :meth:`finish` drops the block (the engine then frees its memory at once).
    releases = False

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


class BlockPlaceholder(nn.Module):
    """Holds a block's place in a model whose blocks are elsewhere (not loaded yet, or written out)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelError("a block that is not loaded was called")


class SoloLayer(nn.Module):
    """One layer outside the blocks, under its own attribute name, as a unit of the data phase (so that the
    config resolves it with its full name and algorithms that wrap layers can wrap it)."""

    def __init__(self, attribute: str, layer: nn.Module) -> None:
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, layer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.attribute)(*args, **kwargs)


def copy_without_blocks(model: nn.Module, stack_name: str) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of ``model`` whose blocks are placeholders, and the original blocks (not copied)."""
    stack = model.get_submodule(stack_name)
    originals = list(stack)
    memo: dict[int, Any] = {id(block): BlockPlaceholder() for block in originals}
    return copy.deepcopy(model, memo), originals
