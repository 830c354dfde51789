"""Which ``nn.ModuleList`` holds a model's repeated blocks: the one stack finder.

The pipeline's block-by-block data phase, the LLM algorithms (SmoothQuant, AWQ, GPTQ: ``model_decoder_layers``)
and streaming all ask the same question; :func:`find_block_stack` is the one answer (a stack it searches for, or
one the user named, checked), so they cannot disagree. :func:`detect_block_stack` is the same search with the
pipeline's policy for walking a model block by block without being told to (Hugging Face models with at least two
blocks); what a run's ``blocks=`` argument and its config choose is decided above the engine
(:func:`quark_brevitas.orchestration.block_runs.choose_block_stack`, which calls these two).
:func:`outside_layers` lists the quantized layers that are not in the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from quark_brevitas.blocks.protocol import UnitQuantizer
from quark_brevitas.config.families import BLOCK_STACK_PATHS
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["BLOCK_STACK_PATHS", "detect_block_stack", "find_block_stack", "is_hugging_face", "outside_layers",
           "resolve_block_stack", "stack_blocks"]

# Where model families keep their blocks (Llama, Mistral, Qwen2 ``model.layers``, OPT ``model.decoder.layers``, GPT-2
# ``transformer.h``, BERT ``encoder.layer``, then generic spellings): the family table of the config package, so
# that the LLM templates and this finder read one table. A model that is not a Hugging Face model has its stack
# found only at one of these paths (any ModuleList of one class could be anything there); a Hugging Face
# model's one stack is found wherever it is.


def is_hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked by name: no transformers import)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def _candidates(model: nn.Module) -> list[str]:
    """The outermost ModuleLists of modules of one class that hold parameters, in model order."""
    stacks: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or len({type(m) for m in module}) != 1:
            continue
        if any(name.startswith(outer + ".") for outer in stacks):
            continue
        if any(True for _ in module.parameters()):
            stacks.append(name)
    return stacks


def find_block_stack(model: nn.Module, named: str | None = None) -> str | None:
    """The qualified name of the ``nn.ModuleList`` holding ``model``'s repeated blocks, or ``None``.

    ``named`` (what the user or an algorithm's ``model_decoder_layers`` named): that submodule, checked to be a
    non-empty ``nn.ModuleList`` (a :class:`~quark_brevitas.errors.ModelError` otherwise). Without it the stack is
    searched for: an outermost ModuleList of modules of one class holding parameters. A Hugging Face model must
    have exactly one (encoder-decoder and multimodal models, with several, are ambiguous: name one with
    ``blocks=`` or ``model_decoder_layers``); another model's stack must also sit at one of
    :data:`BLOCK_STACK_PATHS` (the first path of the table that matches wins).
    """
    if named is not None:
        return _checked_stack(model, named)
    stacks = _candidates(model)
    if is_hugging_face(model):
        if len(stacks) != 1:
            logger.debug("%s: %d candidate block stacks (%s); one is needed", type(model).__name__, len(stacks),
                         ", ".join(stacks) or "none")
            return None
        return stacks[0]
    for path in BLOCK_STACK_PATHS:
        for name in stacks:
            if name == path or name.endswith(f".{path}"):
                return name
    return None


def _checked_stack(model: nn.Module, named: str) -> str:
    try:
        stack = model.get_submodule(named)
    except AttributeError:
        raise ModelError(f"blocks / model_decoder_layers {named!r}: {type(model).__name__} has no submodule of "
                         "that name; name the nn.ModuleList holding the repeated blocks, e.g. 'model.layers'"
                         ) from None
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        raise ModelError(f"blocks / model_decoder_layers {named!r} is a {type(stack).__name__}; it must name a "
                         "non-empty nn.ModuleList of blocks")
    return named


def detect_block_stack(model: nn.Module) -> str | None:
    """The stack the pipeline walks block by block when it is not told which (``blocks=None``): the stack of a
    Hugging Face model with at least two blocks; ``None`` otherwise (the whole-model path)."""
    if not is_hugging_face(model):
        return None
    found = find_block_stack(model)
    if found is None or len(model.get_submodule(found)) < 2:
        return None
    return found


def stack_blocks(model: nn.Module, stack: str | None) -> list[tuple[str, nn.Module]]:
    """The blocks of ``stack`` with their qualified names; ``[("", model)]`` without a stack (the model is
    then one block)."""
    if stack is None:
        return [("", model)]
    return [(f"{stack}.{name}", block) for name, block in model.get_submodule(stack).named_children()]


def outside_layers(quantizer: UnitQuantizer, model: nn.Module, stack: str) -> dict[str, nn.Module]:
    """The layers outside the block stack ``stack`` that ``quantizer``'s config quantizes, in model order (the
    engine quantizes them one at a time; a streamed checkpoint rebuilds them)."""
    modules = dict(model.named_modules())
    inside = stack + "."
    return {name: modules[name] for name in quantizer.quantized_layers(model)
            if name and name != stack and not name.startswith(inside)}


def resolve_block_stack(model: nn.Module, blocks: str | bool | None, decoder_layers: Sequence[str] = ()) -> str | None:
    """The block stack ``blocks`` asks for in ``model``, or ``None`` for the whole-model path (the finder's policy
    for a run; :func:`~quark_brevitas.orchestration.block_runs.choose_block_stack` adds what the config allows).

    ``blocks``: ``None`` (detect: Quark's ``model_decoder_layers`` of an algorithm config if one names it, else
    :func:`detect_block_stack`), ``True`` (detect, and fail if nothing is found), ``False`` (whole model), or the
    qualified name of the ``nn.ModuleList`` of blocks. ``decoder_layers``: the ``model_decoder_layers`` values of the
    config's algorithms, which must agree.
    """
    if blocks is False:
        return None
    named = blocks if isinstance(blocks, str) else None
    if named is None and decoder_layers:
        if len(set(decoder_layers)) > 1:
            raise ModelError(f"the algorithms name different decoder layers ({sorted(set(decoder_layers))}); "
                             "model_decoder_layers must agree")
        named = decoder_layers[0]
    if named is not None:
        return find_block_stack(model, named)
    stack = detect_block_stack(model)
    if stack is None and blocks is True:
        raise ModelError(f"blocks=True but no stack of repeated blocks was found in {type(model).__name__}; "
                         "name the nn.ModuleList of blocks, e.g. blocks='model.layers'")
    return stack
