"""FINN recipes that need the model: the ``finn_w{bits}a{bits}`` presets with the network's ends named.

A preset is model-agnostic, so it cannot say "the first layer" or "the model's output". Two things FINN users do
need exactly that:

- **wide ends** (``ends_bits``): at 2 bits, FINN practice keeps the first compute layer's input and weights and
  the last layer's weights at 8 bits. The raw input and the logits need the range; FINN turns an 8-bit input
  quantizer into 255 thresholds and takes 8-bit weights. The last layer's *input* keeps the preset's width: it is
  the point shared with the layers before it, and a point whose layers disagree is a ``ConfigError``.
- **a quantized output** (``output_bits``): a signed quantizer on the last layer's output. FINN's hardware
  outputs integers, either a thresholding unit's codes (a final quantizer, which ``ConvertQONNXtoFINN`` turns
  into a MultiThreshold) or the accumulator read by a LabelSelect. With a float output, the QONNX file computes
  the last layer in float32. Values that tie exactly in FINN's integer accumulation (a pixel map at 2 bits has
  many) then differ there by summation-order noise, so the file's arg-max among tied values is arbitrary. With
  the output on a grid, both files give the same codes and the same (first) arg-max.

The first layers are the compute layers a model input reaches through grid-keeping ops (reshapes, ...). The last
layers are those whose output reaches the model's output without passing another compute layer. Both are found
on the torch.fx trace, as ``Backend.graph`` sees the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from quark_brevitas.backend.graph.ops import COMPUTE, classify, tensor_args
from quark_brevitas.backend.graph.trace import trace
from quark_brevitas.config import Config
from quark_brevitas.config.presets import get_preset
from quark_brevitas.errors import ConfigError

#: QAT after :func:`finn_config` (digits-measured, docs/how-to/graph-finn.md): bit width -> (epochs, starting
#: learning rate), Adam with cosine decay to zero (``quark_brevitas.cli.digits.fine_tune``). 2-bit activations
#: need many more steps at a higher rate for the learned scales and weights to settle, the more so with the
#: presets' power-of-two scales: on the residual CNN (float 97.6 %), 30 epochs at 1e-2 reach 93.3 %, 60 reach
#: 98.0 % (another seed: 97.1 % against float 98.2 %).
FINN_QAT_RECIPE: dict[int, tuple[int, float]] = {8: (3, 1e-3), 4: (3, 1e-3), 2: (60, 1e-2)}


def end_layers(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(first, last)``: the compute layers reading a model input, and those whose output is the model's output
    (through non-compute ops), as qualified module names, in graph order. Untraceable model: ``ModelError``."""
    from quark_brevitas.backend import DEFAULT_LAYER_MAP

    traced = trace(model)
    modules = dict(traced.named_modules())
    nodes = list(traced.graph.nodes)
    compute = {node.name for node in nodes
               if node.op != "placeholder" and classify(node, modules, tuple(DEFAULT_LAYER_MAP)) == COMPUTE}

    def nearest(start: Iterable, forward: bool) -> set[str]:
        seen, stack, found = set(), list(start), set()
        while stack:
            node = stack.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.name in compute:
                found.add(node.name)
            else:
                stack.extend(node.users if forward else tensor_args(node))
        return found

    first = nearest((user for node in nodes if node.op == "placeholder" for user in node.users), forward=True)
    last = nearest((arg for node in nodes if node.op == "output" for arg in tensor_args(node)), forward=False)
    ordered = [node for node in nodes if node.name in compute]
    return (tuple(str(n.target) for n in ordered if n.name in first),
            tuple(str(n.target) for n in ordered if n.name in last))


def finn_config(bits: int, model: nn.Module, *, ends_bits: int | None = None, output_bits: int | None = None
                ) -> Config:
    """The ``finn_w{bits}a{bits}`` preset for ``model`` (module docstring).

    ``ends_bits``: the first layers' input and weights and the last layers' weights at this width (FINN's 2-bit
    practice is 8; per-channel weights as the preset's). ``output_bits``: a signed per-tensor quantizer of this
    width on the last layers' output. Both ``None``: the preset unchanged. The overrides go to
    ``layer_quant_config`` under the layers' names, so ``plan()`` shows them like any other.
    """
    for field, value in (("ends_bits", ends_bits), ("output_bits", output_bits)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 8):
            raise ConfigError(field, f"finn_config: {field}={value!r}; allowed: None or an integer from 2 to 8")
    if bits not in (2, 4, 8):
        raise ConfigError("bits", f"finn_config: bits={bits!r}; allowed: 2, 4, 8 (the finn_w*a* presets)")
    config = get_preset(f"finn_w{bits}a{bits}")
    if ends_bits is None and output_bits is None:
        return config
    first, last = end_layers(model)
    layer = config.global_quant_config
    overrides = {}
    # The overrides keep the preset's arithmetic (scale type, rounding); only the widths change.
    if ends_bits is not None:
        wide = dataclasses.replace(layer.weight, bit_width=ends_bits)
        for name in first:
            overrides[name] = dataclasses.replace(
                layer, input_tensors=dataclasses.replace(layer.input_tensors, bit_width=ends_bits), weight=wide)
        for name in last:
            overrides[name] = dataclasses.replace(overrides.get(name, layer), weight=wide)
    if output_bits is not None:
        output = dataclasses.replace(layer.input_tensors, bit_width=output_bits)
        for name in last:
            overrides[name] = dataclasses.replace(overrides.get(name, layer), output_tensors=output)
    return dataclasses.replace(config, layer_quant_config=overrides)


__all__ = ["FINN_QAT_RECIPE", "end_layers", "finn_config"]
