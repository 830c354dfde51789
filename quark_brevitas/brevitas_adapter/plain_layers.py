"""Quantized Linear layers run as torch's ``linear`` while every quantizer they have is switched off.

AWQ's search runs each block's attention and MLP about twenty times per scaling group with quantization off
(:func:`~quark_brevitas.brevitas_adapter.modes.quantization_disabled`). A switched-off ``QuantLinear`` still
passes its input, weight, bias and output through four proxies that hand them back unchanged, about 0.15 ms a
call, 1.4 s of a 20 s AWQ run on a small Llama. Its result is then ``F.linear(input, weight, bias)`` of its own
float parameters, which this context computes directly; a layer that could differ (a subclass, a quantizer still
on, a fused activation, quant tensors returned) keeps Brevitas's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from quark_brevitas.brevitas_adapter.introspection import fused_activation

__all__ = ["plain_linear_forwards"]


def _plain(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward is now exactly ``F.linear`` of its weight and bias."""
    from brevitas.nn import QuantLinear

    if type(layer) is not QuantLinear or layer.return_quant_tensor or layer.export_mode or "forward" in vars(layer):
        return False
    proxies = (layer.input_quant, layer.weight_quant, layer.bias_quant, layer.output_quant)
    return (not any(proxy.is_quant_enabled for proxy in proxies)
            and all(type(fused_activation(proxy)) is nn.Identity for proxy in (layer.input_quant, layer.output_quant)))


@contextlib.contextmanager
def plain_linear_forwards(modules: Iterable[nn.Module]) -> Iterator[list[nn.Module]]:
    """Within the context, the switched-off quantized Linear layers among ``modules`` run as ``F.linear`` (same
    values: Brevitas's disabled proxies return their inputs); hooks still run. Yields the layers changed. Enter it
    after switching quantization off: a layer with a quantizer still on is left to Brevitas."""
    changed = [module for module in modules if _plain(module)]
    for layer in changed:
        layer.forward = _linear_of(layer)
    try:
        yield changed
    finally:
        for layer in changed:
            del layer.forward


def _linear_of(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(inp: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(inp, layer.weight, layer.bias)

    return forward
