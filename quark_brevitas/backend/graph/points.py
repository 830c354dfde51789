"""Where the graph backend puts quantizers: the quantization points of a traced model, and their specs.

A *point* is one quantizer in the graph. Its spec comes from the compute layers its value reaches (the
``input_tensors`` of each, as resolved by the config hierarchy): a value is quantized for the layers that read
it. Points whose layers disagree are a :class:`ConfigError` naming two of them; a point that reaches no quantized
layer (the model's output, a branch into float layers) is not created.

Placement follows what FINN's ``ConvertQONNXtoFINN`` and ``Streamline`` can turn into integer hardware
(docs/how-to/graph-finn.md):

- a ReLU's quantizer is unsigned and sits right behind it (FINN's ReLU handler); every other quantizer is signed
  (FINN's identity handler), except a requantization of a value known to be non-negative (an average of ReLU
  outputs), which becomes ReLU + unsigned quantizer: exact, since ReLU changes nothing there, and it keeps the
  bit that a signed quantizer would waste;
- the inputs of an add/concat share one quantizer (``group``), so the sum is an integer at that scale;
- a compute layer whose input is not a quantizer's output (a model input, a BatchNorm, an add) gets its own
  (``layer_input``); a model input is so quantized in front of each layer reading it, behind any reshapes on the
  way (FINN streamlines a quantizer right in front of a layer, not one whose scale must cross a Reshape first);
- a quantized value that forks (a ReLU feeding a Conv and a skip) is re-quantized by the *same* quantizer once per
  compute layer reading it (``private``): FINN cannot move a scale past a fork, and calling the quantizer again
  on the same input gives the same values, so the model computes the same thing.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.backend.graph.ops import (
    ACT_SIGNED,
    ACT_UNSIGNED,
    COMPUTE,
    MERGE,
    PASSTHROUGH,
    REQUANT,
    classify,
    tensor_args,
)
from quark_brevitas.config import QuantizationSpec
from quark_brevitas.errors import ConfigError

#: ``layer name -> input_tensors spec`` (``None``: the layer's input stays float).
SpecOf = Callable[[str], "QuantizationSpec | None"]

_SIGNED_MERGES = {operator.sub, torch.sub, "sub", "sub_"}


@dataclass(frozen=True)
class QuantPoint:
    """One quantizer of the graph plan.

    ``tensor``: the graph value quantized (the FX node's name; for a shared group, the add/concat whose inputs
    share it); ``kind``: ``activation`` (behind an activation), ``requant`` (behind an op that leaves the grid),
    ``shared`` (the inputs of an add/concat), ``layer_input`` (in front of one layer: behind a model input, a
    BatchNorm, an add...); ``producer``: the module or op producing the value; ``layers``: the compute layers it
    reaches (the owners, whose ``input_tensors`` give ``spec``); ``inputs``: for a shared point, the values sharing
    it, for a layer input, the layer's graph node.
    """

    tensor: str
    kind: str
    producer: str
    layers: tuple[str, ...]
    spec: QuantizationSpec
    signed: bool
    inputs: tuple[str, ...] = ()

    #: whether the quantizer replaces the activation module ``producer`` itself (a ReLU module called once)
    replaces_module: bool = False

    @property
    def module_name(self) -> str:
        """The name of the quantizer module in the quantized model."""
        if self.replaces_module:
            return self.producer.removeprefix("module:")
        if self.kind == "layer_input":
            return f"graph_quant_{self.inputs[0]}_input"
        return f"graph_quant_{self.tensor}"

    def short(self) -> str:
        return f"{'int' if self.signed else 'uint'}{self.spec.resolved().bit_width}"


@dataclass
class GraphAnalysis:
    """The points of one traced graph, and the compute layers that need a private copy of their input."""

    points: list[QuantPoint]
    private: list[str]  # compute nodes whose quantized input forks upstream
    kinds: dict[str, str]


def _label(node: Any, modules: Mapping[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"module:{node.target}"
    if node.op == "placeholder":
        return f"input:{node.target}"
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op}:{target}"


def analyse(graph: Any, modules: Mapping[str, nn.Module], compute_types: Iterable[type], spec_of: SpecOf
            ) -> GraphAnalysis:
    """The quantization points of ``graph`` (a traced model whose submodules are ``modules``)."""
    compute_types = tuple(compute_types)
    nodes = list(graph.nodes)
    kinds = {node.name: ("input" if node.op == "placeholder" else classify(node, modules, compute_types))
             for node in nodes}
    quantized_output = {n.name for n in nodes if kinds[n.name] in (ACT_UNSIGNED, ACT_SIGNED, REQUANT)}
    layer_of = {n.name: str(n.target) for n in nodes if kinds[n.name] == COMPUTE}

    def reached(start: Iterable[Any]) -> list[str]:
        """Compute layers a value reaches (its own quantizer or a later one in front of them)."""
        seen, stack, layers = set(), list(start), []
        while stack:
            node = stack.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            kind = kinds[node.name]
            if kind == COMPUTE:
                layers.append(layer_of[node.name])
            else:
                stack.extend(node.users)
        return sorted(set(layers))

    def agreed(tensor: str, layers: list[str]) -> tuple[tuple[str, ...], QuantizationSpec | None]:
        owners = [(layer, spec_of(layer)) for layer in layers]
        owners = [(layer, spec) for layer, spec in owners if spec is not None]
        for layer, spec in owners[1:]:
            if spec.resolved() != owners[0][1].resolved():
                raise ConfigError(
                    f'layer_quant_config["{layer}"].input_tensors',
                    f"tensor {tensor!r} is quantized once for every layer it reaches, and layers {owners[0][0]!r} "
                    f"({owners[0][1].short()}) and {layer!r} ({spec.short()}) give it different input_tensors "
                    "specs; give both layers the same input_tensors spec (Backend.graph shares one quantizer)")
        return tuple(layer for layer, _ in owners), (owners[0][1] if owners else None)

    calls = Counter(str(n.target) for n in nodes if n.op == "call_module")
    signs: dict[str, bool] = {}  # value -> signed (True) / non-negative (False)

    def signed(node: Any) -> bool:
        return signs.get(node.name, True)

    points: list[QuantPoint] = []
    for node in nodes:
        kind = kinds[node.name]
        args = tensor_args(node)
        if kind == ACT_UNSIGNED:
            signs[node.name] = False
        elif kind == PASSTHROUGH:
            signs[node.name] = any(signed(a) for a in args[:1]) if args else True
        elif kind in (REQUANT, MERGE):
            negative = node.target in _SIGNED_MERGES or node.target in (operator.truediv, torch.div, "div")
            signs[node.name] = negative or not args or any(signed(a) for a in args)
        if kind in (ACT_UNSIGNED, ACT_SIGNED, REQUANT):
            layers, spec = agreed(node.name, reached(node.users))
            if spec is None:
                quantized_output.discard(node.name)
                continue
            point_kind = "requant" if kind == REQUANT else "activation"
            own = kind == ACT_UNSIGNED and node.op == "call_module" and calls[node.target] == 1
            points.append(QuantPoint(node.name, point_kind, _label(node, modules), layers, spec,
                                     signed=kind != ACT_UNSIGNED and signed(node), replaces_module=own))
        elif kind == MERGE:
            layers, spec = agreed(node.name, reached(node.users))
            if spec is not None:
                inputs = tuple(a.name for a in args)
                points.append(QuantPoint(node.name, "shared", _label(node, modules), layers, spec,
                                         signed=signs[node.name], inputs=inputs))
    private: list[str] = []
    for node in nodes:
        if kinds[node.name] != COMPUTE or spec_of(layer_of[node.name]) is None or not tensor_args(node):
            continue
        chain, value = [], tensor_args(node)[0]
        while kinds[value.name] == PASSTHROUGH and tensor_args(value):
            chain.append(value)
            value = tensor_args(value)[0]
        chain.append(value)
        if value.name in quantized_output:
            if any(len(link.users) > 1 for link in chain):
                private.append(node.name)
            continue
        source = tensor_args(node)[0]
        layer = layer_of[node.name]
        points.append(QuantPoint(source.name, "layer_input", _label(source, modules), (layer,), spec_of(layer),
                                 signed=signed(source), inputs=(node.name,)))
    return GraphAnalysis(points, private, kinds)


__all__ = ["GraphAnalysis", "QuantPoint", "SpecOf", "analyse"]
