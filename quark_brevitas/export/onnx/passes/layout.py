"""Integer-kernel rewrites that move quantization across layout ops.

Brevitas puts a ``Transpose`` between a bias-free Linear's weight dequantizer and its MatMul, an
activation quantizer after ``Conv -> Relu -> MaxPool -> Flatten`` (where the next layer starts) and
``Flatten``/``Reshape`` between a dequantizer and its Gemm; each hides a layer from onnxruntime's QDQ
fusions. Layout ops only move elements (and MaxPool only selects them), so moving the quantize /
dequantize nodes across them is exact; each rewrite argues it in its docstring.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from quark_brevitas.export.onnx.passes.graph import LAYOUT_OPS, GraphIndex, attr, single_output
from quark_brevitas.export.onnx.passes.qparams import INT8_RANGE, ORDER_PRESERVING_OPS, activation_qparams, qparams


def transpose_weights_offline(index: GraphIndex) -> int:
    """``DequantizeLinear(W) -> Transpose`` becomes ``DequantizeLinear(W transposed)``.

    Bias-free Linear layers come out of Brevitas as ``DQ(W) -> Transpose -> MatMul``; a transpose
    between the DQ and the MatMul hides the MatMul from QDQ fusions (onnxruntime happens to undo
    it with its transpose optimizer, other runtimes do not). Dequantization is elementwise, so
    transposing the integer initializer and remapping a per-channel ``axis`` through ``perm``
    gives identical values.
    """
    count = 0
    for node in list(index.graph.node):
        if node.op_type != "Transpose":
            continue
        dq = index.producer.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or index.sole_consumer(dq.output[0]) is not node:
            continue
        weight = index.inits.get(dq.input[0])
        if weight is None or weight.data_type not in INT8_RANGE:
            continue
        scale = index.const(dq.input[1])
        if scale is None or scale.ndim > 1 or attr(dq, "block_size", 0):
            continue
        values = numpy_helper.to_array(weight)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None) or list(
            reversed(range(values.ndim))
        )
        new_attrs = [a for a in dq.attribute if a.name != "axis"]
        if scale.ndim == 1:
            axis = perm.index(attr(dq, "axis", 1) % values.ndim)
            new_attrs.append(onnx.helper.make_attribute("axis", axis))
        dq.input[0] = index.add_initializer(np.ascontiguousarray(values.transpose(perm)), f"{weight.name}_transposed")
        del dq.attribute[:]
        dq.attribute.extend(new_attrs)
        dq.output[0] = node.output[0]
        index.graph.node.remove(node)
        count += 1
    return count


def hoist_quantize(index: GraphIndex) -> int:
    """``op -> QuantizeLinear`` becomes ``QuantizeLinear -> op`` for layout ops and pooled Convs.

    A Brevitas activation quantizer sits where the next quantized layer starts, e.g. after
    ``Conv -> Relu -> MaxPool -> Flatten``, so the Conv's output never reaches a QuantizeLinear and
    cannot become a QLinearConv. Moving the quantizer up next to the producer is exact: layout
    ops only move or copy elements, and MaxPool picks maxima, which commutes with the
    non-decreasing per-tensor quantization (``Q(max(a, b)) == max(Q(a), Q(b))``). The moved ops
    then run on 8-bit integers. MaxPool is only crossed when a Conv (optionally followed by a
    Relu) feeds it: onnxruntime's integer MaxPool is fast in the NHWC layout it uses after
    QLinearConv, and ~30x slower than float MaxPool anywhere else.
    """
    count = 0
    for q in list(index.graph.node):
        if activation_qparams(index, q) is None:
            continue
        op = index.producer.get(q.input[0])
        if op is None or op.op_type not in ORDER_PRESERVING_OPS or not single_output(op):
            continue
        if index.sole_consumer(op.output[0]) is not q or op.input[0] in index.inits:
            continue
        if op.op_type == "MaxPool" and not _conv_output(index, op.input[0]):
            continue
        _swap(op, q, index.fresh_name(f"{op.input[0]}_quantized"))
        count += 1
    return count


def _swap(first: onnx.NodeProto, second: onnx.NodeProto, between: str) -> None:
    """``first -> second`` (each on its input 0 / output 0) becomes ``second -> first``, joined by ``between``."""
    second.input[0], first.input[0] = first.input[0], between
    first.output[0], second.output[0] = second.output[0], between


def _conv_output(index: GraphIndex, name: str) -> bool:
    """Whether ``name`` is computed by a Conv, possibly through one Relu."""
    producer = index.producer.get(name)
    if producer is not None and producer.op_type == "Relu":
        producer = index.producer.get(producer.input[0])
    return producer is not None and producer.op_type == "Conv"


def sink_dequantize(index: GraphIndex) -> int:
    """``DequantizeLinear -> layout op`` becomes ``layout op -> DequantizeLinear``.

    The mirror image of :func:`hoist_quantize`: a ``Flatten`` or ``Reshape`` between an
    activation's DequantizeLinear and the Gemm that reads it hides the Gemm from QDQ fusion.
    Exact because dequantization is elementwise and layout ops only move elements.
    """
    count = 0
    for dq in list(index.graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] in index.inits or qparams(index, dq) is None:
            continue
        op = index.sole_consumer(dq.output[0])
        if op is None or op.op_type not in LAYOUT_OPS or not single_output(op):
            continue
        if op.input[0] != dq.output[0] or dq.output[0] in op.input[1:]:
            continue
        _swap(dq, op, index.fresh_name(f"{op.output[0]}_quantized"))
        count += 1
    return count



def gather_before_dequantize(index: GraphIndex) -> int:
    """``DequantizeLinear(W) -> Gather(indices)`` becomes ``Gather(W, indices) -> DequantizeLinear``.

    A quantized embedding table (``QuantEmbedding``) comes out of Brevitas as a DequantizeLinear of the whole
    table in front of its Gather, which onnxruntime evaluates on every run (it does not fold DequantizeLinear):
    for a 30k x 384 vocabulary that is 11.7M multiplications per batch to look up a few hundred rows. With a
    per-tensor scale and zero point dequantization is elementwise with one pair of numbers, so gathering the
    integer rows first and dequantizing only them gives identical values.
    """
    count = 0
    for gather in list(index.graph.node):
        if gather.op_type != "Gather" or attr(gather, "axis", 0) != 0:
            continue
        dq = index.producer.get(gather.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or index.sole_consumer(dq.output[0]) is not gather:
            continue
        if dq.input[0] not in index.inits or attr(dq, "block_size", 0):
            continue
        scale = index.const(dq.input[1])
        zero_point = index.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if scale is None or scale.ndim != 0 or (zero_point is not None and zero_point.ndim != 0):
            continue
        _swap(dq, gather, index.fresh_name(f"{gather.output[0]}_quantized"))
        count += 1
    return count
