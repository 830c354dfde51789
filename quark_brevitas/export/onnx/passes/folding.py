"""Constant folding of weight quantization in Brevitas's QCDQ graph.

Brevitas writes a weight as ``QuantizeLinear(float initializer)`` (float8 weights always, integer ones
followed by a ``Clip`` for narrow ranges and low bit widths). Evaluating those nodes once, with ONNX's
semantics, stores the weight as integer (or float8) codes: the file is smaller and onnxruntime sees
the ``DequantizeLinear(constant)`` its fusions look for.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.onnx.onnx_types import ONNX_TO_TORCH
from quark_brevitas.export.onnx.passes.graph import attr


def _axis_view(values: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    if values.ndim == 0:
        return values
    if ndim == 0:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return values.reshape(shape)


def _fold_quantize(node: onnx.NodeProto, inits: Mapping[str, TensorProto]) -> TensorProto | None:
    """Evaluate ``QuantizeLinear`` of a constant (ONNX semantics, round-half-to-even)."""
    if attr(node, "block_size", 0) != 0 or attr(node, "saturate", 1) != 1:
        return None
    x_proto, s_proto = inits[node.input[0]], inits[node.input[1]]
    zp_proto = inits[node.input[2]] if len(node.input) > 2 and node.input[2] else None
    out_type = zp_proto.data_type if zp_proto is not None else TensorProto.UINT8
    dtype = ONNX_TO_TORCH.get(out_type)
    if dtype is None:
        return None
    x = torch.from_numpy(np.asarray(numpy_helper.to_array(x_proto), dtype=np.float32).copy())
    scale = torch.from_numpy(np.asarray(numpy_helper.to_array(s_proto), dtype=np.float32).copy())
    zp = (
        torch.from_numpy(np.asarray(numpy_helper.to_array(zp_proto)).astype(np.float32))
        if zp_proto is not None
        else torch.zeros(())
    )
    axis = attr(node, "axis", 1)
    scale = _axis_view(scale, x.ndim, axis)
    zp = _axis_view(zp, x.ndim, axis)
    q = x / scale
    if dtype.is_floating_point:
        if bool((zp != 0).any()):
            return None
        limit = float(torch.finfo(dtype).max)
        q = q.clamp(-limit, limit).to(dtype)
        raw = q.contiguous().view(torch.uint8).numpy().tobytes()
        return onnx.helper.make_tensor(node.output[0], out_type, list(q.shape), raw, raw=True)
    info = torch.iinfo(dtype)
    q = (torch.round(q) + zp).clamp(info.min, info.max).to(dtype)
    return numpy_helper.from_array(q.numpy(), name=node.output[0])


def _fold_clip(node: onnx.NodeProto, inits: Mapping[str, TensorProto]) -> TensorProto | None:
    """Evaluate ``Clip`` of a constant integer tensor (Brevitas' narrow-range/low-bit weight clip)."""
    if node.attribute:
        return None
    data = numpy_helper.to_array(inits[node.input[0]])
    if not np.issubdtype(data.dtype, np.integer):
        return None
    low = numpy_helper.to_array(inits[node.input[1]]) if len(node.input) > 1 and node.input[1] else None
    high = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
    clipped = np.clip(data, low, high).astype(data.dtype)
    return numpy_helper.from_array(clipped, name=node.output[0])


def fold_constant_quantization(graph: onnx.GraphProto) -> int:
    """Fold ``QuantizeLinear``/integer ``Clip`` nodes whose inputs are all initializers; returns how many."""
    folded = 0
    changed = True
    while changed:
        changed = False
        inits = {init.name: init for init in graph.initializer}
        for node in list(graph.node):
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "Clip"):
                continue
            if not node.input or any(name and name not in inits for name in node.input):
                continue
            fold = _fold_quantize if node.op_type == "QuantizeLinear" else _fold_clip
            tensor = fold(node, inits)
            if tensor is None:
                continue
            graph.node.remove(node)
            graph.initializer.append(tensor)
            inits[tensor.name] = tensor
            folded += 1
            changed = True
    return folded
