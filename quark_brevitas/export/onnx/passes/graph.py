"""ONNX graph utilities shared by the passes, the runtime and the report.

An index of producers, consumers and initializers that the rewrites query and extend
(:class:`GraphIndex`), node attribute access, removal of unused initializers, a stable topological
sort, the file's opset and the categories of ops the passes reason about. Kept apart from the passes
so that each pass module holds only its own rewrite logic.
"""

from __future__ import annotations

import collections
import heapq

import numpy as np
import onnx
from onnx import numpy_helper

from quark_brevitas.export.errors import ExportError

#: Ops whose operand 1 is a weight (reported as the file's weight types).
WEIGHT_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Ops whose operand 2 is a bias.
BIAS_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm"})
#: Ops that only move or copy elements (Brevitas puts them between a weight and its consumer, and
#: between an activation's DequantizeLinear and the layer reading it).
LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: Ops whose output values lie on their input's grid (a quantizer's grid survives them): the layout ops, max
#: pooling, padding with zeros and (nearest-neighbour) resizing.
GRID_KEEPING_OPS = LAYOUT_OPS | {"MaxPool", "Pad", "Resize"}


def attr(node: onnx.NodeProto, name: str, default: int) -> int:
    """The integer attribute ``name`` of ``node``, or ``default`` if the node does not set it."""
    for a in node.attribute:
        if a.name == name:
            return int(onnx.helper.get_attribute_value(a))
    return default


def module_path(node_name: str) -> str:
    """A node name of torch's exporter as a dotted path: ``/encoder/layer.0/fc/MatMul`` -> ``encoder.layer.0.fc.
    MatMul`` (scopes are joined by ``/``, list items by ``.``), comparable with ``named_modules`` names."""
    return node_name.lstrip("/").replace("/", ".")


def traced_module_paths(graph: onnx.GraphProto) -> set[str]:
    """Every module path (and each of its parent paths) that names a node of ``graph``: the modules whose
    computation the traced graph contains. A module that ran during tracing but whose result nothing reads (a
    BERT pooler behind a wrapper returning only ``last_hidden_state``) has no node left after torch's dead-code
    elimination, so it is not in the set."""
    paths: set[str] = set()
    for node in graph.node:
        parts = module_path(node.name).split(".")
        paths.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return paths


def single_output(node: onnx.NodeProto) -> bool:
    """Whether the node produces exactly one (named) output, so moving it around moves one tensor."""
    return sum(1 for name in node.output if name) == 1


def opset_of(model: onnx.ModelProto) -> int:
    """The model's default-domain opset."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ExportError("exported ONNX model declares no default-domain opset")


def has_subgraphs(graph: onnx.GraphProto) -> bool:
    """Whether any node carries a subgraph (control flow); the rewrites leave such graphs alone."""
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for node in graph.node for a in node.attribute
    )


class GraphIndex:
    """Producers, consumers and initializers of a graph; rebuilt for every rewrite round."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {init.name: init for init in graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
        self.names = set(self.inits) | {i.name for i in graph.input} | {o.name for o in graph.output}
        for node in graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
            self.names.update(node.input)
            self.names.update(node.output)
        self.graph_outputs = {o.name for o in graph.output}

    def const(self, name: str) -> np.ndarray | None:
        """The value of initializer ``name``; ``None`` for a run-time tensor (or no name)."""
        init = self.inits.get(name) if name else None
        return None if init is None else numpy_helper.to_array(init)

    def sole_consumer(self, name: str) -> onnx.NodeProto | None:
        """The only node reading ``name`` (``None`` if several, none, or a graph output)."""
        users = self.consumers.get(name, [])
        if name in self.graph_outputs or len(users) != 1:
            return None
        return users[0]

    def fresh_name(self, hint: str) -> str:
        """A tensor/node name not used in the graph yet, based on ``hint``."""
        name, k = hint, 1
        while name in self.names:
            name, k = f"{hint}_{k}", k + 1
        self.names.add(name)
        return name

    def add_initializer(self, array: np.ndarray, hint: str) -> str:
        """Add ``array`` as a new initializer and return its (fresh) name."""
        name = self.fresh_name(hint)
        init = numpy_helper.from_array(np.asarray(array), name=name)
        self.graph.initializer.append(init)
        self.inits[name] = init
        return name


def _used_names(graph: onnx.GraphProto, used: set[str]) -> set[str]:
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _used_names(attribute.g, used)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _used_names(sub, used)
    return used


def clean_graph(graph: onnx.GraphProto) -> None:
    """Drop unused initializers and initializers duplicated as graph inputs."""
    used = _used_names(graph, {o.name for o in graph.output})
    keep = [init for init in graph.initializer if init.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)
    init_names = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if len(inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(inputs)


def topological_sort(graph: onnx.GraphProto) -> None:
    """Order nodes topologically, keeping the existing order wherever it is already valid."""
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        for source in {producer[name] for name in node.input if name in producer}:
            waiting[i] += 1
            dependents[source].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):  # pragma: no cover - rewrites never create cycles
        raise ExportError("internal error: the rewritten ONNX graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)

