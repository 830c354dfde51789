"""GPTQ (Quark's ``GPTQConfig``): Hessians of a group of layers in one pass, a vectorised column update on
Brevitas's own weight grid.

Per decoder layer (block): the layers that read the same input (q/k/v, o, gate/up, down) form a group, found on
the first batch from the objects the layers are called with; one pass of the block's inputs collects the
Hessians ``H = X^T X / n`` of a whole group, then each layer's weight is rounded column by column, the rounding
error being compensated on the columns not yet rounded with the inverse Hessian (Frantar et al., in AutoGPTQ's
blocked form: rank-1 updates inside blocks of ``block_size`` columns, 128 by default, one matrix product
between blocks; the block size changes speed and memory, not the result). With
``true_sequential`` the next group's Hessians are collected with the previous groups already quantized.

Each layer is computed about once per batch (issue 32): a pass for a group that reads one input stops at the
group's first call (:class:`HessianPass`), and layers rounded in an earlier pass return the outputs they computed
then (:func:`~quark_brevitas.brevitas_adapter.layer_outputs_remembered`, handed over to the block engine's pass
for the block's outputs, which then computes only the last group again). The weights are those of recomputing
everything, bit for bit.

Columns are rounded with the layer's own Brevitas weight quantizer's scale and zero point
(:func:`quark_brevitas.brevitas_adapter.weight_grid`), so the result lies exactly on the grid Brevitas uses at
inference: after GPTQ, the layer's quantized weight equals GPTQ's output bit for bit. ``static_groups=False``
takes each group's scale from the error-updated weights when GPTQ reaches the group's first column (AutoGPTQ's
default); with ``desc_act`` AutoGPTQ would also regroup the columns in processing order, which needs a
column-to-group index that Brevitas and ONNX do not have, so groups stay consecutive input channels, as the
weight spec says.

A layer that sees fewer calibration tokens than it has input features has a rank-deficient Hessian, and GPTQ
may then do worse than rounding to nearest: a warning says how many tokens it needs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from quark_brevitas.algorithms.base import register
from quark_brevitas.algorithms.blocks import BlockwiseHandler
from quark_brevitas.algorithms.column_kernel import round_columns
from quark_brevitas.algorithms.hessians import HessianPass
from quark_brevitas.algorithms.magr import magnitude_reduced
from quark_brevitas.algorithms.narrowing import Narrowing
from quark_brevitas.algorithms.scaling import layer_inputs, linear_weight, set_linear_weight
from quark_brevitas.algorithms.structure import is_linear
from quark_brevitas.blocks.capture import UntilStopped
from quark_brevitas.brevitas_adapter import (
    WeightGrid,
    int_weight_format,
    layer_outputs_remembered,
    quantization_disabled,
    weight_grid,
)
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.calibration.stacking import Stacked, stacked_batches
from quark_brevitas.config.algorithms import GPTQConfig
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["ColumnRounding", "GPTQConfigHandler", "GPTQResult", "HessianPass", "gptq_columns",
           "inverse_hessian_factor", "warn_few_samples"]

#: Columns per lazy-update block (AutoGPTQ's default).
BLOCK_SIZE = 128


class GPTQResult(NamedTuple):
    """``quantized``: the rounded weight (``[out, in]``, original column order); ``scale_source``: the tensor the
    quantizer's grid was last initialised from (for static groups the weight before GPTQ); ``loss``: the sum of
    GPTQ's per-column losses; ``on_grid``: whether the quantizer's final grid is the one the columns were rounded
    on (False when a group's scale depends on the other groups' values, e.g. MSE scales, with dynamic groups)."""

    quantized: torch.Tensor
    scale_source: torch.Tensor
    loss: float
    on_grid: bool = True


def inverse_hessian_factor(hessian: torch.Tensor, damp: float | torch.Tensor, *, stabilise: float = 1.0,
                           what: str = "GPTQ") -> torch.Tensor:
    """The upper Cholesky factor ``U`` of ``(H + damp I)^-1 = U^T U``, with ``damp`` raised tenfold (up to three
    times) if ``H + damp I`` is still not positive definite. ``stabilise`` multiplies the inverse before its
    factorisation and divides the factor by its square root (Qronos's ``beta``: the same factor, computed on
    larger numbers). Rows ``k:`` of ``U`` restricted to columns ``k:`` are the factor of the inverse of
    ``(H + damp I)[k:, k:]``, which is what lets an update start at any column."""
    for attempt in range(4):
        # H + damp * I without an identity matrix, value for value: off the diagonal H + 0.0 (which turns -0.0
        # into 0.0, as adding damp * 0 does), on it H + damp.
        damped = hessian + 0.0
        damped.diagonal().add_(damp)
        factor, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            del factor  # matrices of the Hessian's size held at once: the largest of GPTQ's working set
            upper, info = torch.linalg.cholesky_ex(inverse * stabilise if stabilise != 1.0 else inverse, upper=True)
            if int(info) == 0:
                return upper / stabilise ** 0.5 if stabilise != 1.0 else upper  # x * 1.0 and x / 1.0 are x
        logger.warning("%s: the dampened Hessian is not positive definite (damp %.3g); retrying with %.3g", what,
                       float(damp), float(damp * 10))
        damp = damp * 10 if attempt < 3 else damp
    raise ModelError(f"{what}: the layer's Hessian is not positive definite even with 1000x the dampening; its "
                     "inputs are degenerate (give more, and more varied, calibration data)")


@dataclass
class ColumnRounding:
    """The state of a column-by-column rounding (GPTQ, and Qronos after its first column), in processing order.

    ``work``: the weight being rounded, columns permuted (``perm``: processing order -> input channel); ``grid``:
    the layer's grid, permuted alike; ``quantized``: the rounded columns so far; ``scale_source``: what the
    quantizer's grid was last initialised from (original order); ``dynamic`` groups take their scale from ``work``
    when the first of their columns is reached (``grid_for(tensor) -> WeightGrid`` re-initialises the grid).
    """

    work: torch.Tensor
    grid: WeightGrid
    perm: torch.Tensor
    inverse_perm: torch.Tensor
    scale_source: torch.Tensor
    grid_for: Any
    group_size: int
    dynamic: bool
    quantized: torch.Tensor
    losses: torch.Tensor
    groups_started: set[int] = field(default_factory=set)
    #: Dynamic groups: the grid ``grid_for`` last returned, which it computed from ``scale_source`` as it still is
    #: (each group's start writes the group's values there and re-initialises the grid from it).
    last_grid: WeightGrid | None = None

    @classmethod
    def start(cls, weight: torch.Tensor, hessian: torch.Tensor, grid_for: Any, *, act_order: bool, group_size: int,
              static_groups: bool) -> tuple[ColumnRounding, torch.Tensor]:
        """The state for ``weight`` (``[out, in]``) and the Hessian of its inputs (returned permuted, with dead
        inputs' diagonal set to 1 and their weight columns to 0).

        With dynamic groups the group of the first column in processing order counts as started: its grid from
        the weight as updated so far is this first grid (nothing is updated before that column)."""
        work = weight.detach().float().clone()
        hessian = hessian.detach().float()
        dead = torch.diag(hessian) == 0
        if bool(dead.any()):  # the caller's Hessian is not changed (nor copied when nothing needs changing)
            hessian = hessian.clone()
            hessian[dead, dead] = 1
            work[:, dead] = 0
        first: WeightGrid = grid_for(work)
        scale_source = work.clone()
        columns = work.shape[1]
        perm = torch.argsort(torch.diag(hessian), descending=True) if act_order else torch.arange(columns)
        grid = first._replace(scale=first.scale[:, perm].clone(), zero_point=first.zero_point[:, perm].clone())
        if act_order:  # in processing order (without act_order that is the order they are in: no copies)
            work, hessian = work[:, perm], hessian[perm][:, perm]
        dynamic = group_size > 0 and not static_groups
        state = cls(work, grid, perm, torch.argsort(perm), scale_source, grid_for, group_size, dynamic,
                    torch.zeros_like(work), torch.zeros(work.shape[0], dtype=work.dtype, device=work.device),
                    {int(perm[0]) // group_size} if dynamic else set(), first)
        return state, hessian

    def group_starts(self) -> set[int]:
        """Dynamic groups: the columns (processing order) at which a group is first reached, worked out once from
        the permutation rather than looked up per column (a tensor index and a set lookup for each of them)."""
        if not self.dynamic:
            return set()
        starts, seen = set(), set(self.groups_started)
        for column, channel in enumerate(self.perm.tolist()):
            if channel // self.group_size not in seen:
                seen.add(channel // self.group_size)
                starts.add(column)
        return starts

    def _start_group(self, column: int, block: torch.Tensor, offset: int, stop: int) -> bool:
        """Dynamic groups: the grid of ``column``'s group from the weight as updated so far (``block``: the
        current block's columns, ``offset`` the column's place in it); whether the group started here.

        The group's columns (all at ``column`` or later in processing order: ``column`` is the first of them)
        take their current values, from the block or, past it, from the weight; they are written into
        ``scale_source`` and the quantizer is re-initialised from that, its other groups holding the values they
        started with (a group's scale depends on its own values; :meth:`result` checks that the final grid is
        the one the columns were rounded on). The last group's start thus leaves the quantizer initialised from
        the final ``scale_source``."""
        group = int(self.perm[column]) // self.group_size
        if group in self.groups_started:
            return False
        self.groups_started.add(group)
        members = torch.arange(group * self.group_size, min((group + 1) * self.group_size, self.work.shape[1]))
        positions = self.inverse_perm[members]
        values = self.work[:, positions]
        inside = positions < stop
        values[:, inside] = block[:, positions[inside] - (column - offset)]
        self.scale_source[:, members] = values
        fresh = self.grid_for(self.scale_source)
        self.grid.scale[:, positions] = fresh.scale[:, members]
        self.grid.zero_point[:, positions] = fresh.zero_point[:, members]
        self.last_grid = fresh
        return True

    def round_from(self, first_column: int, factor: torch.Tensor, block_size: int) -> None:
        """Round columns ``first_column:`` (in processing order), compensating each column's error on the
        columns not yet rounded with ``factor`` (:func:`inverse_hessian_factor`): rank-1 updates inside blocks of
        ``block_size`` columns, one matrix product between blocks (AutoGPTQ's lazy batch). Inside a block the
        columns go through :func:`~quark_brevitas.algorithms.column_kernel.round_columns` (NumPy, the same
        operations) when the grid rounds and clamps as Brevitas's plain quantizer does and everything is float32
        on the CPU; otherwise through torch."""
        columns = self.work.shape[1]
        starts = self.group_starts()
        numpy_loop = self._numpy_loop(factor)
        for start in range(first_column, columns, block_size):
            stop = min(start + block_size, columns)
            if numpy_loop:
                block_error, block_delta = self._round_block_numpy(start, stop, factor, starts)
            else:
                block_error, block_delta = self._round_block_torch(start, stop, factor, starts)
            diagonal = factor[start:stop, start:stop].diagonal()
            self.losses += (block_delta ** 2 / diagonal[None, :] ** 2 / 2).sum(dim=1)
            self.work[:, stop:] -= block_error @ factor[start:stop, stop:]

    def _numpy_loop(self, factor: torch.Tensor) -> bool:
        tensors = (self.work, self.grid.scale, self.grid.zero_point, factor, self.grid.min_int, self.grid.max_int)
        return self.grid.plain_rounding() and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                  for t in tensors)

    def _round_block_torch(self, start: int, stop: int, factor: torch.Tensor, starts: set[int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns ``start:stop`` with torch operations: the block's errors and rounding deltas ``[out, width]``."""
        quantize = self.grid.column_quantizer()
        block = self.work[:, start:stop].clone()
        block_error = torch.zeros_like(block)
        block_delta = torch.empty_like(block)
        block_factor = factor[start:stop, start:stop]
        diagonal = block_factor.diagonal()
        # Views into the grid, sliced once per block: a dynamic group's fresh scale written into the grid by
        # _start_group shows through them.
        scale, zero_point = self.grid.scale[:, start:stop], self.grid.zero_point[:, start:stop]
        rounded_block = self.quantized[:, start:stop]
        width = stop - start
        for offset in range(width):
            column = start + offset
            if column in starts:
                self._start_group(column, block, offset, stop)
            values = block[:, offset]
            rounded = quantize(values, scale[:, offset], zero_point[:, offset])
            rounded_block[:, offset] = rounded
            delta = torch.sub(values, rounded, out=block_delta[:, offset])
            error = torch.div(delta, diagonal[offset], out=block_error[:, offset])
            if offset + 1 < width:  # the rounded column itself is not read again: only the later ones
                block[:, offset + 1:].sub_(error[:, None] * block_factor[offset, offset + 1:][None, :])
        return block_error, block_delta

    def _round_block_numpy(self, start: int, stop: int, factor: torch.Tensor, starts: set[int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_round_block_torch` through :func:`round_columns` on transposed copies (``[width, out]``),
        stopping where a dynamic group starts to take its grid from the block as updated so far."""
        values = self.work[:, start:stop].t().contiguous()
        scale = self.grid.scale[:, start:stop].t().contiguous()
        zero_point = self.grid.zero_point[:, start:stop].t().contiguous()
        rounded, delta, error = (torch.empty_like(values) for _ in range(3))
        block_factor = factor[start:stop, start:stop]
        low, high = float(self.grid.min_int), float(self.grid.max_int)
        width = stop - start
        cuts = sorted({0, width, *(column - start for column in starts if start <= column < stop)})
        for first, last in zip(cuts, cuts[1:]):
            if start + first in starts and self._start_group(start + first, values.t(), first, stop):
                scale[first:] = self.grid.scale[:, start + first:stop].t()
                zero_point[first:] = self.grid.zero_point[:, start + first:stop].t()
            round_columns(values, scale, zero_point, low, high, block_factor, rounded, delta, error, first, last)
        self.quantized[:, start:stop] = rounded.t()
        return error.t().contiguous(), delta.t().contiguous()

    def result(self) -> GPTQResult:
        """The rounded weight in the original column order; with dynamic groups, whether the quantizer keeps the
        grid the groups were rounded on (it does if groups' scales are independent of each other)."""
        on_grid = True
        if self.dynamic:
            final = self.last_grid if self.last_grid is not None else self.grid_for(self.scale_source)
            on_grid = torch.equal(final.scale[:, self.perm], self.grid.scale) and \
                torch.equal(final.zero_point[:, self.perm], self.grid.zero_point)
        return GPTQResult(self.quantized[:, self.inverse_perm], self.scale_source, float(self.losses.sum()), on_grid)


def gptq_columns(weight: torch.Tensor, hessian: torch.Tensor, grid_for: Any, *, damp_percent: float,
                 act_order: bool, group_size: int, static_groups: bool, block_size: int = BLOCK_SIZE,
                 damp: float | None = None, factors: dict[Any, Any] | None = None) -> GPTQResult:
    """GPTQ on one ``[out, in]`` weight with the Hessian of its inputs; ``grid_for(tensor) -> WeightGrid``
    initialises the layer's quantizer from ``tensor`` and returns its grid (see the module docstring). The
    dampening is ``damp_percent * mean(diag H)``, or ``damp`` when given (an absolute value).

    ``factors``: a dict shared by the layers of one group, which remembers the factor of the inverse Hessian per
    Hessian *object*: layers reading one input (q/k/v, gate/up) get the same Hessian tensor
    (:meth:`HessianPass.averaged`), hence the same factor, computed once."""
    state, permuted = ColumnRounding.start(weight, hessian, grid_for, act_order=act_order, group_size=group_size,
                                           static_groups=static_groups)
    if damp is None:
        damp = damp_percent * torch.mean(torch.diag(permuted))
    key = (id(hessian), act_order, float(damp))
    cached = factors.get(key) if factors is not None else None
    if cached is None or cached[0] is not hessian:
        cached = (hessian, inverse_hessian_factor(permuted, damp))
        if factors is not None:
            factors[key] = cached  # the Hessian is kept with it, so that its id is not reused meanwhile
    del permuted  # (a copy, with act_order or dead inputs) its factor is all the columns need
    state.round_from(0, cached[1], block_size)
    return state.result()


def warn_few_samples(algorithm: str, where: str, samples: dict[str, int], features: dict[str, int]) -> None:
    """Warn (once, listing the layers) when layers saw fewer calibration samples (tokens, or patches of a
    convolution) than they have input features: their Hessian is rank-deficient."""
    short = {name: (samples.get(name, 0), need) for name, need in features.items() if samples.get(name, 0) < need}
    if not short:
        return
    need = max(need for _, need in short.values())
    listed = ", ".join(f"{name} ({seen} < {need_})" for name, (seen, need_) in list(short.items())[:6])
    more = f" and {len(short) - 6} more" if len(short) > 6 else ""
    logger.warning("%s%s: %d layer(s) saw fewer calibration samples (input vectors: tokens, or convolution "
                   "patches) than they have input features: %s%s. Their input Hessian is rank-deficient and the "
                   "result may be worse than rounding to nearest; give at least %d samples (several times more is "
                   "better), e.g. more or longer calibration sequences", algorithm, f" on {where}" if where else "",
                   len(short), listed, more, need)


@register(GPTQConfig)
class GPTQConfigHandler(BlockwiseHandler):
    """GPTQ block by block; see the module docstring."""

    def inputs_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Earlier blocks run with their (GPTQ-rounded) quantized weights and float activations."""
        return quantization_disabled(model, act=True, weight=False, bias=False)

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        lines = super().describe(algo, model)
        names = self.blocks(algo, model)
        block = model.get_submodule(names[0]) if names[0] else model
        layers = algo.inside_layer_modules or [n for n, m in block.named_modules() if n and is_linear(m)]
        how = "given" if algo.inside_layer_modules else "inferred: the Linear-like layers of a block"
        order = "groups of layers reading the same input, one after the other" if algo.true_sequential else \
            "all at once"
        return [*lines, f"layers per block ({how}; {order}): {', '.join(layers) or '-'}"]

    def _quantize(self, algo: Any, name: str, layer: nn.Module, hessian: torch.Tensor,
                  factors: dict[Any, Any] | None = None) -> float:
        weight = linear_weight(layer).detach()  # gptq_columns rounds a copy (and magnitude_reduced returns one)
        group_size = int_weight_format(layer).group_size  # the layer's own (algo.group_size only restates it)
        if algo.magr_alpha is not None:  # rounded (and its grid chosen) from the magnitude-reduced weight
            weight = magnitude_reduced(weight, hessian, algo.magr_alpha, group_size)

        def run(static_groups: bool) -> GPTQResult:
            return gptq_columns(weight, hessian, lambda tensor: weight_grid(layer, tensor),
                                damp_percent=algo.damp_percent, act_order=algo.desc_act, group_size=group_size,
                                static_groups=static_groups, block_size=algo.block_size, factors=factors)

        result = run(algo.static_groups)
        if not result.on_grid:
            logger.warning("GPTQConfig: %s's weight quantizer computes each group's scale from the other groups too "
                           "(e.g. MSE scales), so static_groups=False cannot keep the grid GPTQ rounds on; using "
                           "static groups (scales from the weight before GPTQ) for it", name)
            result = run(True)
        set_linear_weight(layer, result.quantized)
        return result.loss

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        where, remaining, features = self.sequential_layers(algo, block, name)
        start = time.perf_counter()
        samples: dict[str, int] = {}
        # The memo: a pass recomputes only the layers rounded since the last one (and the block engine's pass for
        # the block's outputs only the last group), the others returning what they computed then. Once the layers
        # left lie in one part of the block (its MLP, one expert), the passes run on that part alone, on its
        # inputs captured once (Narrowing): nothing before it is computed again, or kept to be reused.
        narrowing = Narrowing(block, data, name)
        with torch.no_grad(), quantization_disabled(block, act=True, weight=False, bias=False), \
                layer_outputs_remembered(block, hand_over=True) as memo:
            # Batches stacked into a few calls (same Hessians, summed per batch): not when the user asked for
            # memory (no memo), nor for the whole-model path's single block, nor in a block with experts, which
            # runs in bounded memory (a stacked copy of the block's inputs, and calls of many batches' activations
            # at once, took the tiny MoE blocks of tests/algorithms/test_gptq_moe_memory.py from 1.5 to 3 times one
            # block; only its attention's passes would stack: the experts read routed rows, not the batch's).
            stacked = stacked_batches(data) if memo.budget > 0 and not narrowing.bounded else None
            if stacked is not None:  # the parts passes narrow to take their inputs from the stacked calls too
                narrowing = Narrowing(block, stacked.data, name)
            while remaining:
                collected = self._hessians(algo, narrowing, stacked, remaining, memo, name or where)
                if collected.unstackable:  # a layer reads rows that are not the batch's (e.g. routed tokens)
                    stacked = None
                    narrowing = Narrowing(block, data, name)  # the same part, its inputs captured batch by batch
                    narrowing.narrow(remaining, memo)
                    collected = self._hessians(algo, narrowing, None, remaining, memo, name or where)
                if not collected.group:
                    raise ModelError(f"GPTQConfig on {where}: none of {', '.join(remaining)} was called")
                memo.forget([remaining[layer_name] for layer_name in collected.group])
                factors: dict[Any, Any] = {}  # layers reading one input share one Hessian and its factor
                for layer_name in collected.group:
                    # The caller's shard; the sum (and, after the last layer sharing it, the average) not held
                    # while the columns of the layers after are rounded.
                    samples[layer_name], hessian = collected.taken(data, layer_name)
                    if all(cached[0] is not hessian for cached in factors.values()):
                        factors.clear()  # a Hessian of its own: the previous one's factor is not needed again
                    loss = self._quantize(algo, layer_name, remaining.pop(layer_name), hessian, factors)
                    logger.debug("GPTQConfig %s.%s: loss %.4g", name, layer_name, loss)
                if remaining and not algo.true_sequential:
                    raise ModelError(f"GPTQConfig on {where}: {', '.join(remaining)} was not called by the block")
                narrowing.narrow(remaining, memo)
        warn_few_samples("GPTQConfig", where, samples, features)
        logger.info("GPTQConfig: %s done in %.2f s", name or where, time.perf_counter() - start)
        return block

    @staticmethod
    def _hessians(algo: Any, narrowing: Narrowing, stacked: Stacked | None, remaining: dict[str, nn.Module],
                  memo: Any, where: str) -> HessianPass:
        """One pass over the inputs of the part the passes run on (``narrowing.unit``) collecting the next
        group's Hessians. ``stacked``: the block engine's batches stacked, from which ``narrowing`` then took the
        block's inputs (and a part's, captured one call per stacked call: the same rows per call, ``parts``)."""
        unit = narrowing.unit

        def group_known(group: list[str]) -> None:
            memo.keep_new = narrowing.outputs_reused([layer for layer in remaining if layer not in group])
            if not memo.keep_new:  # nothing later reuses what the memo holds (the next pass runs elsewhere)
                memo.keep_only(())

        collected = HessianPass(algo.true_sequential, on_group=group_known)
        if stacked is not None:
            collected.parts, collected.stacked_dims = stacked.parts, stacked.dims
        # Bounded memory (experts): the first batch, which runs the whole part, keeps nothing (not knowing yet
        # whether a later pass reuses it); group_known decides for the others.
        memo.new_pass(keep_new=not narrowing.bounded, unfinished=remaining.values())
        with layer_inputs(remaining, collected.add):
            unit.data.forward(
                UntilStopped(unit.module), f"{algo.name}: Hessians of {where}{'.' + unit.path if unit.path else ''}",
                on_output=collected.batch_done)
        return collected
