"""Algorithms that work one decoder layer (block) at a time: the handler base class.

Quark's LLM algorithms (SmoothQuant, AWQ, GPTQ) reason about one decoder layer at a time: which layers read the
same input, which norm precedes them, how the layer's output changes. :class:`BlockwiseHandler` states that
once: :meth:`~BlockwiseHandler.blocks` names the blocks of a model (:mod:`quark_brevitas.algorithms.structure`, whose
stack comes from the one stack finder :func:`quark_brevitas.blocks.stack.find_block_stack`), and
:meth:`~BlockwiseHandler.apply_block` runs the algorithm on one block given a :class:`CalibrationData` whose
batches are that block's inputs. Names in the algorithm's config are relative to the block, so a block knows
everything it needs.

There is one walker over blocks, :class:`~quark_brevitas.blocks.engine.BlockwiseEngine`. In the pipeline's
block-by-block data phase (the default for models made of blocks) it calls :meth:`~BlockwiseHandler.apply_unit`
on each block, whose inputs are the outputs of the earlier blocks as quantized (weights and activations), as
in llm-compressor's sequential pipeline. On the whole-model path (:meth:`~BlockwiseHandler.apply`:
``blocks=False``, or :func:`~quark_brevitas.algorithms.apply_algorithm`) the same engine runs this one
algorithm on each block: the first block's inputs are captured by running the model up to it, and each
processed block's outputs, computed under :meth:`~BlockwiseHandler.inputs_context`, feed the next block when
the stack is chained (:func:`~quark_brevitas.blocks.capture.blocks_are_chained`); otherwise each block's inputs
are captured with a pass of the model up to it (quadratic in depth).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from quark_brevitas.algorithms.base import AlgorithmHandler
from quark_brevitas.algorithms.structure import (
    ScalingGroup,
    Structure,
    infer_scaling_layers,
    is_linear,
    model_structure,
)
from quark_brevitas.blocks.capture import blocks_are_chained
from quark_brevitas.blocks.engine import BlockwiseEngine
from quark_brevitas.brevitas_adapter import int_weight_format, int_weight_formats_remembered
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.errors import ConfigError

__all__ = ["BlockwiseHandler"]


@contextlib.contextmanager
def _nothing(_model: nn.Module) -> Iterator[None]:
    yield


class BlockwiseHandler(AlgorithmHandler):
    """A handler whose algorithm runs one decoder layer (block) at a time; see the module docstring.

    Subclasses implement :meth:`apply_block`; :attr:`needs_scaling_layers` says whether the algorithm needs scaling
    groups (SmoothQuant, AWQ) and :meth:`inputs_context` under which quantization state a block's inputs are
    computed (the previous blocks' outputs).
    """

    #: Whether the algorithm folds scales and therefore needs scaling groups (given or inferred).
    needs_scaling_layers: ClassVar[bool] = False

    def structure(self, algo: Any, model: nn.Module) -> Structure:
        """The decoder layers, embeddings and scaling groups the algorithm works on: its config's explicit
        fields, the rest inferred from ``model`` (raises :class:`ConfigError` naming the field)."""
        return model_structure(model, decoder_layers=algo.model_decoder_layers,
                               scaling_layers=getattr(algo, "scaling_layers", None),
                               embedding_layers=getattr(algo, "embedding_layers", None), path=type(algo).__name__,
                               want_scaling=self.needs_scaling_layers)

    def blocks(self, algo: Any, model: nn.Module) -> list[str]:
        """The qualified names of the blocks the algorithm runs on, in order (``""``: the model is one block)."""
        return list(self.structure(algo, model).blocks)

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        return self.structure(algo, model).describe(with_scaling=self.needs_scaling_layers)

    def scaling_groups(self, algo: Any, block: nn.Module) -> tuple[ScalingGroup, ...]:
        """The block's scaling groups: the config's, or those inferred from the block."""
        if getattr(algo, "scaling_layers", None) is not None:
            return tuple(ScalingGroup.from_quark(entry) for entry in algo.scaling_layers)
        return infer_scaling_layers(block)[0]

    def sequential_layers(self, algo: Any, block: nn.Module, name: str) -> tuple[str, dict[str, nn.Module],
                                                                                dict[str, int]]:
        """``(where, layers, input features per layer)`` of a block that a GPTQ-like algorithm optimises layer
        group by layer group (``inside_layer_modules``, or every quantized Linear), the block set to eval mode;
        ``where`` names the block in messages."""
        from quark_brevitas.algorithms.scaling import linear_weight

        where = f"decoder layer {name!r}" if name else type(block).__name__
        block.eval()
        layers = self.quantized_layers(algo, block, where, algo.inside_layer_modules, "inside_layer_modules")
        return where, layers, {n: int(linear_weight(m).shape[1]) for n, m in layers.items()}

    def quantized_layers(self, algo: Any, block: nn.Module, where: str, names: list[str] | None = None,
                         field: str = "") -> dict[str, nn.Module]:
        """The Linear-like layers of ``block`` with an integer weight quantizer (or those ``names``, which must be
        such layers; ``field`` names the config field they come from), checked against the config's ``bit`` and
        ``group_size`` where set (they restate the weight spec; ``None``: as each layer's quantizer says)."""
        what = type(algo).__name__
        modules = dict(block.named_modules())
        if names is None:
            layers = {n: m for n, m in modules.items() if n and is_linear(m) and int_weight_format(m) is not None}
        else:
            layers = {}
            for index, name in enumerate(names):
                layer = modules.get(name)
                if layer is None or not is_linear(layer) or int_weight_format(layer) is None:
                    problem = "not a module" if layer is None else \
                        "not a Linear-like layer with an integer weight quantizer (excluded, or left in float)"
                    raise ConfigError(f"{what}.{field}[{index}]", f"{name!r} is {problem} of {where}")
                layers[name] = layer
        restated_bit, restated_group = getattr(algo, "bit", None), getattr(algo, "group_size", None)
        for name, layer in layers.items():
            bit_width, group_size, _ = int_weight_format(layer)
            if restated_bit is not None and bit_width != algo.bit:
                raise ConfigError(f"{what}.bit", f"{algo.bit}, but in {where} {name} quantizes its weight to "
                                                 f"{bit_width} bits (set bit={bit_width}, or exclude the layer)")
            if restated_group is not None and group_size != algo.group_size:
                raise ConfigError(f"{what}.group_size", f"{algo.group_size}, but in {where} {name}'s weight "
                                                        f"quantizer has group size {group_size} (-1: no groups)")
        return layers

    def inputs_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The quantization state under which a block's inputs (the earlier blocks' outputs) are computed."""
        return _nothing(model)

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        """Run the algorithm on ``block`` (called ``name`` in the model; ``""`` for a model that is one block),
        whose inputs are the batches of ``data``; return the block."""
        raise NotImplementedError

    def apply_unit(self, algo: Any, unit: nn.Module, data: CalibrationData | None, name: str, *,
                   block: bool) -> nn.Module:
        """In the pipeline's block-by-block engine: :meth:`apply_block` on a block with its cached inputs (the
        engine already chains the blocks); layers outside the blocks are left alone, as :meth:`apply` leaves
        them (these algorithms work on decoder layers)."""
        if block:
            with int_weight_formats_remembered():  # each layer's format read once per block (see there)
                self.apply_block(algo, unit, data, name)
        return unit

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """The whole-model path (the pipeline's engine is off: ``blocks=False``, or a stack it cannot walk).

        Run :meth:`apply_block` on every block of ``model``, in order, each on its inputs as the model computes
        them with the blocks before it already processed, through the block engine (see the module docstring)."""
        model.eval()
        structure = self.structure(algo, model)
        if structure.decoder_layers is None:
            with int_weight_formats_remembered():
                self.apply_block(algo, model, data, "")
            return model
        stack = model.get_submodule(structure.decoder_layers)
        chained = len(stack) == 1 or blocks_are_chained(model, list(stack), data, f"{algo.name}: decoder layers")
        engine = BlockwiseEngine(_OneAlgorithm(self, algo), model, structure.decoder_layers, data,
                                 inputs_context=self.inputs_context, chained=chained)
        return engine.run()


class _OneAlgorithm:
    """One algorithm as the block engine's :class:`~quark_brevitas.blocks.protocol.UnitQuantizer`: it runs on
    each block and quantizes no layer outside the blocks."""

    def __init__(self, handler: BlockwiseHandler, algo: Any) -> None:
        self.handler, self.algo = handler, algo

    def quantize_unit(self, unit: nn.Module, name: str, data: CalibrationData | None, *,
                      block: bool = True) -> nn.Module:
        return self.handler.apply_unit(self.algo, unit, data, name, block=block)

    def quantized_layers(self, model: nn.Module) -> list[str]:
        return []
