"""GPTQ, GPFQ and accumulator-aware GPFQ: weight rounding that compensates the error layer by layer.

Brevitas's GPxQ contexts need one pass over the calibration data per layer (each pass collects the
inputs of the next layer to optimise); the data come from the pipeline (the whole model's batches, or
the cached inputs of one block). A layer that sees fewer input vectors (tokens, or convolution patches) than
it has input features gets a rank-deficient Hessian and may end up worse than rounding to nearest: the
handlers count them and warn, saying how many are needed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.algorithms.base import AlgorithmHandler, SavedStructure, register
from quark_brevitas.algorithms.gptq import warn_few_samples
from quark_brevitas.blocks.capture import UntilStopped
from quark_brevitas.brevitas_adapter import (
    LayerOutputs,
    QuantLayer,
    a2gpfq_available,
    a2gpfq_mode,
    gpfq_mode,
    gptq_mode,
    gpxq_update,
    layer_outputs_remembered,
)
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.algorithms import GPFA2Q, GPFQ, GPTQ
from quark_brevitas.errors import UnsupportedAlgorithmError

#: The float copy of each weight GPFQ keeps while it runs (Brevitas's name); removed afterwards.
_FLOAT_WEIGHT_COPY = "weight_orig"


def _run(mode: Any, data: CalibrationData, name: str, counts: _SampleCounts, memo: LayerOutputs | None) -> None:
    """One pass over ``data`` per group of layers the context optimises together, until every layer is done
    (at most one pass per layer, as Brevitas runs it). With ``memo``, layers already optimised return the
    outputs they computed in an earlier pass instead of computing them again."""
    left = mode.num_layers
    with tqdm(total=left, desc=f"{name} layers", leave=False, disable=None) as progress:
        for _ in range(mode.num_layers):
            if left <= 0:
                break
            counts.this_pass.clear()
            if memo is not None:
                memo.new_pass(keep_new=left > 1)  # a pass for the last layer feeds no later pass
            # A model that is one layer has the GPxQ hook on its root, outside Brevitas's catch in forward().
            data.forward(UntilStopped(mode.model), name, on_output=counts.batch_done)
            done = gpxq_update(mode)
            if memo is not None:
                memo.forget(done)  # their weights changed
            left -= len(done)
            progress.update(len(done))


def _features_and_samples(layer: nn.Module, inputs: tuple[Any, ...]) -> tuple[int, int] | None:
    """``(input features, input vectors)`` of one call of a Linear or convolution: GPxQ's Hessian is features x
    features and sums one outer product per vector (token, or convolution patch)."""
    value = inputs[0] if inputs else None
    if not isinstance(value, torch.Tensor):
        return None
    if isinstance(layer, nn.Linear):
        return layer.in_features, value.numel() // layer.in_features
    if isinstance(layer, nn.Conv1d | nn.Conv2d | nn.Conv3d) and isinstance(layer.padding, tuple):
        spatial = value.shape[-len(layer.kernel_size):]
        patches = 1
        for size, kernel, stride, pad, dilation in zip(spatial, layer.kernel_size, layer.stride, layer.padding,
                                                       layer.dilation):
            patches *= (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        batch = value.numel() // (layer.in_channels * math.prod(spatial))
        return layer.in_channels // layer.groups * math.prod(layer.kernel_size), batch * patches
    return None


class _SampleCounts:
    """Input vectors per quantized layer in the pass that processes it (the most seen in one pass: GPxQ passes
    stop after the layer they process). A layer called several times per batch (GPFQ runs each batch with and
    without quantization) counts the batch once."""

    def __init__(self) -> None:
        self.features: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.this_pass: dict[str, int] = {}
        self.this_batch: dict[str, int] = {}

    def layer_called(self, name: str, layer: nn.Module, inputs: tuple[Any, ...]) -> None:
        shape = _features_and_samples(layer, inputs)
        if shape is not None:
            self.features[name] = shape[0]
            self.this_batch[name] = max(self.this_batch.get(name, 0), shape[1])

    def batch_done(self, _index: int, _output: Any) -> None:
        for name, count in self.this_batch.items():
            self.this_pass[name] = self.this_pass.get(name, 0) + count
            self.seen[name] = max(self.seen.get(name, 0), self.this_pass[name])
        self.this_batch.clear()

    @contextlib.contextmanager
    def counting(self, model: nn.Module, algorithm: str) -> Iterator[_SampleCounts]:
        """Count while the context lasts, then warn about layers with fewer vectors than input features."""
        handles = [module.register_forward_pre_hook(
            lambda layer, inputs, name=name: self.layer_called(name, layer, inputs), prepend=True)
            for name, module in model.named_modules() if isinstance(module, QuantLayer)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
        warn_few_samples(algorithm, "", self.seen, self.features)


def _drop_float_weight_copies(model: nn.Module) -> None:
    """Remove the float weight copies GPxQ registers on each layer: the quantized model does not need
    them, and they would double the size of a checkpoint."""
    for module in model.modules():
        if _FLOAT_WEIGHT_COPY in module._buffers:
            del module._buffers[_FLOAT_WEIGHT_COPY]


class _GPxQHandler(AlgorithmHandler):
    #: Whether layers already optimised return the outputs of an earlier pass (:func:`layer_outputs_remembered`):
    #: GPTQ's passes compute every layer in one state; GPFQ's run each batch with and without quantization.
    remembers_outputs = False

    def mode(self, algo: Any, model: nn.Module) -> Any:
        raise NotImplementedError

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        model.eval()
        # The counting hooks come after the mode's setup, which warns about hooks it finds; prepended, they still
        # see each layer's input before the mode's hook stops the pass.
        with torch.no_grad(), self.mode(algo, model) as mode, _SampleCounts().counting(model, algo.name) as counts, \
                (layer_outputs_remembered(model) if self.remembers_outputs else contextlib.nullcontext()) as memo:
            _run(mode, data, algo.name, counts, memo)
        _drop_float_weight_copies(model)
        return model

    def restore(self, algo: Any, model: nn.Module, saved: SavedStructure) -> nn.Module:
        """Checkpoints written before the copies were dropped still hold them: recreate the buffers so that
        such a checkpoint loads (their values are not used)."""
        modules = dict(model.named_modules())
        for key, shape in saved.tensors.items():
            owner, _, attr = key.rpartition(".")
            module = modules.get(owner)
            if attr == _FLOAT_WEIGHT_COPY and module is not None and not hasattr(module, attr):
                module.register_buffer(attr, torch.empty(shape))
        return model


@register(GPTQ)
class GPTQHandler(_GPxQHandler):
    """GPTQ with float inputs to each layer."""

    remembers_outputs = True

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return gptq_mode(model, act_order=algo.act_order)


@register(GPFQ)
class GPFQHandler(_GPxQHandler):
    """GPFQ with quantized inputs to each layer."""

    blockwise = False  # it compares with the float model's activations at every layer

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return gpfq_mode(model, act_order=algo.act_order)


@register(GPFA2Q)
class GPFA2QHandler(_GPxQHandler):
    """GPFQ whose weights keep every dot product inside an accumulator of the given width."""

    blockwise = False  # it compares with the float model's activations at every layer

    def check(self, algo: Any, path: str) -> None:
        if not a2gpfq_available():
            raise UnsupportedAlgorithmError(f"{path}: GPFA2Q needs brevitas_examples.common.axe.a2gpfq_mode "
                                            "(shipped with brevitas >= 0.11); the installed Brevitas lacks it")

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return a2gpfq_mode(model, act_order=algo.act_order, accumulator_bit_width=algo.accumulator_bit_width)
