"""Integer-kernel rewrites of quantized biases.

onnxruntime's QGemm/QLinearConv add the int32 codes of a bias straight into the integer accumulator,
assuming its scale is input scale x weight scale and its zero point 0. A bias with another scale is
dequantized offline (so the fused kernel cannot get it wrong), and all-zero bias zero points, which
are the default, are dropped.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from quark_brevitas.export.onnx.passes.graph import BIAS_CONSUMERS, GraphIndex


def fold_unfusable_bias(index: GraphIndex) -> int:
    """Dequantize offline an int32 bias whose scale is not input scale x weight scale.

    onnxruntime's QGemm/QLinearConv fusions add the int32 bias of ``DQ(bias)`` straight into the
    integer accumulator, i.e. they assume ``bias_scale == input_scale * weight_scale`` and a zero
    bias zero point without checking. Brevitas' ``Int*Bias`` quantizers satisfy this exactly
    (the scale is that very float32 product); for any other bias quantizer the fused kernel would
    be wrong, so such a bias is stored as the float32 values its DequantizeLinear produces
    (``(b - zp) * scale``, evaluated as onnxruntime does), which keeps the numbers and leaves the
    layer unfused.
    """
    count = 0
    for node in list(index.graph.node):
        if node.op_type not in BIAS_CONSUMERS or len(node.input) < 3 or not node.input[2]:
            continue
        bias_dq = index.producer.get(node.input[2])
        if bias_dq is None or bias_dq.op_type != "DequantizeLinear":
            continue
        values = index.const(bias_dq.input[0])
        if values is None or index.inits[bias_dq.input[0]].data_type != TensorProto.INT32:
            continue
        scale = index.const(bias_dq.input[1])
        zero_point = index.const(bias_dq.input[2]) if len(bias_dq.input) > 2 and bias_dq.input[2] else np.zeros(())
        if scale is None or zero_point is None:
            continue
        if _bias_scale_matches(index, node, scale) and not np.any(zero_point):
            continue
        if index.sole_consumer(bias_dq.output[0]) is not node:
            continue
        shift = values.astype(np.int64) - zero_point.astype(np.int64)
        folded = shift.astype(np.float32) * scale.astype(np.float32)
        node.input[2] = index.add_initializer(folded.astype(np.float32), f"{bias_dq.input[0]}_float")
        index.graph.node.remove(bias_dq)
        count += 1
    return count


def _bias_scale_matches(index: GraphIndex, node: onnx.NodeProto, bias_scale: np.ndarray) -> bool:
    scales = []
    for operand in node.input[:2]:
        dq = index.producer.get(operand)
        scale = index.const(dq.input[1]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if scale is None:
            return True  # not a fusable group: onnxruntime runs the bias DequantizeLinear itself
        scales.append(scale.astype(np.float32).reshape(-1))
    expected = scales[0] * scales[1]
    actual = bias_scale.astype(np.float32).reshape(-1)
    try:
        return bool(np.array_equal(*np.broadcast_arrays(expected, actual)))
    except ValueError:
        return False


def drop_zero_bias_zero_points(index: GraphIndex) -> int:
    """Drop all-zero zero points of constant int32 DequantizeLinear inputs (they are the default)."""
    count = 0
    for dq in index.graph.node:
        if dq.op_type != "DequantizeLinear" or len(dq.input) < 3 or not dq.input[2]:
            continue
        init = index.inits.get(dq.input[0])
        zero_point = index.const(dq.input[2])
        if init is None or init.data_type != TensorProto.INT32 or zero_point is None or np.any(zero_point):
            continue
        del dq.input[2]
        count += 1
    return count

