"""Which ``nn.ModuleList`` holds a model's repeated blocks: the one stack finder.

The pipeline's run (in memory and streamed from a folder), the LLM algorithms (SmoothQuant, AWQ, GPTQ:
``model_decoder_layers``), ``plan --model`` and the LLM command all ask the same question; :func:`find_block_stack`
is the one answer, so they cannot disagree. What differs between them is a parameter, not another function: the
stack a user or an algorithm named (checked), whether one is required, the search's :class:`StackPolicy` (the
algorithms search any model; a run walks block by block unasked only a Hugging Face model with at least two blocks,
:data:`RUN_STACK`), and why the caller's config cannot walk the stack it finds (``obstacle``; the orchestration
above the engine says why, from the algorithms, :func:`quark_brevitas.orchestration.block_runs.blockwise_obstacle`).
:func:`outside_layers` lists the quantized layers that are not in the blocks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import NamedTuple

from torch import nn

from quark_brevitas.blocks.protocol import UnitQuantizer
from quark_brevitas.config.families import BLOCK_STACK_PATHS
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["ANY_STACK", "BLOCK_STACK_PATHS", "RUN_STACK", "StackPolicy", "find_block_stack", "is_hugging_face",
           "outside_layers", "resolve_block_stack", "stack_blocks"]

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


class StackPolicy(NamedTuple):
    """Which stack a search accepts when none is named (a named stack is only checked)."""

    #: Search only Hugging Face models (another model keeps the whole-model path unless its stack is named).
    hugging_face_only: bool = False
    #: A stack with fewer blocks is not walked (one block: the whole model is as cheap).
    min_blocks: int = 1


#: The algorithms' search (``model_decoder_layers`` unset): any model's stack.
ANY_STACK = StackPolicy()
#: What a run walks block by block without being told to: the stack of a Hugging Face model with at least two blocks.
RUN_STACK = StackPolicy(hugging_face_only=True, min_blocks=2)


def find_block_stack(model: nn.Module, blocks: str | bool | None = None, decoder_layers: Sequence[str] = (), *,
                     policy: StackPolicy = ANY_STACK, obstacle: str | None = None) -> str | None:
    """The qualified name of the ``nn.ModuleList`` holding ``model``'s repeated blocks, or ``None``.

    ``blocks``: the qualified name of the stack (checked to be a non-empty ``nn.ModuleList``, a
    :class:`~quark_brevitas.errors.ModelError` otherwise), ``None`` (search), ``True`` (search, and fail if nothing is
    found) or ``False`` (no stack). ``decoder_layers``: the ``model_decoder_layers`` the config's algorithms name
    (Quark's field; they must agree), the stack when ``blocks`` names none. The search (``policy``): an outermost
    ModuleList of modules of one class holding parameters; a Hugging Face model must have exactly one (encoder-decoder
    and multimodal models, with several, are ambiguous: name one), another model's stack must sit at one of
    :data:`BLOCK_STACK_PATHS` (the first path of the table that matches wins). ``obstacle``: why the caller cannot walk
    the stack it finds (its config's algorithms); the stack is then declined (``None``, logged), or refused with a
    :class:`~quark_brevitas.errors.ModelError` when ``blocks`` named or required it.
    """
    if blocks is False:
        return None
    named = blocks if isinstance(blocks, str) else None
    if named is None and decoder_layers:
        if len(set(decoder_layers)) > 1:
            raise ModelError(f"the algorithms name different decoder layers ({sorted(set(decoder_layers))}); "
                             "model_decoder_layers must agree")
        named = decoder_layers[0]
    stack = _checked_stack(model, named) if named is not None else _search(model, policy)
    if stack is None and blocks is True:
        raise ModelError(f"blocks=True but no stack of repeated blocks was found in {type(model).__name__}; "
                         "name the nn.ModuleList of blocks, e.g. blocks='model.layers'")
    if stack is not None and obstacle is not None:
        if isinstance(blocks, str) or blocks is True:
            raise ModelError(f"blocks={blocks!r}: cannot calibrate block by block: {obstacle}")
        logger.info("Calibrating the whole model at once: %s", obstacle)
        return None
    return stack


def _search(model: nn.Module, policy: StackPolicy) -> str | None:
    hugging_face = is_hugging_face(model)
    if policy.hugging_face_only and not hugging_face:
        return None
    stacks = _candidates(model)
    found: str | None = None
    if hugging_face:
        if len(stacks) == 1:
            found = stacks[0]
        else:
            logger.debug("%s: %d candidate block stacks (%s); one is needed", type(model).__name__, len(stacks),
                         ", ".join(stacks) or "none")
    else:
        found = next((name for path in BLOCK_STACK_PATHS for name in stacks
                      if name == path or name.endswith(f".{path}")), None)
    if found is not None and len(model.get_submodule(found)) < policy.min_blocks:
        return None
    return found


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
    """Deprecated since 0.4.0 (it was public as ``quark_brevitas.blockwise.resolve_block_stack``): the one finder
    with a run's policy, ``find_block_stack(model, blocks, decoder_layers, policy=RUN_STACK)``."""
    warnings.warn("quark_brevitas.blocks.stack.resolve_block_stack is deprecated since quark_brevitas 0.4.0; call "
                  "quark_brevitas.blocks.stack.find_block_stack(model, blocks, decoder_layers, policy=RUN_STACK)",
                  DeprecationWarning, stacklevel=2)
    return find_block_stack(model, blocks, decoder_layers, policy=RUN_STACK)
