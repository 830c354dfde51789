"""AutoRound (Quark's ``AutoRoundConfig``): learned rounding offsets and clipping, block by block, by signed
gradient descent.

AutoRound (Cheng et al., arXiv 2309.05516) quantizes a weight ``w`` as
``q = (clamp(round(w / s + V) + z, min_int, max_int) - z) * s`` with a learned offset ``V`` in [-0.5, 0.5] per
weight; with ``enable_minmax_tuning`` the scale ``s`` (and zero point ``z``) come from the group's minimum and
maximum shrunk by learned factors in [0.5, 1]. Per block, all the block's layers' offsets and factors are trained
together to minimise the mean squared error between the block's output with those weights and the float block's
output on the same inputs; each step moves every parameter by ``lr`` (``minmax_lr``) times the sign of its
gradient (no Adam), the step decaying linearly to zero over ``iters`` steps, rounding passing gradients straight
through; the parameters with the lowest loss seen are kept (as AutoRound does).

The grid stays Brevitas's: at the end each layer's quantizer is re-initialised from the weight clipped by the
learned factors (:func:`~quark_brevitas.brevitas_adapter.weight_grid`: for min-max scales that is the clipped
range) and the weight is rounded on that grid with the learned offsets, so the layer's quantized weight equals
the result bit for bit. With ``iters=0`` (or offsets 0 and factors 1) this is exactly round to nearest. During
training the scale follows the clipping as min-max scales do (``s`` times the shrink of the group's range).

In the block engine a block's cached inputs are those the already-quantized earlier blocks produced (quantized
weights, float activations, as for GPTQ); the float target is the block with its float weights and no
quantization on those inputs. Across processes the gradients are summed before their sign is taken, so every
process takes the same steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from quark_brevitas.algorithms.base import register
from quark_brevitas.algorithms.blocks import BlockwiseHandler
from quark_brevitas.algorithms.scaling import linear_weight, set_linear_weight
from quark_brevitas.algorithms.structure import is_linear
from quark_brevitas.brevitas_adapter import WeightGrid, int_weight_format, quantization_disabled, weight_grid
from quark_brevitas.calibration.data import CalibrationData, map_tensors
from quark_brevitas.config.rounding import AutoRoundConfig
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["AutoRoundConfigHandler", "LearnedRounding"]

#: The range of the learned clipping factors of a group's minimum and maximum (AutoRound's).
CLIP_RANGE = (0.5, 1.0)
#: Candidate factors of ``clip_init="mse"``'s search, evenly spaced over :data:`CLIP_RANGE` (steps of 0.025).
CLIP_SEARCH_STEPS = 21


def _round_ste(values: torch.Tensor, to_int: Any) -> torch.Tensor:
    """Brevitas's rounding forward, identity backward (straight-through estimator)."""
    return values + (to_int(values) - values).detach()


def _main_output(output: Any) -> torch.Tensor:
    """A block's main output (Hugging Face blocks return a tuple whose first item is the hidden states)."""
    while isinstance(output, tuple | list):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ModelError(f"AutoRoundConfig: the block returned {type(output).__name__}, not a tensor or a tuple "
                         "starting with one; its output error cannot be measured")
    return output


@dataclass
class LearnedRounding:
    """One layer's learnable rounding: offsets ``V`` (``[out, in]``) and, if ``clip`` is set, per-group factors of
    the group's minimum and maximum (``[out, groups]`` each); ``grid`` is the layer's grid for its float weight."""

    layer: nn.Module
    weight: torch.Tensor
    grid: WeightGrid
    group_size: int
    offsets: torch.Tensor
    clip: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, layer: nn.Module, tune_clip: bool) -> LearnedRounding:
        weight = linear_weight(layer).detach().float().clone()
        fmt = int_weight_format(layer)
        grid = weight_grid(layer, weight)
        group_size = fmt.group_size if fmt.group_size > 0 else weight.shape[1]
        clip = None
        if tune_clip and not fmt.per_tensor and weight.shape[1] % group_size == 0:
            shape = (weight.shape[0], weight.shape[1] // group_size)
            clip = (torch.ones(shape, device=weight.device, requires_grad=True),
                    torch.ones(shape, device=weight.device, requires_grad=True))
        return cls(layer, weight, grid, group_size, torch.zeros_like(weight, requires_grad=True), clip)

    def parameters(self) -> list[torch.Tensor]:
        return [self.offsets, *(self.clip or ())]

    def search_clip(self, steps: int = CLIP_SEARCH_STEPS) -> None:
        """Start both clipping factors of every group at the candidate in :data:`CLIP_RANGE` whose rounding (offsets
        as they are) has the least squared error on the group's weights (``clip_init="mse"``): at 2-3 bits the
        min-max grid wastes most codes on a group's few largest weights."""
        if self.clip is None:
            raise ModelError("AutoRoundConfig: clip_init needs clipping factors (enable_minmax_tuning=True and "
                             "groups that divide the layer's input width)")
        low_factor, high_factor = self.clip
        best_error = torch.full_like(low_factor, float("inf"))
        best_factor = torch.ones_like(low_factor)
        with torch.no_grad():
            for candidate in torch.linspace(*CLIP_RANGE, steps).tolist():
                low_factor.fill_(candidate)
                high_factor.fill_(candidate)
                error = self._grouped((self.fake_quantized() - self.weight) ** 2).sum(-1)
                better = error < best_error
                best_error = torch.where(better, error, best_error)
                best_factor = torch.where(better, torch.full_like(best_factor, candidate), best_factor)
            low_factor.copy_(best_factor)
            high_factor.copy_(best_factor)

    def _grouped(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(tensor.shape[0], -1, self.group_size)

    def _ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = self._grouped(self.weight)
        return grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)

    def _expand(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group[..., None].expand(-1, -1, self.group_size).reshape(self.weight.shape)

    def _scale_zero_point(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid's scale and zero point as the clipping factors shrink the groups' ranges (min-max scales)."""
        if self.clip is None:
            return self.grid.scale, self.grid.zero_point
        low, high = self._ranges()
        low_factor, high_factor = self.clip
        if bool((self.grid.zero_point == 0).all()):  # symmetric: the scale follows the largest magnitude
            ratio = torch.maximum(-low * low_factor, high * high_factor) / torch.maximum(-low, high).clamp_min(1e-12)
            return self.grid.scale * self._expand(ratio), self.grid.zero_point
        ratio = (high * high_factor - low * low_factor) / (high - low).clamp_min(1e-12)
        scale = self.grid.scale * self._expand(ratio)
        zero_point = -self._expand(low * low_factor) / scale
        if self.grid.offset_dequantization:  # a float minimum per group (asymmetric K grids)
            return scale, zero_point
        return scale, _round_ste(zero_point, self.grid.to_int)

    def fake_quantized(self) -> torch.Tensor:
        """The weight rounded with the current offsets and clipping, differentiable in both (``[out, in]``)."""
        scale, zero_point = self._scale_zero_point()
        codes = _round_ste(self.weight / scale + zero_point + self.offsets, self.grid.to_int)
        codes = torch.clamp(codes, self.grid.min_int, self.grid.max_int)
        return self.grid.dequantize(codes, scale, zero_point)

    def step(self, lr: float, clip_lr: float) -> None:
        """One signed-gradient step, then the parameters back into their ranges."""
        with torch.no_grad():
            self.offsets -= lr * torch.sign(self.offsets.grad)
            self.offsets.clamp_(-0.5, 0.5)
            for factor in self.clip or ():
                factor -= clip_lr * torch.sign(factor.grad)
                factor.clamp_(*CLIP_RANGE)
        for parameter in self.parameters():
            parameter.grad = None

    def finish(self) -> torch.Tensor:
        """The rounded weight on the layer's Brevitas grid re-initialised from the clipped weight."""
        target = self.weight
        if self.clip is not None:
            low, high = self._ranges()
            low_factor, high_factor = (factor.detach() for factor in self.clip)
            target = torch.clamp(self.weight, self._expand(low * low_factor), self._expand(high * high_factor))
        grid = weight_grid(self.layer, target)
        codes = grid.clamp(grid.to_int(self.weight / grid.scale + grid.zero_point + self.offsets.detach()),
                           min_val=grid.min_int, max_val=grid.max_int)
        return grid.dequantize(codes, grid.scale, grid.zero_point)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The number of sequences in a block call: the leading dimension of its first tensor input."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    raise ModelError("AutoRoundConfig: the block was called without a tensor input")


def _chunk(value: Any, rows: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor whose leading dimension is the batch's (others, e.g. shared rotary
    embeddings, are kept whole)."""
    return map_tensors(value, lambda t: t[start:stop] if t.dim() and t.shape[0] == rows else t)


class _Recorder(nn.Module):
    """Runs the float block on each cached batch, keeping its inputs and its main output (the training target)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.block(*args, **kwargs)
        self.calls.append((args, kwargs, _main_output(output).detach()))
        return output


@register(AutoRoundConfig)
class AutoRoundConfigHandler(BlockwiseHandler):
    """AutoRound block by block; see the module docstring."""

    def inputs_context(self, model: nn.Module) -> Any:
        """Earlier blocks run with their rounded quantized weights and float activations (as for GPTQ)."""
        return quantization_disabled(model, act=True, weight=False, bias=False)

    def describe(self, algo: Any, model: nn.Module) -> list[str]:
        lines = super().describe(algo, model)
        names = self.blocks(algo, model)
        block = model.get_submodule(names[0]) if names[0] else model
        layers = algo.inside_layer_modules or [n for n, m in block.named_modules() if n and is_linear(m)]
        how = "given" if algo.inside_layer_modules else "inferred: the Linear-like layers of a block"
        clip = " and min/max clipping" if algo.enable_minmax_tuning else ""
        return [*lines, f"layers per block ({how}; rounding offsets{clip} learned together, {algo.iters} steps "
                        f"against the float block's output): {', '.join(layers) or '-'}"]

    def _chunks(self, calls: list[Any], batch_size: int) -> list[tuple[int, int, int, int]]:
        """``(call, rows, start, stop)`` for every step's piece of the cached batches, in turn."""
        pieces = []
        for index, (args, kwargs, _) in enumerate(calls):
            rows = _rows(args, kwargs)
            pieces += [(index, rows, start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
        return pieces

    def _loss(self, block: nn.Module, learned: dict[str, LearnedRounding], call: Any, piece: tuple[int, ...]
              ) -> torch.Tensor:
        args, kwargs, target = call
        _, rows, start, stop = piece
        weights = {}
        for name, rounding in learned.items():
            weight = rounding.fake_quantized()
            weights[f"{name}.weight"] = weight if isinstance(rounding.layer, nn.Linear) else weight.t()
        output = functional_call(block, weights, _chunk(args, rows, start, stop), _chunk(kwargs, rows, start, stop))
        return torch.nn.functional.mse_loss(_main_output(output).float(), target[start:stop].float())

    def _train(self, algo: Any, block: nn.Module, learned: dict[str, LearnedRounding], calls: list[Any],
               data: CalibrationData) -> float:
        """Signed gradient descent on every layer's offsets and clipping; returns the best loss (the parameters
        then hold the best values)."""
        pieces = self._chunks(calls, algo.batch_size)
        params = [p for rounding in learned.values() for p in rounding.parameters()]
        best, best_values = float("inf"), [p.detach().clone() for p in params]
        for step in range(algo.iters):
            piece = pieces[step % len(pieces)]
            loss = self._loss(block, learned, calls[piece[0]], piece)
            loss.backward()
            value = float(data.all_reduce(loss.detach().clone(), "sum"))
            if value < best:
                best, best_values = value, [p.detach().clone() for p in params]
            for param in params:
                param.grad = data.all_reduce(param.grad, "sum")
            decay = 1.0 - step / algo.iters
            for rounding in learned.values():
                rounding.step(algo.lr * decay, algo.minmax_lr * decay)
        with torch.no_grad():
            for param, value in zip(params, best_values, strict=True):
                param.copy_(value)
        return best

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        where = f"decoder layer {name!r}" if name else type(block).__name__
        block.eval()
        layers = self.quantized_layers(algo, block, where, algo.inside_layer_modules, "inside_layer_modules")
        start = time.perf_counter()
        recorder = _Recorder(block)
        with quantization_disabled(block):
            data.forward(recorder, f"{algo.name}: float outputs of {name or where}")
        learned = {n: LearnedRounding.of(layer, algo.enable_minmax_tuning) for n, layer in layers.items()}
        if algo.clip_init == "mse":
            for rounding in learned.values():
                rounding.search_clip()
        best = float("nan")
        if algo.iters > 0:
            trainable = [p for p in block.parameters() if p.requires_grad]
            try:
                with quantization_disabled(block), torch.enable_grad():
                    for param in trainable:
                        param.requires_grad_(False)
                    best = self._train(algo, block, learned, recorder.calls, data)
            finally:
                for param in trainable:
                    param.requires_grad_(True)
        with torch.no_grad():
            for rounding in learned.values():
                set_linear_weight(rounding.layer, rounding.finish())
        logger.info("AutoRoundConfig: %s done in %.2f s (best loss %.4g)", name or where, time.perf_counter() - start,
                    best)
        return block
