"""What the block engine needs from whoever quantizes the blocks (the pipeline, or one algorithm).

The engine walks blocks and moves activations; it does not know what a config is. It asks a
:class:`UnitQuantizer` to process one unit (a block, or a layer outside the blocks inside its holder) and which
layers of the model are quantized at all (to find those outside the blocks). Streaming's checkpoint source
also rebuilds units without data (:class:`UnitRebuilder`). Stating this as a Protocol keeps the engine free of
an import of the pipeline (which imports the engine) and lets the LLM algorithms' whole-model path drive the
same engine with one algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from quark_brevitas.calibration.data import CalibrationData

__all__ = ["BlockStep", "Branches", "UnitQuantizer", "UnitRebuilder"]

#: What a data-free step does to one block of a streamed model when it is loaded (a block source runs it; the
#: algorithms make it, :meth:`~quark_brevitas.algorithms.AlgorithmHandler.apply_streamed`):
#: ``step(block, qualified_name)`` returns the block (the same module, or one that replaces it).
BlockStep = Callable[[nn.Module, str], nn.Module]


class UnitQuantizer(Protocol):
    """Processes one part of the model at a time for :class:`~quark_brevitas.blocks.engine.BlockwiseEngine`."""

    def quantize_unit(self, unit: nn.Module, name: str, data: CalibrationData | None, *,
                      block: bool = True) -> nn.Module:
        """Process ``unit`` (a block called ``name``; or, with ``block=False``, a holder of one layer outside the
        blocks, ``name`` being the holder's place) on its cached inputs ``data``; return what replaces it."""
        ...

    def quantized_layers(self, model: nn.Module) -> list[str]:
        """The qualified names of ``model``'s layers that get quantized, in model order."""
        ...


class UnitRebuilder(Protocol):
    """Rebuilds one part of a quantized model without data (loading a checkpoint block by block)."""

    def rebuild_unit(self, unit: nn.Module, name: str, saved: Any) -> nn.Module:
        """The quantized structure of ``unit`` (called ``name``) as recorded in ``saved``."""
        ...


@runtime_checkable
class Branches(Protocol):
    """A container whose children are independent branches of one computation (the experts of a mixture-of-experts
    block, :class:`~quark_brevitas.model_parts.moe.UnfusedExperts`, which implements it structurally:
    ``model_parts`` lies below ``blocks``): each child is called at most once per call of the container, in
    order, on an input computed from the container's inputs alone, never from another child's output. An
    algorithm whose passes read only some children's layers (GPTQ's, expert by expert) can then run those
    children alone on their own inputs instead of the container, and the others not at all: the layers see the
    very same inputs.
    """

    def branch_inputs(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The ``(args, kwargs)`` child ``index`` is called with when the container is called with ``(args,
        kwargs)``, or ``None`` when that call does not call the child."""
        ...
