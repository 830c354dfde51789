"""Float8 QDQ graphs that onnxruntime's default session runs as written.

onnxruntime (1.31, 1.32) has a graph rule, ``ReluQuantRewrite``, that removes a ``Relu`` in front of a
``QuantizeLinear`` whose zero point is the lowest value of its type (for uint8 0, for int8 -128: the
quantizer's clipping then does the Relu's work). It applies the rule to float8 ``QuantizeLinear`` too, whose
zero point 0 is the *middle* of the type, so a default session silently drops the Relu and negative values
pass (an fp8 MLP: outputs off by 0.42 with outputs of magnitude 0.23). The rule matches the op type ``Relu``
only, so the rewrite here writes each such Relu as the identical ``Max(x, 0)``: the file is right in any
session, default options included, and the verification runs it with default options.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from quark_brevitas.export.onnx.onnx_types import FLOAT8_ONNX_TYPES
from quark_brevitas.export.onnx.passes.graph import GraphIndex

#: Ops that only move values: onnxruntime's QDQ propagation moves a ``QuantizeLinear`` up across them before the
#: Relu rule runs, so a Relu that reaches a float8 quantizer through them is dropped as well (a Relu before a
#: Reshape of a conv encoder-decoder: outputs off by 0.04 with a tolerance of 0.0014).
PASS_THROUGH = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "MaxPool",
                          "Resize", "Slice", "Split", "Concat"})


def _feeds_float8_quantizer(index: GraphIndex, tensor: str, seen: set[str] | None = None) -> bool:
    """Whether ``tensor`` reaches a float8 ``QuantizeLinear`` directly or through ops that only move values."""
    seen = set() if seen is None else seen
    if tensor in seen:
        return False
    seen.add(tensor)
    for user in index.consumers.get(tensor, []):
        if user.op_type == "QuantizeLinear" and len(user.input) > 2 and user.input[2] in index.inits \
                and index.inits[user.input[2]].data_type in FLOAT8_ONNX_TYPES:
            return True
        if user.op_type in PASS_THROUGH and any(_feeds_float8_quantizer(index, out, seen) for out in user.output):
            return True
    return False


def relu_as_max_before_float8_quantizers(model: onnx.ModelProto) -> int:
    """Rewrite every ``Relu`` whose output a float8 ``QuantizeLinear`` reads as ``Max(x, 0)``; returns how many."""
    graph = model.graph
    index = GraphIndex(graph)
    count = 0
    for position, node in enumerate(list(graph.node)):
        if node.op_type != "Relu" or not _feeds_float8_quantizer(index, node.output[0]):
            continue
        zero = index.add_initializer(np.array(0.0, np.float32), f"{node.name or node.output[0]}/zero")
        replacement = helper.make_node("Max", [node.input[0], zero], [node.output[0]], name=node.name)
        graph.node.remove(node)
        graph.node.insert(position, replacement)
        count += 1
    return count
