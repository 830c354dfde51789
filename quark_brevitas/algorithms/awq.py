"""AWQ (Quark's ``AWQConfig``; Lin et al., in AutoAWQ's form): activation-aware scales, then weight clipping.

Per decoder layer (block), on its cached inputs, with all quantization off except where a candidate is tried:

1. **Scale search**, per scaling group (a ``prev_op`` and the layers it feeds): for ``ratio`` in 0, 0.05, ...,
   0.95, the per-input-channel scales ``s = mean|X|^ratio`` (normalised to ``sqrt(max s * min s) = 1``) are
   tried by giving the group's layers the weights ``Q(W * s) / s`` (``Q``: the layer's own Brevitas weight
   quantizer, its grid initialised from ``W * s``) and measuring the output error of the group's
   ``module2inspect`` (e.g. ``self_attn`` for q/k/v, ``mlp`` for gate/up), or of the group's layers when it has
   none, against its float output, on all its calls recorded during one pass of the block's inputs (Quark's and
   AutoAWQ's measure). Measuring the whole block's output instead was tried: about 3.5 times the time for a
   slightly better choice (W4 all-MiniLM-L6-v2 with GPTQ after it: cosine 0.9728 instead of 0.9717). The best
   scales are folded into ``prev_op`` (a norm or a Linear-like layer) and the layers' input channels, which leaves
   the float function unchanged.
2. **Clip search**, per layer (except the q/k projections, whose error the attention scores amplify, as in
   AutoAWQ): for each output channel and weight group, the clipping range ``max|w| * (1 - i/20)`` for i in 0..9
   that minimises the layer's output error on up to 512 sampled input tokens; the weight is clamped to it.

Block by block, the statistics pass and every candidate's forwards run on the block's cached batches stacked into
a few calls (:mod:`quark_brevitas.algorithms.awq_stacking`), every sum still taken per original batch in the
original order, so the choices are those of the batch-by-batch run. A group none of whose layers is quantized is
not searched (its search could only choose ratio 0: unit scales, nothing folded).

Every weight quantizer of the block is then re-initialised from its final weight, so its grid is the one AWQ
measured. The algorithm runs after activation calibration: if the block has static activation quantizers, they
are calibrated again on the block's inputs (the folded scales changed what they see). Loss sums and statistics
are reduced over processes (``data.all_reduce``) so every process makes the same choices.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.awq_stacking import BatchTracker, CallLayout, NotPerRow, not_per_row
from quark_brevitas.algorithms.base import register
from quark_brevitas.algorithms.blocks import BlockwiseHandler
from quark_brevitas.algorithms.scaling import (
    ChannelStats,
    fold_scales,
    layer_inputs,
    linear_weight,
    set_linear_weight,
)
from quark_brevitas.algorithms.structure import ScalingGroup, check_scaling_groups, is_linear
from quark_brevitas.blocks.capture import CallRecorder, main_output
from quark_brevitas.brevitas_adapter import (
    candidate_quantizer,
    has_static_activation_quantizers,
    int_weight_format,
    plain_linear_forwards,
    quantization_disabled,
    restart_activation_statistics,
    weight_grid,
)
from quark_brevitas.calibration import calibrate, stacking
from quark_brevitas.calibration.data import CalibrationData, CalibrationDataError, call_model
from quark_brevitas.config.algorithms import AWQConfig

logger = logging.getLogger(__name__)

__all__ = ["AWQConfigHandler", "clip_search"]

#: Ratios tried by the scale search, and shrink steps of the clip search (AutoAWQ's n_grid = 20, max_shrink 0.5).
GRID = 20
CLIP_STEPS = 10
#: Input tokens per layer kept for the clip search (AutoAWQ's n_sample_token).
CLIP_TOKENS = 512
#: Layers whose name contains one of these are not clipped (AutoAWQ's avoid_clipping, plus GPT-2's fused c_attn).
NO_CLIPPING = ("q_", "k_", "query", "key", "Wqkv", "c_attn")
#: At most this many bytes of stacked hidden state per call of the statistics pass and the candidates' forwards
#: (never more than the engine's :data:`~quark_brevitas.calibration.stacking.STACK_BYTES`, so 0 there still turns
#: stacking off). Smaller than the engine's: each candidate's forward makes a dozen temporaries a few times the
#: hidden state (rotary embeddings, the MLP's products), and temporaries of a few MiB are returned to the system
#: and faulted in again on every operation (measured on the trained 4-block Llama, 256 wide, 128-token rows:
#: rotary embeddings at 16 rows per call 400-650 page faults per call, 3-4x the CPU time per row of 4 rows per
#: call, none; the whole AWQ run 20 s at 512 KiB against 25-27 s at 2 MiB, about 21 s at 256 KiB and 1 MiB).
STACK_BYTES = 512 * 2**10


def _inspected(group: ScalingGroup) -> list[str]:
    """The modules whose output error judges a group's scales: ``module2inspect`` (e.g. ``self_attn``, ``mlp``),
    or else the group's layers themselves (AutoAWQ's choice)."""
    return [group.module2inspect] if group.module2inspect else list(group.layers)


def _awq_scales(mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    scales = mean_abs.pow(ratio).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def _candidate_quantizer(layer: nn.Module, has_grid: bool | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function giving a weight as ``layer``'s Brevitas quantizer rounds it, with the grid initialised from that
    weight (a layer without an integer weight quantizer, excluded, keeps it as is), for the search loops' many
    candidates of one layer: the adapter's exact fast path where it covers the quantizer, else a quantizer call
    each. ``has_grid``: whether it has one, if the caller knows (asking Brevitas runs the quantizer)."""
    if has_grid is None:
        has_grid = int_weight_format(layer) is not None
    if not has_grid:
        return lambda weight: weight
    fast = candidate_quantizer(layer)
    return fast if fast is not None else lambda weight: weight_grid(layer, weight).quantize(weight)


def _fake_quantized(quantize: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """``quantize(weight)``: one candidate's quantization, a function of its own so that the benchmark's roofline
    can count its time as arithmetic."""
    return quantize(weight)


class _TokenSample:
    """Up to :data:`CLIP_TOKENS` input rows per layer, taken evenly from each batch until enough are kept."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, rows: torch.Tensor, _raw: Any = None) -> None:
        kept = self.rows.setdefault(name, [])
        have = sum(r.shape[0] for r in kept)
        if have < CLIP_TOKENS:
            step = max(1, rows.shape[0] // 128)
            kept.append(rows[::step][: CLIP_TOKENS - have].clone())

    def get(self, name: str) -> torch.Tensor:
        return torch.cat(self.rows[name])


class _LinearError:
    """The output error of a Linear-like layer with a candidate weight, on its recorded inputs ``X``, without
    running it: ``sum ||X (W' - W)^T||^2 = sum((D G) * D)`` for ``D = W' - W`` and the Gram matrix ``G = X^T X``
    (float64, accumulated once per group). Bias and all else cancel in the difference, so this is the error the
    recorded float outputs give, up to float rounding (measured: relative difference below 1e-5), at
    ``in x in`` instead of ``tokens x in`` multiply-adds per output channel and no per-call work."""

    def __init__(self, gram: torch.Tensor, tokens: int, weight: torch.Tensor) -> None:
        self.gram, self.tokens, self.weight = gram, tokens, weight.detach().double()

    @classmethod
    def of(cls, calls: list[Any], weight: torch.Tensor, layout: CallLayout | None = None) -> _LinearError:
        """From the layer's recorded ``(args, kwargs)`` calls and its float ``[out, in]`` weight; ``layout``: where
        the original calls' rows are in stacked ones (the products are summed in the original calls' order)."""
        channels = weight.shape[1]
        layout = layout or CallLayout.unstacked(len(calls))
        gram = torch.zeros(channels, channels, dtype=torch.float64, device=weight.device)
        tokens = 0
        pieces = []
        for call, (args, kwargs) in enumerate(calls):
            value = (args[0] if args else next(iter(kwargs.values()))).detach()
            rows = value.reshape(-1, channels).to(device=gram.device, dtype=torch.float64)
            pieces.append(layout.split(call, rows, rows.shape[0] // max(1, value.shape[0])))
        for rows in layout.in_order(pieces):
            gram.addmm_(rows.t(), rows)
            tokens += rows.shape[0]
        return cls(gram, tokens, weight)

    def error(self, candidate: torch.Tensor) -> torch.Tensor:
        """Squared error sum and element count of the outputs with ``candidate`` (``[out, in]``) as weight."""
        delta = candidate.double() - self.weight
        count = delta.new_tensor(float(self.tokens * delta.shape[0]))
        return torch.stack([((delta @ self.gram) * delta).sum(), count]).float().cpu()  # beside the CPU sums


def clip_search(layer: nn.Module, rows: torch.Tensor, group_size: int, data: CalibrationData) -> torch.Tensor:
    """The clamped ``[out, in]`` weight of ``layer`` whose quantization best reproduces the layer's output on
    ``rows`` (tokens x input features), chosen per output channel and weight group (see the module docstring)."""
    weight = linear_weight(layer).detach().float()
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    groups = -(-in_features // size)
    pad = groups * size - in_features  # a last, partial group is padded with zeros (as Brevitas pads it)
    grouped = torch.nn.functional.pad(weight, (0, pad)).view(out_features, groups, size)
    inputs = torch.nn.functional.pad(rows, (0, pad)).view(rows.shape[0], groups, size)
    peak = grouped.abs().amax(dim=-1, keepdim=True)
    chunk = max(1, (1 << 22) // max(1, rows.shape[0] * groups))  # output channels per step, ~16 MB of products
    errors = torch.zeros(CLIP_STEPS, out_features, groups, device=weight.device)
    fake_quantized = _candidate_quantizer(layer, True)
    for step in range(CLIP_STEPS):
        limit = peak * (1 - step / GRID)
        clipped = torch.clamp(grouped, -limit, limit).view(out_features, -1)[:, :in_features]
        quantized = torch.nn.functional.pad(_fake_quantized(fake_quantized, clipped), (0, pad))
        difference = grouped - quantized.view(out_features, groups, size)
        for first in range(0, out_features, chunk):
            products = torch.einsum("ngk,ogk->nog", inputs, difference[first:first + chunk])
            errors[step, first:first + chunk] = products.pow(2).sum(dim=0)
    data.all_reduce(errors, "sum")
    best = errors.argmin(dim=0)  # [out, groups]
    limit = peak * (1 - best.unsqueeze(-1).float() / GRID)
    return torch.clamp(grouped, -limit, limit).view(out_features, -1)[:, :in_features]


@register(AWQConfig)
class AWQConfigHandler(BlockwiseHandler):
    """AWQ block by block; see the module docstring."""

    needs_scaling_layers = True

    def inputs_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Earlier blocks run in float (AWQ's scales and clipping applied, nothing quantized), as in AutoAWQ."""
        return quantization_disabled(model)

    def _inspected_error(self, module: nn.Module, recorded: CallRecorder, layout: CallLayout, name: str,
                         desc: str) -> torch.Tensor:
        """Squared error sum and element count of ``module``'s outputs on its recorded calls against the recorded
        float outputs, summed per original call in their order (``layout``: where they are in stacked calls)."""
        pieces: list[list[tuple[torch.Tensor, int]]] = []
        # The recorded calls are run directly rather than through a calibration pass: quantization is off, so the
        # pass's per-call weight cache and progress bar would be pure overhead (a sizeable share of a small block's
        # search); the inputs are the module's own, already on its device.
        for index, (args, kwargs) in enumerate(recorded.calls[name]):
            result = main_output(call_model(module, args, kwargs, index, f"{desc}: {name}")).float()
            difference = result - recorded.outputs[name][index].to(result.device)
            pieces.append([(piece.pow(2).sum(), piece.numel()) for piece in layout.split(index, difference)])
        total = torch.zeros(2)  # on the CPU: one number per call leaves the model's device
        for squares, count in layout.in_order(pieces):
            total[0] += squares.cpu()
            total[1] += count
        return total

    def _search_scales(self, algo: Any, block: nn.Module, data: CalibrationData, group: ScalingGroup,
                       mean_abs: torch.Tensor, recorded: CallRecorder, layouts: dict[str, CallLayout],
                       where: str) -> torch.Tensor:
        layers = [block.get_submodule(name) for name in group.layers]
        inspected = _inspected(group)
        # A group's own Linear-like layer, inspected alone, is judged from the Gram matrix of its inputs
        # (_LinearError): the same error as running it on every recorded call, a small fraction of the cost.
        by_gram = {name: _LinearError.of(recorded.calls[name], linear_weight(block.get_submodule(name)),
                                         layouts[name])
                   for name in inspected if name in group.layers and is_linear(block.get_submodule(name))}
        originals = [linear_weight(layer).detach().float().clone() for layer in layers]
        quantizers = [_candidate_quantizer(layer) for layer in layers]
        losses = []
        for step in range(GRID):
            scales = _awq_scales(mean_abs, step / GRID)
            candidates = {}
            for layer_name, layer, weight, fake_quantized in zip(group.layers, layers, originals, quantizers):
                scaled = weight * scales[None, :]
                candidates[layer_name] = _fake_quantized(fake_quantized, scaled) / scales[None, :]
                set_linear_weight(layer, candidates[layer_name])
            total = torch.zeros(2)
            for name in inspected:
                total += by_gram[name].error(candidates[name]) if name in by_gram else self._inspected_error(
                    block.get_submodule(name), recorded, layouts[name], name,
                    f"{algo.name}: {where} {group} ratio {step / GRID:.2f}")
            data.all_reduce(total, "sum")
            losses.append(float(total[0] / total[1]))
        for layer, weight in zip(layers, originals):
            set_linear_weight(layer, weight)
        best = min(range(GRID), key=losses.__getitem__)
        logger.debug("AWQ %s %s: ratio %.2f, output error of %s %.4g (unscaled %.4g)", where, group, best / GRID,
                     ", ".join(inspected), losses[best], losses[0])
        return _awq_scales(mean_abs, best / GRID)

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        where = f"decoder layer {name!r}" if name else type(block).__name__
        start = time.perf_counter()
        block.eval()
        groups = self.scaling_groups(algo, block)
        check_scaling_groups(block, name, groups, "AWQConfig.scaling_layers")
        quantized = self.quantized_layers(algo, block, where)
        clipped = {n: layer for n, layer in quantized.items()
                   if not int_weight_format(layer).per_tensor and not any(key in n for key in NO_CLIPPING)}
        # A group none of whose layers quantizes its weight (all excluded) has nothing to protect: every ratio
        # leaves its weights as they are, so its search would choose ratio 0, unit scales, and fold nothing.
        searched = [group for group in groups if any(int_weight_format(block.get_submodule(n)) is not None
                                                     for n in group.layers)]
        for group in groups:
            if group not in searched:
                logger.debug("AWQ %s %s: no layer quantizes its weight, no scales searched", where, group)
        groups = searched
        with torch.no_grad(), quantization_disabled(block), plain_linear_forwards(block.modules()):
            inputs = {group.inp: block.get_submodule(group.inp) for group in groups}
            inspected = {name: block.get_submodule(name) for group in groups for name in _inspected(group)}
            stacked = stacking.stacked_batches(data, min(STACK_BYTES, stacking.STACK_BYTES), first_alone=False)
            for tracker in ([BatchTracker(stacked)] if stacked is not None else []) + [BatchTracker(None)]:
                stats, sample = ChannelStats(), _TokenSample()
                try:
                    with layer_inputs(clipped, tracker.per_batch(sample.add)), CallRecorder(inspected) as recorded:
                        tracker.recorder = recorded
                        stats.collect(block, stacked.data if tracker.stacked else data, inputs,
                                      f"{algo.name}: statistics of {where}", on_output=tracker.on_output,
                                      per_batch=tracker.per_batch)
                    layouts = tracker.layouts()
                    break
                except (CalibrationDataError, NotPerRow) as exc:
                    if tracker.stacked is None or not not_per_row(exc):
                        raise
                    logger.debug("AWQ %s: a layer's rows are not its call's rows, batches not stacked", where)
            input_scales: dict[str, torch.Tensor] = {}
            for group in groups:
                scales = self._search_scales(algo, block, data, group, stats.mean(group.inp), recorded, layouts,
                                             where)
                fold_scales(block.get_submodule(group.prev_op), [block.get_submodule(n) for n in group.layers], scales)
                for layer_name in group.layers:
                    input_scales[layer_name] = input_scales.get(layer_name, 1) * scales
            for layer_name, layer in clipped.items():
                rows = sample.get(layer_name) / input_scales.get(layer_name, 1)
                set_linear_weight(layer, clip_search(layer, rows, int_weight_format(layer).group_size, data))
            for layer in quantized.values():
                weight_grid(layer)  # the quantizer's grid from the final weight
        if has_static_activation_quantizers(block):
            restart_activation_statistics(block)
            calibrate(block, data)
        logger.info("AWQConfig: %s done in %.2f s", name or where, time.perf_counter() - start)
        return block

