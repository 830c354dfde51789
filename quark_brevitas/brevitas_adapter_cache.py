"""Brevitas door (issue 20): each layer's quantized weight computed once per calibration pass, not once per call.

Brevitas quantizes a layer's weight on every forward call (statistics, scale, rounding, clamping): in a
calibration pass over 64 batches a weight that does not change is quantized 64 times, which was the largest
single cost of block-by-block GPTQ. :func:`weights_quantized_once` memoises
``QuantWeightBiasInputOutputLayer.quant_weight`` for the duration of one pass, and recomputes it whenever
anything it depends on may have changed:

- the weight tensor (a different object, or its in-place version counter moved: ``copy_``, ``div_``, ...),
- any parameter or buffer of the weight quantizer (learned scales, initialised statistics),
- whether weight quantization is on, and the layer's ``training`` flag.

It does not cache when gradients are on (QAT needs the graph), for a weight quantizer that reads the quantized
input (``requires_quant_input``), or for sub-tensor calls. Writes through ``weight.data`` bypass the version
counter, which is why the cache lives only as long as one pass (the caller's context): algorithms change
weights between passes, never inside one.

This is a self-contained block of the one door to Brevitas internals (see ``brevitas_adapter``); the
integrator may move it into that package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer
from torch import nn

__all__ = ["weights_quantized_once"]

#: The instance attribute that shadows the class's ``quant_weight`` while a cache is active.
_ATTRIBUTE = "quant_weight"


class _CachedQuantWeight:
    """A layer's ``quant_weight``, remembered until its inputs change (see the module docstring)."""

    def __init__(self, layer: QuantWeightBiasInputOutputLayer) -> None:
        self.layer = layer
        self.state = [*layer.weight_quant.parameters(), *layer.weight_quant.buffers()]
        self.key: tuple[Any, ...] | None = None
        self.value: Any = None

    def _key(self) -> tuple[Any, ...]:
        layer = self.layer
        weight = layer.weight
        return (weight, weight._version, layer.training, layer.weight_quant.is_quant_enabled,
                *(tensor._version for tensor in self.state))

    def __call__(self, quant_input: Any = None, subtensor_slice_list: Any = None) -> Any:
        layer = self.layer
        original = QuantWeightBiasInputOutputLayer.quant_weight
        if subtensor_slice_list is not None or torch.is_grad_enabled() or layer.weight_quant.requires_quant_input:
            return original(layer, quant_input, subtensor_slice_list)
        key = self._key()
        if self.key is None or len(key) != len(self.key) or key[0] is not self.key[0] or key[1:] != self.key[1:]:
            self.value = original(layer, quant_input)
            self.key = key
        return self.value


@contextlib.contextmanager
def weights_quantized_once(model: nn.Module) -> Iterator[None]:
    """While the context lasts (one calibration pass), each quantized layer of ``model`` quantizes its weight
    once and reuses it until the weight or its quantizer changes. Nested contexts share the outer cache."""
    installed = []
    for module in model.modules():
        if isinstance(module, QuantWeightBiasInputOutputLayer) and _ATTRIBUTE not in module.__dict__:
            object.__setattr__(module, _ATTRIBUTE, _CachedQuantWeight(module))
            installed.append(module)
    try:
        yield
    finally:
        for module in installed:
            module.__dict__.pop(_ATTRIBUTE, None)
