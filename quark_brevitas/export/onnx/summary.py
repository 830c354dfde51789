"""What an exported QCDQ file stores, for its :class:`~quark_brevitas.export.onnx.qcdq.ExportReport`.

Reads the written graph rather than trusting the steps that built it: the ONNX types actually feeding
the weight and bias operands, the number of quantize/dequantize nodes and the bytes still held in
floating point.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.onnx.passes.graph import BIAS_CONSUMERS, LAYOUT_OPS, WEIGHT_CONSUMERS, attr

_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


def operand_dtypes(graph: onnx.GraphProto, consumers: frozenset[str], index: int) -> tuple[str, ...]:
    """ONNX type names of the initializers feeding operand ``index`` of the ``consumers`` ops, directly or
    through a DequantizeLinear (and layout ops)."""
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    found: set[str] = set()
    for node in graph.node:
        if node.op_type not in consumers or len(node.input) <= index or not node.input[index]:
            continue
        name = node.input[index]
        producer = producers.get(name)
        # bias-free Linear layers come out as DequantizeLinear -> Transpose -> MatMul
        while producer is not None and producer.op_type in LAYOUT_OPS:
            name = producer.input[0]
            producer = producers.get(name)
        if producer is not None and producer.op_type == "DequantizeLinear":
            name = producer.input[0]
        if name in inits:
            found.add(TensorProto.DataType.Name(inits[name].data_type))
    return tuple(sorted(found))


def weight_dtypes(graph: onnx.GraphProto) -> tuple[str, ...]:
    """ONNX types of the weights of Conv/ConvTranspose/Gemm/MatMul, e.g. ``("INT8",)``; the codes of a
    ``MatMulNBits`` (packed into uint8, stored unsigned with their zero points) count as ``UINT4`` / ``UINT8``."""
    nbits = {f"UINT{attr(node, 'bits', 4)}" for node in graph.node if node.op_type == "MatMulNBits"}
    return tuple(sorted(set(operand_dtypes(graph, WEIGHT_CONSUMERS, 1)) | nbits))


def bias_dtypes(graph: onnx.GraphProto) -> tuple[str, ...]:
    """ONNX types of the biases of Conv/ConvTranspose/Gemm, e.g. ``("INT32",)``."""
    return operand_dtypes(graph, BIAS_CONSUMERS, 2)


def count_ops(graph: onnx.GraphProto, op_type: str) -> int:
    """Number of ``op_type`` nodes in the graph."""
    return sum(n.op_type == op_type for n in graph.node)


def float_initializer_bytes(graph: onnx.GraphProto) -> int:
    """Bytes held by floating-point initializers (scales, float layers)."""
    return sum(numpy_helper.to_array(i).nbytes for i in graph.initializer if i.data_type in _FLOAT_TYPES)
