"""Putting the graph plan's quantizers into a traced model (:mod:`quark_brevitas.backend.graph.points`).

Each point becomes one Brevitas activation quantizer module: ``QuantReLU`` (a ReLU, then an unsigned non-narrow
quantizer: what FINN's ReLU handler accepts) for non-negative values, ``QuantIdentity`` (signed, zero point 0)
for the others. A shared point is one module called on every input of its add/concat, so all of them have its
scale, in calibration, in training and in the exported file alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import brevitas.nn as qnn
from brevitas.graph.utils import set_module
from torch import nn

from quark_brevitas.backend.graph.ops import ACT_UNSIGNED, MERGE, PASSTHROUGH, tensor_args
from quark_brevitas.backend.graph.points import GraphAnalysis, QuantPoint
from quark_brevitas.brevitas_adapter import attach_bias_quant
from quark_brevitas.config import QuantizationSpec
from quark_brevitas.errors import ConfigError
from quark_brevitas.quantizers import build_quantizer


def quantizer_module(point: QuantPoint) -> nn.Module:
    """The quantizer of one point (see the module docstring)."""
    quant = build_quantizer(point.spec, "input_tensors")
    if point.signed:
        return qnn.QuantIdentity(act_quant=quant, return_quant_tensor=False)
    return qnn.QuantReLU(act_quant=quant.let(signed=False, narrow_range=False), return_quant_tensor=False)


def _insert_after(graph: Any, node: Any, target: str) -> None:
    """Call module ``target`` on ``node``'s output and make every other user read the call's output."""
    users = list(node.users)
    with graph.inserting_after(node):
        call = graph.call_module(target, (node,))
    for user in users:
        user.replace_input_with(node, call)


def insert_points(graph_model: Any, analysis: GraphAnalysis) -> set[str]:
    """Add every point's quantizer to ``graph_model`` (in place); the names of the quantizer modules."""
    graph = graph_model.graph
    nodes = {node.name: node for node in graph.nodes}
    names: set[str] = set()
    for point in analysis.points:
        module, name = quantizer_module(point), point.module_name
        names.add(name)
        node = nodes[point.tensor]
        if point.kind == "activation" and analysis.kinds[node.name] == ACT_UNSIGNED:
            if point.replaces_module:
                set_module(graph_model, module, name)
            else:  # F.relu, x.relu() or a ReLU module called more than once: the call becomes the quantizer's
                graph_model.add_submodule(name, module)
                node.op, node.target, node.args, node.kwargs = "call_module", name, (tensor_args(node)[0],), {}
            continue
        graph_model.add_submodule(name, module)
        if point.kind == "shared":
            for arg in dict.fromkeys(tensor_args(node)):
                with graph.inserting_before(node):
                    call = graph.call_module(name, (arg,))
                node.replace_input_with(arg, call)
        elif point.kind == "layer_input":
            consumer = nodes[point.inputs[0]]
            with graph.inserting_before(consumer):
                call = graph.call_module(name, (node,))
            consumer.replace_input_with(node, call)
        else:
            _insert_after(graph, node, name)
    return names


def privatise_forks(graph_model: Any, analysis: GraphAnalysis, quantizers: set[str]) -> None:
    """Give each compute layer whose quantized input forks a second call of that input's quantizer, on the value
    the layer reads: the value is already on that quantizer's grid, so the call changes nothing in PyTorch, but in
    the exported file the layer's input is a Quant node of its own, which FINN turns into thresholds whose scale
    moves past the layer (a scale that forks cannot). The call reads the quantized value, not the value before the
    quantizer: the ONNX exporter merges equal ReLUs on one input, and FINN cannot convert a ReLU that forks."""
    graph = graph_model.graph
    nodes = {node.name: node for node in graph.nodes}
    for name in analysis.private:
        consumer = nodes[name]
        value = tensor_args(consumer)[0]
        target = _feeding_quantizer(consumer, analysis, quantizers, through=(PASSTHROUGH,), unknown=PASSTHROUGH)
        if target is None:
            raise AssertionError(f"graph backend: no quantizer found in front of {name!r}")  # a planning bug
        with graph.inserting_before(consumer):
            call = graph.call_module(target, (value,))
        consumer.replace_input_with(value, call)


def _feeding_quantizer(node: Any, analysis: GraphAnalysis, quantizers: set[str],
                       through: tuple[str, ...] = (PASSTHROUGH, MERGE), unknown: str | None = None) -> str | None:
    """The quantizer module whose grid the value read by ``node`` is on: the nearest quantizer call upstream
    through ops of the kinds ``through`` (by default those that keep the grid: reshapes, max pooling, ..., and the
    adds/concats of a shared quantizer's outputs; a node the analysis does not know is of kind ``unknown``);
    ``None`` if another op comes first."""
    probe = tensor_args(node)[0]
    while not (probe.op == "call_module" and probe.target in quantizers):
        if analysis.kinds.get(probe.name, unknown) not in through or not tensor_args(probe):
            return None
        probe = tensor_args(probe)[0]
    return str(probe.target)


def share_input_scales(graph_model: Any, analysis: GraphAnalysis, quantizers: set[str],
                       bias_specs: Mapping[str, QuantizationSpec]) -> list[str]:
    """Give every compute layer whose config has an integer bias (``bias_specs``: layer name -> spec, ``scale =
    input scale x weight scale``) that bias quantizer, with the quantizer its input comes from as its own input
    quantizer, so that the bias quantizer sees the input's scale; the names of those layers.

    The value is already on that quantizer's grid, so the second call changes nothing (as in
    :func:`privatise_forks`); the bias lands on the accumulator's grid, which keeps a power-of-two network's
    arithmetic exact in float32 (docs/how-to/graph-finn.md). A layer called on values of two quantizers, or on a
    value no quantizer reaches, cannot have one bias scale: ``ConfigError`` naming it."""
    modules = dict(graph_model.named_modules())
    found: dict[str, set[str]] = {}
    for node in graph_model.graph.nodes:
        if node.op == "call_module" and str(node.target) in bias_specs:
            found.setdefault(str(node.target), set()).add(_feeding_quantizer(node, analysis, quantizers) or "")
    for name, feeding in found.items():
        if len(feeding) != 1 or "" in feeding:
            why = "its input is not on one quantizer's grid" if "" in feeding else \
                f"it is called on the outputs of {len(feeding)} quantizers ({', '.join(sorted(feeding))})"
            raise ConfigError("bias", f"layer {name!r}: an integer bias takes the scale of the layer's input "
                              f"quantizer, but {why}; use bias=None (a float bias) for this layer")
        attach_bias_quant(modules[name], build_quantizer(bias_specs[name], "bias"), modules[feeding.pop()].act_quant)
    return sorted(found)


__all__ = ["insert_points", "privatise_forks", "quantizer_module", "share_input_scales"]
