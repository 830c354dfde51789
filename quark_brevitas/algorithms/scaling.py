"""Per-channel scales between a layer and the layers it feeds: activation statistics, and folding the scales.

SmoothQuant and AWQ both divide the output channels of a ``prev_op`` (a norm or a Linear-like layer) by
per-channel scales and multiply the matching input channels of the layers it feeds by the same scales, which
leaves the float model's function unchanged where the structure allows it (:mod:`quark_brevitas.algorithms.structure`
proposes only such groups). Folding into existing weights, rather than inserting a multiplication, keeps the
quantized model and its ONNX export free of extra nodes.

Statistics are collected with forward pre-hooks during :meth:`CalibrationData.forward` and reduced with
:meth:`CalibrationData.all_reduce`, so sharded calibration gives every process the same scales.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.structure import input_channels, is_linear
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.errors import ModelError

#: What sees each input of a layer: ``(layer name, rows as tokens x features, the object it was called with)``.
Consumer = Callable[[str, torch.Tensor, Any], None]

__all__ = ["ChannelStats", "Consumer", "fold_scales", "layer_inputs", "linear_weight", "set_linear_weight"]


def _input_rows(args: tuple[Any, ...], kwargs: dict[str, Any], channels: int) -> torch.Tensor:
    """A Linear-like layer's input as rows of ``channels`` features (tokens x features)."""
    value = args[0] if args else next(iter(kwargs.values()))
    return value.detach().reshape(-1, channels).float()


@contextmanager
def layer_inputs(layers: Mapping[str, nn.Module], consume: Consumer) -> Iterator[None]:
    """While the context lasts, ``consume(name, rows, raw)`` sees every input of each Linear-like layer of ``layers``
    (``rows``: a float copy as tokens x input features; ``raw``: the object the layer was called with)."""
    handles = []
    for name, layer in layers.items():
        channels = input_channels(layer)
        if channels is None:
            raise ModelError(f"{name} ({type(layer).__name__}) is not a Linear-like layer")

        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name,
                 channels: int = channels) -> None:
            raw = args[0] if args else next(iter(kwargs.values()))
            consume(name, _input_rows(args, kwargs, channels), raw)

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class ChannelStats:
    """Per-input-channel ``max |x|`` and ``mean |x|`` of some layers' inputs over a pass, reduced over processes."""

    def __init__(self) -> None:
        self.max: dict[str, torch.Tensor] = {}
        self.sum: dict[str, torch.Tensor] = {}
        self.count: dict[str, torch.Tensor] = {}

    def add(self, name: str, rows: torch.Tensor, _raw: Any = None) -> None:
        magnitude = rows.abs()
        peak, total = magnitude.amax(dim=0), magnitude.sum(dim=0)
        if name in self.max:
            torch.maximum(self.max[name], peak, out=self.max[name])
            self.sum[name] += total
            self.count[name] += rows.shape[0]
        else:
            self.max[name], self.sum[name] = peak, total
            self.count[name] = torch.tensor(float(rows.shape[0]))

    def collect(self, module: nn.Module, data: CalibrationData, layers: Mapping[str, nn.Module], desc: str,
                on_output: Callable[[int, Any], None] | None = None,
                per_batch: Callable[[Consumer], Consumer] | None = None) -> None:
        """One pass of ``data`` through ``module`` (``on_output`` sees its outputs), recording the inputs of
        ``layers``; then the reduction over processes. ``per_batch``: wraps the consumer of the inputs (AWQ on
        stacked batches splits each call's rows per original batch, so that the sums keep their order)."""
        consume = self.add if per_batch is None else per_batch(self.add)
        with torch.no_grad(), layer_inputs(layers, consume):
            data.forward(module, desc, on_output=on_output)
        missing = sorted(set(layers) - set(self.max))
        if missing:
            raise ModelError(f"{desc}: {', '.join(missing)} received no input during the pass (not called by "
                             f"{type(module).__name__}'s forward)")
        for name in self.max:
            data.all_reduce(self.max[name], "max")
            data.all_reduce(self.sum[name], "sum")
            data.all_reduce(self.count[name], "sum")

    def mean(self, name: str) -> torch.Tensor:
        return self.sum[name] / self.count[name]


def linear_weight(layer: nn.Module) -> torch.Tensor:
    """A Linear-like layer's weight as ``[out, in]`` (Hugging Face's Conv1D stores it transposed)."""
    return layer.weight if isinstance(layer, nn.Linear) else layer.weight.t()


def set_linear_weight(layer: nn.Module, weight: torch.Tensor) -> None:
    """Set a Linear-like layer's weight from an ``[out, in]`` tensor (in place, keeping its dtype)."""
    with torch.no_grad():
        target = layer.weight if isinstance(layer, nn.Linear) else layer.weight.t()
        target.copy_(weight.to(target.dtype))


def _scale_outputs(prev_op: nn.Module, divisor: torch.Tensor) -> None:
    """Divide ``prev_op``'s output channels by ``divisor`` (a norm's weight and bias, a Linear's rows and bias)."""
    if is_linear(prev_op):
        set_linear_weight(prev_op, linear_weight(prev_op) / divisor[:, None].to(prev_op.weight.dtype))
    else:
        with torch.no_grad():
            prev_op.weight.div_(divisor.to(prev_op.weight.dtype))
    bias = getattr(prev_op, "bias", None)
    if isinstance(bias, torch.Tensor):
        with torch.no_grad():
            bias.div_(divisor.to(bias.dtype))


def fold_scales(prev_op: nn.Module, layers: Iterable[nn.Module], scales: torch.Tensor) -> None:
    """``prev_op``'s outputs divided by ``scales`` and the inputs of ``layers`` multiplied by them: the float
    function is unchanged when ``prev_op``'s output feeds only ``layers`` (directly, or through a positively
    homogeneous activation or a product with another branch)."""
    scales = scales.detach().float()
    _scale_outputs(prev_op, scales)
    for layer in layers:
        set_linear_weight(layer, linear_weight(layer).float() * scales[None, :])
