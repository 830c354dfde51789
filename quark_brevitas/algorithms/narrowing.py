"""Where GPTQ's next pass runs: the smallest part of a block that holds every layer left to round, on that part's
own inputs (issue 30: mixture-of-experts blocks block by block in bounded memory).

GPTQ rounds a block's layers group by group, each group after a pass over the block's calibration inputs that
stops at the group. Once the layers left all lie inside one submodule (a decoder layer's MLP, a mixture-of-experts
block's experts), everything the block computes before that submodule is final: its inputs are the same in every
later pass. :class:`Narrowing` then captures those inputs in one pass and runs the later passes on the submodule
alone. The layers see the very same inputs (the same computation, done once), so the Hessians and the rounded
weights are those of passes over the whole block, bit for bit; what changes is that nothing before the submodule
is computed again. In a block with experts, nothing the layers outside computed is kept in memory either
(:func:`~quark_brevitas.brevitas_adapter.layer_outputs_remembered` drops it; the capture pass and the block
engine's outputs pass compute it again); a dense block keeps it for those two passes (:attr:`Narrowing.bounded`).

A container of independent branches (:class:`~quark_brevitas.blocks.protocol.Branches`: the experts of
:class:`~quark_brevitas.model_parts.moe.UnfusedExperts`) is entered one child at a time: each expert runs alone on the
rows routed to it, computed from the experts' inputs when a pass asks for them, and the other experts not at all.
Walked expert by expert, a pass never computes the experts already rounded (the whole-block passes computed all
of them before reaching the one being rounded, or kept every expert's outputs to skip them: memory that grew
with the number of experts), and the cached inputs of the block and of its experts module are all that is held.

A submodule is entered only where it is called exactly once in the first batch (the capture checks it, running
that batch whole); otherwise the passes stay on the enclosing part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.capture import UntilStopped
from quark_brevitas.blocks.protocol import Branches
from quark_brevitas.brevitas_adapter import LayerOutputs, StopFwdException
from quark_brevitas.calibration.data import BlockInputs, CalibrationData, map_tensors

logger = logging.getLogger(__name__)

__all__ = ["Narrowing", "PassUnit"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class PassUnit:
    """A part of the block GPTQ's passes run on: ``path`` relative to the block (``""``: the block itself),
    ``data`` its inputs; ``call(position)`` gives batch ``position``'s ``(args, kwargs)`` (``None`` for the
    block, whose batches only its data reads)."""

    path: str
    module: nn.Module
    data: CalibrationData
    call: Callable[[int], Call] | None = None


def _inside(path: str, unit: str) -> bool:
    """Whether the module at ``path`` is the module at ``unit`` or inside it."""
    return not unit or path == unit or path.startswith(f"{unit}.")


def holder(names: Iterable[str]) -> str:
    """The deepest module that holds every layer named (relative paths; ``""``: the block)."""
    parents = [name.rpartition(".")[0].split(".") for name in names]
    common: list[str] = []
    for parts in zip(*parents):
        if len(set(parts)) != 1 or not parts[0]:
            break
        common.append(parts[0])
    return ".".join(common)


class Narrowing:
    """The stack of parts GPTQ's passes run on, the block at the bottom (see the module docstring)."""

    def __init__(self, block: nn.Module, data: CalibrationData, name: str) -> None:
        self.block = block
        self.name = name
        self.parent = data
        self.stack = [PassUnit("", block, data)]
        self.modules = dict(block.named_modules())
        #: A block with experts runs in bounded memory: what the layers outside the part being worked on computed
        #: is dropped (recomputed once by the pass that captures the part's inputs and by the block engine's
        #: outputs pass). A dense block keeps it, for those two passes (its passes after narrowing are few, and
        #: the reuse saves computing the attention's projections twice more).
        self.bounded = any(isinstance(module, Branches) for module in self.modules.values())

    @property
    def unit(self) -> PassUnit:
        return self.stack[-1]

    def outputs_reused(self, remaining: list[str]) -> bool:
        """Whether what the current pass computes may be reused once only ``remaining`` are left to round: not
        when :meth:`narrow` would then leave the current part (the next pass runs elsewhere), nor after an
        expert's last pass (the block's outputs pass would reuse one expert's outputs out of many: recomputing
        them is cheaper than holding them, which for an expert fed every token is a whole calibration set's)."""
        if not self.bounded:
            return True
        if not remaining:
            return not any(isinstance(unit.module, Branches) for unit in self.stack)
        return holder(remaining) == self.unit.path and not isinstance(self.unit.module, Branches)

    def narrow(self, remaining: Iterable[str], memo: LayerOutputs) -> None:
        """Move to the smallest part holding every layer of ``remaining`` that can be entered (see the module
        docstring); the memo drops what the layers outside it computed."""
        names = list(remaining)
        if not names:
            return
        target = holder(names)
        before = self.unit
        # Leave the parts that do not hold the layers left; an expert with layers left is kept (the experts module
        # holds the others, entered one after the other).
        while not _inside(target, self.unit.path) and not any(_inside(name, self.unit.path) for name in names):
            self.stack.pop()
        while True:
            unit = self.unit
            if isinstance(unit.module, Branches) and unit.call is not None:
                if not self._enter_branch(unit, names):
                    break
                continue
            point = self._entry_point(unit.path, target)
            if point is None or not self._capture(unit, point, memo):
                break
        if self.unit is not before:
            if self.bounded:
                memo.keep_only(module for _, module in self.unit.module.named_modules())
            logger.debug("GPTQConfig %s: passes run on %s", self.name, self.unit.path or "the block")

    def _entry_point(self, path: str, target: str) -> str | None:
        """The next part to enter from ``path`` towards ``target``: the first container of branches on the way
        (entered child by child), else ``target`` itself; ``None`` when ``target`` is ``path``."""
        if target == path or not _inside(target, path):  # there already, or in a child of a container
            return None
        parts = target.split(".")
        start = len(path.split(".")) if path else 0
        for end in range(start + 1, len(parts) + 1):
            candidate = ".".join(parts[:end])
            if isinstance(self.modules.get(candidate), Branches):
                return candidate
        return target

    def _capture(self, unit: PassUnit, point: str, memo: LayerOutputs) -> bool:
        """One pass of ``unit`` that records ``point``'s inputs in each batch, stopping there from the second
        batch on (the first runs whole, to count the calls); enters ``point`` if the first batch called it once."""
        module = self.modules[point]
        first: list[Call] = []
        later: list[Call] = []
        batches = [0]

        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = (map_tensors(args, torch.Tensor.detach), map_tensors(kwargs, torch.Tensor.detach))
            if batches[0] == 0:
                first.append(call)
                return
            later.append(call)
            raise StopFwdException  # nothing after it is needed in this batch

        def batch_done(_index: int, _output: Any) -> None:
            batches[0] += 1

        memo.new_pass(keep_new=not self.bounded)  # reused by the block's outputs pass only (see bounded)
        handle = module.register_forward_pre_hook(record, with_kwargs=True)
        try:
            unit.data.forward(UntilStopped(unit.module), f"GPTQConfig: inputs of {self._label(point)}",
                              on_output=batch_done)
        finally:
            handle.remove()
        if len(first) != 1:
            logger.debug("GPTQConfig %s: %s is called %d times in the first batch; passes stay on %s", self.name,
                         point, len(first), unit.path or "the block")
            return False
        calls = first + later
        # The layers left all lie in ``point`` from now on (they only get fewer): the parts between the block and
        # it are not run again, and their inputs are dropped; a container of branches stays, for its next child.
        self.stack[1:] = [unit for unit in self.stack[1:] if isinstance(unit.module, Branches)]
        self.stack.append(PassUnit(point, module, BlockInputs.of(calls, self.parent, self._label(point)),
                                   calls.__getitem__))
        return True

    def _label(self, path: str) -> str:
        return f"{self.name}.{path}" if self.name else path

    def _enter_branch(self, unit: PassUnit, names: list[str]) -> bool:
        """Enter the first child of the container ``unit`` holding a layer of ``names``, on its own inputs."""
        prefix = f"{unit.path}." if unit.path else ""
        children = [name[len(prefix):].split(".", 1)[0] for name in names if name.startswith(prefix)]
        indices = sorted(int(child) for child in children if child.isdigit())
        if not indices or len(indices) != len(children):
            return False
        index = indices[0]
        container: Any = unit.module
        child = container[index]
        source = unit.call
        assert source is not None
        positions = [position for position in range(len(unit.data))
                     if container.branch_inputs(index, *source(position)) is not None]
        if not positions:
            return False

        def call(position: int) -> Call:
            inputs = container.branch_inputs(index, *source(positions[position]))
            assert inputs is not None  # the same inputs as when the positions were listed
            return inputs

        path = f"{prefix}{index}"
        self.stack.append(PassUnit(path, child, BlockInputs(call, len(positions), self.parent, self._label(path)),
                                   call))
        return True
