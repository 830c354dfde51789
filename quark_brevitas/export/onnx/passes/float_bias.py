"""Moving float biases out of quantized layers, applied only when verification fails.

onnxruntime rounds the float bias of a Gemm/Conv with quantized input and weight to int32 in order to
fuse the layer; that is usually harmless, but at low bit widths it can break the tolerance. The QCDQ
exporter then moves such biases into separate ``Add`` nodes (exact) and verifies the file again.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.onnx.passes.graph import GraphIndex, clean_graph, topological_sort

#: The report's description of this rewrite.
FLOAT_BIAS_REWRITE = "float biases moved out of quantized layers"


def move_float_biases_out(model: onnx.ModelProto) -> int:
    """``Gemm/Conv(DQ(x), DQ(W), float b)`` becomes ``Gemm/Conv(DQ(x), DQ(W)) + b``.

    onnxruntime quantizes such a float bias itself (``WeightBiasQuantization``: int32 with scale
    input scale x weight scale) so that it can fuse the layer, which rounds the bias; for low bit
    widths that can move the output by more than the tolerance. Not applied by default (usually
    the rounding is harmless and the fused layer fast), but when the verification fails: as a
    separate Add the bias keeps its exact float value, a Gemm still becomes a QGemm (with float
    output) and a Conv stays unfused.
    """
    index = GraphIndex(model.graph)
    count = 0
    for node in list(model.graph.node):
        if node.op_type not in ("Gemm", "Conv") or len(node.input) < 3 or not node.input[2]:
            continue
        bias = index.inits.get(node.input[2])
        producers = [index.producer.get(name) for name in node.input[:2]]
        if bias is None or bias.data_type != TensorProto.FLOAT:
            continue
        if any(p is None or p.op_type != "DequantizeLinear" for p in producers):
            continue
        values = numpy_helper.to_array(bias)
        if node.op_type == "Gemm":
            if any(a.name == "beta" and a.f != 1.0 for a in node.attribute):
                continue
        else:
            weight_rank = len(index.inits[producers[1].input[0]].dims) if producers[1].input[0] in index.inits else 0
            if weight_rank < 3 or values.ndim != 1:
                continue
            values = values.reshape(-1, *[1] * (weight_rank - 2))  # broadcast over N, C, spatial
        without_bias = index.fresh_name(f"{node.output[0]}_without_bias")
        add = onnx.helper.make_node(
            "Add",
            [without_bias, index.add_initializer(values.astype(np.float32), f"{node.input[2]}_broadcast")],
            [node.output[0]],
            name=index.fresh_name(f"{node.name or node.op_type}_bias"),
        )
        del node.input[2]
        node.output[0] = without_bias
        model.graph.node.append(add)
        count += 1
    if count:
        topological_sort(model.graph)
        clean_graph(model.graph)
    return count

