"""Tied parameters (one ``nn.Parameter`` used by several modules): kept tied, untied only when a step changes one.

Language models often tie the output projection to the input embedding (``lm_head.weight is
embed_tokens.weight``). Quantization keeps such ties: the backend gives a quantized layer the float
layer's own ``Parameter`` objects, so the embedding still reads the float weight and ``lm_head``
quantizes the same tensor on the fly, and QAT trains one tensor as the float model did.

A step that rewrites weights in place (GPTQ, GPFQ, bias correction, BatchNorm merging, equalization)
must not change the other owners behind their back. :func:`run_untied` runs such a step with every tie
that involves a quantized layer temporarily broken (each owner but one gets its own copy); afterwards,
ties whose copies are still equal are restored, and the others stay untied with a warning naming the
layers. :func:`untie_differing` does the same for a checkpoint whose tied tensors were saved with
different values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.brevitas_adapter import QuantLayer, swap_parameter

logger = logging.getLogger(__name__)

__all__ = ["TiedGroup", "run_untied", "tied_groups", "untie_differing"]


@dataclass(frozen=True)
class TiedGroup:
    """The owners of one shared parameter, as ``(module name, attribute)`` pairs; the keeper (first) is
    the owner that holds the original ``Parameter`` while the group is untied (a float module if any)."""

    owners: tuple[tuple[str, str], ...]

    def names(self) -> list[str]:
        return [f"{module}.{attr}" if module else attr for module, attr in self.owners]


def tied_groups(model: nn.Module, *, quantized_only: bool = True) -> list[TiedGroup]:
    """Every parameter owned by more than one module (or attribute); with ``quantized_only`` only the
    groups that involve a quantized layer."""
    by_id: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                by_id.setdefault(id(param), []).append((name, attr, module))
    groups = []
    for owners in by_id.values():
        unique = list({(name, attr): module for name, attr, module in owners}.items())
        if len(unique) < 2:
            continue
        if quantized_only and not any(isinstance(module, QuantLayer) for _, module in unique):
            continue
        unique.sort(key=lambda item: isinstance(item[1], QuantLayer))  # a float owner keeps the original
        groups.append(TiedGroup(tuple(key for key, _ in unique)))
    return groups


def _param(model: nn.Module, owner: tuple[str, str]) -> nn.Parameter:
    return getattr(model.get_submodule(owner[0]), owner[1])


def _set(model: nn.Module, owner: tuple[str, str], param: nn.Parameter) -> None:
    swap_parameter(model.get_submodule(owner[0]), owner[1], param)


def _untie(model: nn.Module, group: TiedGroup) -> None:
    original = _param(model, group.owners[0])
    for owner in group.owners[1:]:
        _set(model, owner, nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))


def _exists(model: nn.Module, owner: tuple[str, str]) -> bool:
    try:
        return isinstance(getattr(model.get_submodule(owner[0]), owner[1], None), nn.Parameter)
    except AttributeError:
        return False


def run_untied(model: nn.Module, step: str, apply: Callable[[Any, nn.Module, Any], nn.Module], algo: Any,
               data: Any) -> nn.Module:
    """``apply(algo, model, data)`` (an algorithm handler's ``apply``) with the ties of quantized layers
    broken while it runs (see the module docstring).

    Returns what ``apply`` returns. Ties whose owners still hold equal values afterwards are restored; the
    others are reported (one warning per group, naming ``step`` and the owners).
    """
    groups = tied_groups(model)
    for group in groups:
        _untie(model, group)
    result = apply(algo, model, data)
    for group in groups:
        if not all(_exists(result, owner) for owner in group.owners):
            continue  # the step restructured the model; the owners are gone or renamed
        keeper = _param(result, group.owners[0])
        changed = [owner for owner in group.owners[1:] if not torch.equal(_param(result, owner), keeper)]
        if not changed:
            for owner in group.owners[1:]:
                _set(result, owner, keeper)
            continue
        kept = ", ".join(TiedGroup(tuple(o for o in group.owners if o not in changed)).names())
        logger.warning("%s changed %s, which was tied to %s: they are untied now (%s keeps the values %s gave it, "
                       "%s its own)", step, ", ".join(TiedGroup(tuple(changed)).names()), kept,
                       ", ".join(TiedGroup(tuple(changed)).names()), step, kept)
    return result


def untie_differing(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Untie the groups of ``model`` whose tensors in ``state`` (a state dict about to be loaded) differ:
    the model they were saved from had untied them (e.g. GPTQ changed ``lm_head`` but not the embedding)."""
    for group in tied_groups(model, quantized_only=False):
        values = [state.get(name) for name in group.names()]
        if any(v is None for v in values) or all(torch.equal(values[0], v) for v in values[1:]):
            continue
        _untie(model, group)
        logger.debug("untied %s: the checkpoint holds different values for them", ", ".join(group.names()))
