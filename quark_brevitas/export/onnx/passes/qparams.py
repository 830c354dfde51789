"""What the integer-kernel rewrites may touch: 8-bit per-tensor quantize/dequantize nodes.

Activations are only rewritten where their ``QuantizeLinear``/``DequantizeLinear`` are 8-bit integer
with a constant scalar (per-tensor) scale and zero point (sub-8-bit formats are stored as int8, so they
qualify); this module recognises such nodes and names the ops that commute with them. Shared by the
rewrite modules so that they agree on one rule.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto

from quark_brevitas.export.onnx.passes.graph import GraphIndex

#: Value range of the 8-bit integer types the rewrites handle.
INT8_RANGE: dict[int, tuple[int, int]] = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255)}
#: numpy dtype of each of those types.
NUMPY_INT8 = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8}
#: Ops that commute with an (increasing) per-tensor quantize/dequantize: they only move, copy or
#: select elements (MaxPool selects the largest, and Q/DQ preserve order).
ORDER_PRESERVING_OPS = frozenset({"Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})


class QParams(NamedTuple):
    """Constant scalar scale / zero point of an 8-bit integer QuantizeLinear or DequantizeLinear."""

    scale: float
    zero_point: int
    onnx_type: int  # TensorProto.INT8 or TensorProto.UINT8

    @property
    def low(self) -> int:
        """The lowest code of the type."""
        return INT8_RANGE[self.onnx_type][0]


def qparams(index: GraphIndex, node: onnx.NodeProto) -> QParams | None:
    """Per-tensor 8-bit integer parameters of a Q/DQ node with constant scale and zero point."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return None
    if len(node.input) < 3 or not node.input[2]:
        return None
    scale, zero_point = index.const(node.input[1]), index.const(node.input[2])
    if scale is None or zero_point is None or scale.ndim != 0 or zero_point.ndim != 0:
        return None
    onnx_type = index.inits[node.input[2]].data_type
    value = float(scale)
    if onnx_type not in INT8_RANGE or not (math.isfinite(value) and value > 0):
        return None
    return QParams(value, int(zero_point), onnx_type)


def activation_qparams(index: GraphIndex, node: onnx.NodeProto) -> QParams | None:
    """Parameters of a QuantizeLinear of a run-time tensor, for 8-bit integer per-tensor Q."""
    if node.op_type != "QuantizeLinear" or node.input[0] in index.inits:
        return None
    return qparams(index, node)
