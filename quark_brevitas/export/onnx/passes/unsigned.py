"""Integer-kernel rewrite storing int8 activations as uint8.

onnxruntime's x86 integer kernels take uint8 activations (U8S8); it converts adjacent int8 ``Q -> DQ``
pairs itself but not pairs with an integer Clip or a layout op in between, which then match no fusion.
Shifting an activation's codes, zero points and Clip bounds by 128 is exact (see
:func:`unsigned_activations`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from quark_brevitas.export.onnx.passes.graph import GraphIndex, single_output
from quark_brevitas.export.onnx.passes.qparams import ORDER_PRESERVING_OPS, activation_qparams, qparams


def _int8_activation_tree(index: GraphIndex, q: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Nodes reading the int8 output of ``q`` (through Clips and layout ops) down to its DQs.

    ``None`` if any reader is something else (or the tensor is a graph output), because then the
    int8 tensor cannot be switched to uint8 without changing that reader.
    """
    tree: list[onnx.NodeProto] = []
    pending = [q.output[0]]
    while pending:
        name = pending.pop()
        if name in index.graph_outputs:
            return None
        for user in index.consumers.get(name, []):
            if user.input[0] != name or name in user.input[1:]:
                return None
            if user.op_type == "DequantizeLinear":
                params = qparams(index, user)
                if params is None or params.onnx_type != TensorProto.INT8:
                    return None
            elif user.op_type == "Clip" and not user.attribute:
                if any(n and (n not in index.inits or index.inits[n].data_type != TensorProto.INT8)
                       for n in user.input[1:3]):
                    return None
                pending.append(user.output[0])
            elif user.op_type in ORDER_PRESERVING_OPS and single_output(user):
                pending.append(user.output[0])
            else:
                return None
            tree.append(user)
    return tree


def unsigned_activations(index: GraphIndex) -> int:
    """Store int8 activations as uint8 with the zero point shifted by 128.

    onnxruntime's x86 integer kernels take uint8 activations (U8S8); it converts int8
    ``Q -> DQ`` pairs itself, but only adjacent pairs, so an integer Clip in between leaves
    mismatched types and no fusion. Shifting every code, zero point and Clip bound of one
    activation by +128 is exact: ``clamp(round(x / s) + zp, -128, 127) + 128 ==
    clamp(round(x / s) + zp + 128, 0, 255)`` and dequantization only sees ``q - zp``. Weights
    stay int8.
    """
    count = 0
    shifted: dict[str, str] = {}

    def shift(name: str) -> str:
        if name not in shifted:
            value = index.const(name).astype(np.int16) + 128
            shifted[name] = index.add_initializer(value.astype(np.uint8), f"{name}_uint8")
        return shifted[name]

    for q in list(index.graph.node):
        params = activation_qparams(index, q)
        if params is None or params.onnx_type != TensorProto.INT8:
            continue
        tree = _int8_activation_tree(index, q)
        if tree is None:
            continue
        q.input[2] = shift(q.input[2])
        for node in tree:
            if node.op_type == "DequantizeLinear":
                node.input[2] = shift(node.input[2])
            elif node.op_type == "Clip":
                for i in (1, 2):
                    if len(node.input) > i and node.input[i]:
                        node.input[i] = shift(node.input[i])
        count += 1
    return count

