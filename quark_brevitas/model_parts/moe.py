"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE in transformers 5.x): their experts as Linear layers,
so that every expert's projections are quantized with scales of their own, and how many tokens reached each.

transformers 5.x stores a block's experts fused: one module (``MixtralExperts``, ``Qwen2MoeExperts``, ...) with
3-D parameters ``gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` and ``down_proj`` ``[experts, hidden,
intermediate]``, called as ``experts(hidden_states, top_k_index, top_k_weights)``. The layer map quantizes
``nn.Linear`` modules, so a fused module stays in float. :func:`unfuse_experts` is the documented conversion:
it replaces each fused module by :class:`UnfusedExperts`, a ``ModuleList`` of :class:`ExpertMLP` (``gate_proj``,
``up_proj``, ``down_proj`` Linear layers, the slices of the fused tensors) with the same call and the same
arithmetic (tested to give the fused module's output), so ``experts.3.down_proj`` is an ordinary layer for the
config, the algorithms and ``plan``. The router (``gate``) is not touched (Mixtral's is not a Linear layer; keep
Qwen2-MoE's ``shared_expert_gate`` in float with ``exclude``).

Each :class:`UnfusedExperts` counts the tokens routed to each expert (``tokens``); :func:`expert_coverage` reads
the counts and the pipeline logs them after calibrating a block. Routing leaves some experts unseen by the
calibration data (or nearly so): their input quantizers would stay uncalibrated and GPTQ would have no Hessian.
All-expert calibration (:mod:`quark_brevitas.model_parts.moe_calibration`, ``Config.moe_calibrate_all_experts``) marks
such experts in ``fill``: during the data phase they run on every token of the batch, so the hooks collecting
statistics and Hessians on their layers see every token, while the block's output still adds only their routed
tokens' rows (the rows of the same computation), weighted as the router says. ``filled`` counts the tokens so fed.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import torch
from torch import nn

from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["ExpertMLP", "UnfusedExperts", "expert_coverage", "log_expert_coverage", "unfuse_experts"]


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: Any) -> None:
        super().__init__()
        self.gate_proj = _linear(gate)
        self.up_proj = _linear(up)
        self.down_proj = _linear(down)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


class UnfusedExperts(nn.ModuleList):
    """A block's experts as a list of :class:`ExpertMLP`, called like transformers' fused experts module."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)
        self.register_buffer("tokens", torch.zeros(len(experts), dtype=torch.int64), persistent=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("filled", torch.zeros(len(experts), dtype=torch.int64), persistent=False)
        #: Experts that run on every token (all-expert calibration; set only during a data phase).
        self.fill: frozenset[int] = frozenset()
        #: From the routing pass before a data phase: tokens routed to each expert, tokens in all, the threshold.
        self.routed: list[int] | None = None
        self.block_tokens = 0
        self.fill_below = 0

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        self.seen += hidden_states.shape[0]
        for index, expert in enumerate(self):
            token, position = torch.where(top_k_index == index)
            self.tokens[index] += int(token.numel())
            expert_input = self._expert_input(index, hidden_states, token)
            if expert_input is None:
                continue
            computed = expert(expert_input)
            if token.numel() == 0:  # filled, no routed token: computed for the hooks on its layers only
                continue
            routed = (computed[token] if expert_input is hidden_states else computed) * \
                top_k_weights[token, position, None]
            out.index_add_(0, token, routed.to(out.dtype))
        return out

    def _expert_input(self, index: int, hidden_states: torch.Tensor, token: torch.Tensor) -> torch.Tensor | None:
        """What expert ``index`` computes on: its routed tokens' rows (``token``), or every row when it is filled
        (statistics and Hessian hooks on its layers then see every token; counted in ``filled``); ``None`` when
        it computes nothing."""
        if index in self.fill:
            self.filled[index] += hidden_states.shape[0]
            return hidden_states
        return hidden_states[token] if token.numel() else None

    def branch_inputs(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The input expert ``index`` computes on when this module is called with ``(args, kwargs)`` (the
        :class:`~quark_brevitas.blocks.protocol.Branches` protocol: GPTQ rounds the experts one at a time, each
        on its own inputs, without computing the others)."""
        bound = inspect.signature(self.forward).bind(*args, **kwargs).arguments
        token, _ = torch.where(bound["top_k_index"] == index)
        expert_input = self._expert_input(index, bound["hidden_states"], token)
        return None if expert_input is None else ((expert_input,), {})


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3):
        return False
    return list(inspect.signature(module.forward).parameters)[:3] == ["hidden_states", "top_k_index",
                                                                       "top_k_weights"]


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` by :class:`UnfusedExperts` (in place; see the module
    docstring); returns how many were replaced. A fused module with parameters beyond ``gate_up_proj`` /
    ``down_proj`` (biases) is refused: its arithmetic is not the one reproduced here."""
    count = 0
    for name, module in list(model.named_modules()):
        if not _is_fused_experts(module):
            continue
        extra = sorted(n for n, _ in module.named_parameters() if n not in ("gate_up_proj", "down_proj"))
        if extra:
            raise ModelError(f"{name}: fused experts with {extra} (biases) are not supported by unfuse_experts")
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        intermediate = gate_up.shape[1] // 2
        # One activation module per expert (a module shared by several parents has one name only).
        experts = [ExpertMLP(gate_up[e, :intermediate], gate_up[e, intermediate:], down[e],
                             copy.deepcopy(module.act_fn)) for e in range(gate_up.shape[0])]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, UnfusedExperts(experts))
        count += 1
    return count


def expert_coverage(model: nn.Module) -> dict[str, list[int]]:
    """Tokens routed to each expert since the counts were last reset, per experts module."""
    return {name: module.tokens.tolist() for name, module in model.named_modules()
            if isinstance(module, UnfusedExperts)}


def log_expert_coverage(model: nn.Module, prefix: str = "", reset: bool = True,
                        quiet: bool = False) -> dict[str, list[int]]:
    """Log the token routings per expert of ``model`` (warning for the experts no token reached; ``quiet``: no
    log) and reset the counts. The pipeline logs a block's counts after its data phase: routings of every
    forward pass of that phase (calibration and the algorithms' passes)."""
    coverage = expert_coverage(model)
    modules = {name: module for name, module in model.named_modules() if isinstance(module, UnfusedExperts)}
    for name, tokens in coverage.items() if not quiet else ():
        module = modules[name]
        where = f"{prefix}.{name}" if prefix and name else prefix or name
        if module.routed is None:  # no routing pass before this data phase: counts of all its passes
            logger.info("%s: token routings per expert during the data phase %s", where, tokens)
            unseen = [index for index, count in enumerate(tokens) if count == 0]
        else:
            fed = sorted(index for index in module.fill if int(module.filled[index]) > 0)
            how = (f"; all-expert calibration fed experts {fed} all {module.block_tokens} tokens (fewer than "
                   f"{module.fill_below} routed) for their statistics and Hessians" if fed else "")
            logger.info("%s: %d calibration tokens, token routings per expert %s%s", where, module.block_tokens,
                        module.routed, how)
            unseen = [index for index, count in enumerate(module.routed) if count == 0 and index not in fed]
        if unseen:
            logger.warning("%s: experts %s saw no calibration token (routing sent none there and all-expert "
                           "calibration, Config.moe_calibrate_all_experts, was off)", where, unseen)
    if reset:
        for module in modules.values():
            module.tokens.zero_()
            module.filled.zero_()
            module.seen.zero_()
    return coverage
