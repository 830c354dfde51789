"""Qronos (Quark's ``QronosConfig``): GPTQ-like rounding that also corrects each layer for the error of its
already-quantized inputs, block by block.

Qronos (Zhang, Colbert et al., arXiv 2505.11695; Brevitas 0.13's ``brevitas.graph.qronos.Qronos``) rounds a layer's
weight ``w`` (one row per output channel) to ``q`` minimising ``||X_f w - X_q q||^2``, where ``X_q`` is the
layer's input as the quantized model computes it and ``X_f`` as the float model computes it. With
``H = X_q^T X_q / n`` and ``G = X_f^T X_q / n`` (Brevitas's definitions), in processing order:

1. the first column is rounded from its least-squares target with the other columns at their float values,
   ``t_0 = (w G[:, 0] - w_{1:} H[0, 1:]) / H[0, 0]``, onto the layer's grid: ``q_0``;
2. the remaining columns are re-solved in closed form for ``q_0``:
   ``w_{1:} <- (w (G + d I)[:, 1:] - q_0 H[0, 1:]) (H + d I)[1:, 1:]^-1`` with ``d = alpha * lambda_max(H)``;
3. they are then rounded column by column with GPTQ's error diffusion on ``(H + d I)[1:, 1:]`` (the same column
   update as :class:`~quark_brevitas.algorithms.gptq.GPTQConfigHandler`, started at column 1; ``beta`` stabilises
   the factor of the inverse as in Brevitas).

When ``X_f = X_q`` (so ``G = H``) step 1 gives ``t_0 = w_0`` and step 2 is GPTQ's own update for column 0: Qronos is
then GPTQ with the dampening ``d`` (checked in ``tests/algorithms/test_qronos.py``).

In the block engine a block's cached inputs are those the already-quantized earlier blocks produced; ``X_f`` is
the layer's input when the block runs in float (all its layers with their original weights, no quantization) on
those same inputs, and ``X_q`` its input with the block's earlier groups of layers already rounded (quantized
weights, float activations, as for GPTQ). Qronos therefore corrects, inside each block, the error the block's
earlier layers left in a layer's input; the error carried in from earlier blocks is in both ``X_f`` and ``X_q``.
Statistics are collected like GPTQConfig's (one pass per group of layers reading the same input; the rest of the
block is skipped) and combined across processes with ``data.all_reduce``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import register
from quark_brevitas.algorithms.gptq import (
    ColumnRounding,
    GPTQConfigHandler,
    GPTQResult,
    HessianPass,
    inverse_hessian_factor,
    warn_few_samples,
)
from quark_brevitas.algorithms.scaling import layer_inputs, linear_weight, set_linear_weight
from quark_brevitas.algorithms.structure import is_linear
from quark_brevitas.blocks.capture import UntilStopped
from quark_brevitas.brevitas_adapter import (
    StopFwdException,
    int_weight_format,
    layer_outputs_remembered,
    quantization_disabled,
    weight_grid,
)
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.rounding import QronosConfig
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["QronosConfigHandler", "qronos_columns"]

#: Power-iteration steps for the largest eigenvalue of ``H`` (as Brevitas's Qronos).
_POWER_STEPS = 30


def largest_eigenvalue(matrix: torch.Tensor, steps: int = _POWER_STEPS) -> torch.Tensor:
    """The largest eigenvalue of a symmetric positive semi-definite ``matrix`` by power iteration from a fixed
    start (deterministic), as Brevitas's Qronos estimates its dampening."""
    generator = torch.Generator(device=matrix.device).manual_seed(0)
    vector = torch.rand(matrix.shape[0], dtype=matrix.dtype, device=matrix.device, generator=generator)
    for _ in range(steps):
        vector = matrix @ vector
        vector = vector / vector.norm().clamp_min(1e-30)
    return vector @ (matrix @ vector)


def qronos_columns(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, grid_for: Any, *,
                   alpha: float, beta: float, act_order: bool, group_size: int, static_groups: bool,
                   block_size: int) -> GPTQResult:
    """Qronos on one ``[out, in]`` weight: ``hessian`` is ``X_q^T X_q / n``, ``cross`` is ``X_f^T X_q / n`` (see the
    module docstring for the three steps); ``grid_for`` as in :func:`~quark_brevitas.algorithms.gptq.gptq_columns`."""
    state, hessian = ColumnRounding.start(weight, hessian, grid_for, act_order=act_order, group_size=group_size,
                                          static_groups=static_groups)
    perm = state.perm
    target = weight.detach().float()[:, perm]  # the float weight the float inputs multiply
    cross = cross.detach().float()[perm][:, perm]
    damp = alpha * largest_eigenvalue(hessian)
    factor = inverse_hessian_factor(hessian, damp, stabilise=beta, what="Qronos")
    first = (target @ cross[:, 0] - state.work[:, 1:] @ hessian[0, 1:]) / hessian[0, 0]
    if state.dynamic:
        state.groups_started.add(int(perm[0]) // group_size)
    rounded = state.grid.quantize(first[:, None], slice(0, 1))[:, 0]
    state.quantized[:, 0] = rounded
    state.work[:, 0] = rounded
    rest = target @ cross[:, 1:] + damp * target[:, 1:] - rounded[:, None] * hessian[0, 1:][None, :]
    upper = factor[1:, 1:]  # (H + d I)[1:, 1:]^-1 = upper^T upper (see inverse_hessian_factor)
    state.work[:, 1:] = (rest @ upper.t()) @ upper
    state.round_from(1, factor, block_size)
    return state.result()


@dataclass
class _CrossPass(HessianPass):
    """GPTQ's pass (``H`` per layer, the group of layers, stopping early) plus ``G = X_f^T X_q``: the float stage of
    each batch queues every call's float input rows (:meth:`add_float`), the quantized stage pairs each call's rows
    with the float rows of the same call (:meth:`add`)."""

    crosses: dict[str, torch.Tensor] = field(default_factory=dict)
    float_rows: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    float_calls: dict[str, int] = field(default_factory=dict)
    shortcut: bool = False  # every layer's own call pairs its quantized rows with its float rows

    def add_float(self, name: str, rows: torch.Tensor, _raw: Any) -> None:
        if self.group is not None and name not in self.group:
            return
        self.float_rows[name].append(rows)
        self.float_calls[name] = self.float_calls.get(name, 0) + 1
        if self.group is not None and all(self.float_calls.get(n, 0) >= c for n, c in self.calls_per_batch.items()):
            raise StopFwdException

    def add(self, name: str, rows: torch.Tensor, raw: Any) -> None:
        if self.group is None or name in self.group:
            queued = self.float_rows[name]
            if not queued or queued[0].shape != rows.shape:
                raise ModelError(f"QronosConfig: {name}'s input in the float block does not match its quantized "
                                 "input call for call (the block must call its layers the same way both times)")
            product = queued.pop(0).t() @ rows
            if name in self.crosses:
                self.crosses[name] += product
            else:
                self.crosses[name] = product
        super().add(name, rows, raw)

    def start_batch(self) -> None:
        self.float_rows.clear()
        self.float_calls = {}

    def batch_done(self, index: int, output: Any) -> None:
        super().batch_done(index, output)
        for name in [n for n in self.crosses if self.group is not None and n not in self.group]:
            del self.crosses[name]


class _FloatThenQuantized(nn.Module):
    """The block run twice per batch: its float twin (a copy of the block with the original weights, made once per
    block, quantization off for the whole block: nothing to switch or copy per batch) queues the float inputs of
    the layers still to round, then the block as quantized so far collects ``H`` and ``G`` (each pass stops
    early once the group's layers have been called). While no layer of the block is rounded yet, a layer's float
    input is its quantized input (activations are not quantized), so the float run is skipped and each input
    counts as both."""

    def __init__(self, block: nn.Module, collected: _CrossPass, remaining: dict[str, nn.Module],
                 done: dict[str, nn.Module], twin: nn.Module) -> None:
        super().__init__()
        self.block, self.twin = block, twin
        self.collected, self.remaining, self.done = collected, remaining, done

    def _both(self, name: str, rows: torch.Tensor, raw: Any) -> None:
        with contextlib.suppress(StopFwdException):  # the float stage's stop; add() stops the pass itself
            self.collected.add_float(name, rows, raw)
        self.collected.add(name, rows, raw)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.collected.start_batch()
        if not self.done:
            with layer_inputs(self.remaining, self._both):
                return self.block(*args, **kwargs)
        twin_layers = {name: self.twin.get_submodule(name) for name in self.remaining}
        with layer_inputs(twin_layers, self.collected.add_float), contextlib.suppress(StopFwdException):
            self.twin(*args, **kwargs)
        with layer_inputs(self.remaining, self.collected.add):
            return self.block(*args, **kwargs)


@register(QronosConfig)
class QronosConfigHandler(GPTQConfigHandler):
    """Qronos block by block; see the module docstring. Earlier blocks compute a block's inputs as for GPTQ
    (quantized weights, float activations)."""

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        lines = super(GPTQConfigHandler, self).describe(algo, model)
        names = self.blocks(algo, model)
        block = model.get_submodule(names[0]) if names[0] else model
        layers = algo.inside_layer_modules or [n for n, m in block.named_modules() if n and is_linear(m)]
        how = "given" if algo.inside_layer_modules else "inferred: the Linear-like layers of a block"
        return [*lines, f"layers per block ({how}; groups of layers reading the same input, one after the other, "
                        f"each corrected for its input's error in the float block): {', '.join(layers) or '-'}"]

    def _round(self, algo: Any, layer: nn.Module, hessian: torch.Tensor, cross: torch.Tensor) -> float:
        weight = linear_weight(layer).detach().clone()
        result = qronos_columns(weight, hessian, cross, lambda tensor: weight_grid(layer, tensor), alpha=algo.alpha,
                                beta=algo.beta, act_order=algo.desc_act,
                                group_size=int_weight_format(layer).group_size, static_groups=algo.static_groups,
                                block_size=algo.block_size)
        if not result.on_grid:
            raise ModelError("QronosConfig: the layer's weight quantizer computes each group's scale from the other "
                             "groups too (e.g. MSE scales); use static_groups=True")
        set_linear_weight(layer, result.quantized)
        return result.loss

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        where, remaining, features = self.sequential_layers(algo, block, name)
        float_block = copy.deepcopy(block)  # the block in float, original weights (see _FloatThenQuantized)
        done: dict[str, nn.Module] = {}
        start = time.perf_counter()
        samples: dict[str, int] = {}
        # Memos (as GPTQConfig's): the float twin's layers never change, so after their first computation they
        # return what they computed; the block's layers, once rounded, likewise (the block engine's outputs pass
        # takes the block's memo over).
        with torch.no_grad(), quantization_disabled(block, act=True, weight=False, bias=False), \
                quantization_disabled(float_block), layer_outputs_remembered(block, hand_over=True) as memo, \
                layer_outputs_remembered(float_block) as float_memo:
            while remaining:
                collected = _CrossPass(True)
                twin = _FloatThenQuantized(block, collected, remaining, done, float_block)
                memo.new_pass()
                float_memo.new_pass()
                data.forward(UntilStopped(twin), f"{algo.name}: statistics of {name or where}",
                             on_output=collected.batch_done)
                if not collected.group:
                    raise ModelError(f"QronosConfig on {where}: none of {', '.join(remaining)} was called")
                memo.forget([remaining[layer_name] for layer_name in collected.group])
                for layer_name in collected.group:
                    samples[layer_name], (hessian, cross) = collected.averaged(data, layer_name, collected.crosses)
                    done[layer_name] = remaining.pop(layer_name)
                    loss = self._round(algo, done[layer_name], hessian, cross)
                    logger.debug("QronosConfig %s.%s: loss %.4g", name, layer_name, loss)
        warn_few_samples("QronosConfig", where, samples, features)
        logger.info("QronosConfig: %s done in %.2f s", name or where, time.perf_counter() - start)
        return block
