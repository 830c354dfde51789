"""ONNX graph passes applied to Brevitas' QCDQ export.

Constant folding of weight ``QuantizeLinear``/``Clip`` nodes into integer (or float8) initializers,
graph cleanup, and the exact rewrites that give onnxruntime complete QDQ groups for its integer
kernels (``_INTEGER_KERNEL_REWRITES``), plus moving float biases out of quantized layers when
onnxruntime's int32 bias rounding breaks the tolerance.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.inspect import DEFAULT_INT_OPSET

logger = logging.getLogger(__name__)

_ONNX_TO_TORCH_QTYPE: dict[int, torch.dtype] = {
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.UINT16: torch.uint16,
    TensorProto.INT32: torch.int32,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}


_WEIGHT_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_BIAS_CONSUMERS = frozenset({"Conv", "ConvTranspose", "Gemm"})
_LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


# --------------------------------------------------------------------------------------------
# ONNX post-processing
# --------------------------------------------------------------------------------------------


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(onnx.helper.get_attribute_value(a))
    return default


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
    if _attr(node, "block_size", 0) != 0 or _attr(node, "saturate", 1) != 1:
        return None
    x_proto, s_proto = inits[node.input[0]], inits[node.input[1]]
    zp_proto = inits[node.input[2]] if len(node.input) > 2 and node.input[2] else None
    out_type = zp_proto.data_type if zp_proto is not None else TensorProto.UINT8
    dtype = _ONNX_TO_TORCH_QTYPE.get(out_type)
    if dtype is None:
        return None
    x = torch.from_numpy(np.asarray(numpy_helper.to_array(x_proto), dtype=np.float32).copy())
    scale = torch.from_numpy(np.asarray(numpy_helper.to_array(s_proto), dtype=np.float32).copy())
    zp = (
        torch.from_numpy(np.asarray(numpy_helper.to_array(zp_proto)).astype(np.float32))
        if zp_proto is not None
        else torch.zeros(())
    )
    axis = _attr(node, "axis", 1)
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


def _fold_constant_quantization(graph: onnx.GraphProto) -> int:
    """Fold ``QuantizeLinear``/integer ``Clip`` nodes whose inputs are all initializers."""
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


def _clean_graph(graph: onnx.GraphProto) -> None:
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


def _operand_dtypes(graph: onnx.GraphProto, consumers: frozenset[str], index: int) -> tuple[str, ...]:
    inits = {init.name: init for init in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    found: set[str] = set()
    for node in graph.node:
        if node.op_type not in consumers or len(node.input) <= index or not node.input[index]:
            continue
        name = node.input[index]
        producer = producers.get(name)
        # bias-free Linear layers come out as DequantizeLinear -> Transpose -> MatMul
        while producer is not None and producer.op_type in _LAYOUT_OPS:
            name = producer.input[0]
            producer = producers.get(name)
        if producer is not None and producer.op_type == "DequantizeLinear":
            name = producer.input[0]
        if name in inits:
            found.add(TensorProto.DataType.Name(inits[name].data_type))
    return tuple(sorted(found))


# --------------------------------------------------------------------------------------------
# Rewrites for onnxruntime's integer kernels
# --------------------------------------------------------------------------------------------
#
# onnxruntime executes a QDQ graph with integer kernels only where its QDQ fusions find complete
# ``DequantizeLinear -> op [-> QuantizeLinear]`` groups (QGemm, QLinearConv, QLinearMatMul,
# MatMulIntegerToFloat, integer MaxPool, ...). An op left outside such a group runs in float32
# and, worse, dequantizes its int8 weight on every call, which makes the "quantized" model slower
# than the float one. Brevitas' QCDQ graph breaks these groups in a few ways; each rewrite below
# repairs one of them. Every rewrite is exact -- the rewritten graph computes the same values as
# the original on every input, argued in its docstring. Activations are only touched where their
# QuantizeLinear/DequantizeLinear are 8-bit integer with constant scalar (per-tensor) scale and
# zero point (sub-8-bit formats are stored as int8, so they qualify); weights and biases only
# where they are constant integer initializers; float8 tensors are never touched. The exporter
# still verifies the rewritten file against PyTorch.

#: Rewrites need integer Clip and MaxPool (opset >= 12); applied from the default int opset up.
_MIN_REWRITE_OPSET = DEFAULT_INT_OPSET
_MAX_REWRITE_ROUNDS = 8
_INT8_RANGE: dict[int, tuple[int, int]] = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255)}
_NUMPY_INT8 = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8}
#: Ops that commute with an (increasing) per-tensor quantize/dequantize: they only move, copy or
#: select elements (MaxPool selects the largest, and Q/DQ preserve order).
_ORDER_PRESERVING_OPS = frozenset({"Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})


class _QParams(NamedTuple):
    """Constant scalar scale / zero point of an 8-bit integer QuantizeLinear or DequantizeLinear."""

    scale: float
    zero_point: int
    onnx_type: int  # TensorProto.INT8 or TensorProto.UINT8

    @property
    def low(self) -> int:
        return _INT8_RANGE[self.onnx_type][0]


class _GraphIndex:
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
        init = self.inits.get(name) if name else None
        return None if init is None else numpy_helper.to_array(init)

    def sole_consumer(self, name: str) -> onnx.NodeProto | None:
        """The only node reading ``name`` (``None`` if several, none, or a graph output)."""
        users = self.consumers.get(name, [])
        if name in self.graph_outputs or len(users) != 1:
            return None
        return users[0]

    def fresh_name(self, hint: str) -> str:
        name, k = hint, 1
        while name in self.names:
            name, k = f"{hint}_{k}", k + 1
        self.names.add(name)
        return name

    def add_initializer(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh_name(hint)
        init = numpy_helper.from_array(np.asarray(array), name=name)
        self.graph.initializer.append(init)
        self.inits[name] = init
        return name


def _qparams(index: _GraphIndex, node: onnx.NodeProto) -> _QParams | None:
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
    if onnx_type not in _INT8_RANGE or not (math.isfinite(value) and value > 0):
        return None
    return _QParams(value, int(zero_point), onnx_type)


def _is_activation_q(index: _GraphIndex, node: onnx.NodeProto) -> _QParams | None:
    """Parameters of a QuantizeLinear of a run-time tensor, for 8-bit integer per-tensor Q."""
    if node.op_type != "QuantizeLinear" or node.input[0] in index.inits:
        return None
    return _qparams(index, node)


def _single_output(node: onnx.NodeProto) -> bool:
    return sum(1 for name in node.output if name) == 1


def _transpose_weights_offline(index: _GraphIndex) -> int:
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
        if weight is None or weight.data_type not in _INT8_RANGE:
            continue
        scale = index.const(dq.input[1])
        if scale is None or scale.ndim > 1 or _attr(dq, "block_size", 0):
            continue
        values = numpy_helper.to_array(weight)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None) or list(
            reversed(range(values.ndim))
        )
        new_attrs = [a for a in dq.attribute if a.name != "axis"]
        if scale.ndim == 1:
            axis = perm.index(_attr(dq, "axis", 1) % values.ndim)
            new_attrs.append(onnx.helper.make_attribute("axis", axis))
        dq.input[0] = index.add_initializer(np.ascontiguousarray(values.transpose(perm)), f"{weight.name}_transposed")
        del dq.attribute[:]
        dq.attribute.extend(new_attrs)
        dq.output[0] = node.output[0]
        index.graph.node.remove(node)
        count += 1
    return count


def _fold_unfusable_bias(index: _GraphIndex) -> int:
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
        if node.op_type not in _BIAS_CONSUMERS or len(node.input) < 3 or not node.input[2]:
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


def _bias_scale_matches(index: _GraphIndex, node: onnx.NodeProto, bias_scale: np.ndarray) -> bool:
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


def _hoist_quantize(index: _GraphIndex) -> int:
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
        if _is_activation_q(index, q) is None:
            continue
        op = index.producer.get(q.input[0])
        if op is None or op.op_type not in _ORDER_PRESERVING_OPS or not _single_output(op):
            continue
        if index.sole_consumer(op.output[0]) is not q or op.input[0] in index.inits:
            continue
        if op.op_type == "MaxPool" and not _conv_output(index, op.input[0]):
            continue
        moved = index.fresh_name(f"{op.input[0]}_quantized")
        q.input[0], op.input[0] = op.input[0], moved
        op.output[0], q.output[0] = q.output[0], moved
        count += 1
    return count


def _conv_output(index: _GraphIndex, name: str) -> bool:
    """Whether ``name`` is computed by a Conv, possibly through one Relu."""
    producer = index.producer.get(name)
    if producer is not None and producer.op_type == "Relu":
        producer = index.producer.get(producer.input[0])
    return producer is not None and producer.op_type == "Conv"


def _sink_dequantize(index: _GraphIndex) -> int:
    """``DequantizeLinear -> layout op`` becomes ``layout op -> DequantizeLinear``.

    The mirror image of :func:`_hoist_quantize`: a ``Flatten`` or ``Reshape`` between an
    activation's DequantizeLinear and the Gemm that reads it hides the Gemm from QDQ fusion.
    Exact because dequantization is elementwise and layout ops only move elements.
    """
    count = 0
    for dq in list(index.graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] in index.inits or _qparams(index, dq) is None:
            continue
        op = index.sole_consumer(dq.output[0])
        if op is None or op.op_type not in _LAYOUT_OPS or not _single_output(op):
            continue
        if op.input[0] != dq.output[0] or dq.output[0] in op.input[1:]:
            continue
        moved = index.fresh_name(f"{op.output[0]}_quantized")
        op.input[0], dq.input[0] = dq.input[0], moved
        op.output[0], dq.output[0] = moved, op.output[0]
        count += 1
    return count


def _integer_relu(index: _GraphIndex) -> int:
    """``Relu -> QuantizeLinear`` becomes ``QuantizeLinear -> Clip(min=zero point)``.

    onnxruntime only fuses ``op -> Relu -> Q`` when the Relu is redundant, i.e. when the zero
    point is the lowest code; with Brevitas' signed symmetric activations (zero point 0) it fuses
    nothing and the whole layer runs in float. Quantization is non-decreasing and ``Q(0)`` is the
    zero point, so ``Q(max(x, 0)) == max(Q(x), zp)`` exactly: the ReLU becomes an integer Clip
    after the quantizer (merged into a Brevitas low-bit Clip that is already there), or disappears
    when the zero point is the lowest code.
    """
    count = 0
    for relu in list(index.graph.node):
        if relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
            continue
        q = index.sole_consumer(relu.output[0])
        params = _is_activation_q(index, q) if q is not None else None
        if params is None:
            continue
        q.input[0] = relu.input[0]
        index.graph.node.remove(relu)
        count += 1
        if params.zero_point <= params.low:
            continue
        if _raise_clip_minimum(index, q, params):
            continue
        quantized = index.fresh_name(f"{q.output[0]}_before_relu")
        relu_clip = onnx.helper.make_node(
            "Clip", [quantized, q.input[2]], [q.output[0]], name=index.fresh_name(f"{relu.name or 'Relu'}_integer")
        )
        q.output[0] = quantized
        index.graph.node.append(relu_clip)
    return count


def _raise_clip_minimum(index: _GraphIndex, q: onnx.NodeProto, params: _QParams) -> bool:
    """Raise the lower bound of the Clip (if any) that alone reads ``q`` to ``q``'s zero point."""
    clip = index.sole_consumer(q.output[0])
    if clip is None or clip.op_type != "Clip" or clip.attribute or clip.input[0] != q.output[0]:
        return False
    low = index.const(clip.input[1]) if len(clip.input) > 1 else None
    if low is None:
        return False
    value = np.array(max(int(low), params.zero_point), dtype=_NUMPY_INT8[params.onnx_type])
    clip.input[1] = index.add_initializer(value, f"{q.output[0]}_relu_min")
    return True


def _drop_noop_integer_clips(index: _GraphIndex) -> int:
    """Remove integer Clips whose bounds include the whole range of their 8-bit type."""
    count = 0
    for clip in list(index.graph.node):
        if clip.op_type != "Clip" or clip.attribute or clip.output[0] in index.graph_outputs:
            continue
        if not _integer_clip_bounds(index, clip):
            continue
        bounds = [name for name in clip.input[1:3] if name]
        type_low, type_high = _INT8_RANGE[index.inits[bounds[0]].data_type]
        low = index.const(clip.input[1]) if len(clip.input) > 1 else None
        high = index.const(clip.input[2]) if len(clip.input) > 2 else None
        if (low is not None and int(low) > type_low) or (high is not None and int(high) < type_high):
            continue
        for user in index.consumers.get(clip.output[0], []):
            for i, name in enumerate(user.input):
                if name == clip.output[0]:
                    user.input[i] = clip.input[0]
        index.graph.node.remove(clip)
        count += 1
    return count


def _sink_integer_clips(index: _GraphIndex) -> int:
    """``integer Clip -> MaxPool`` becomes ``MaxPool -> Clip``.

    Keeps MaxPool right behind the QLinearConv, where onnxruntime runs it in NHWC
    (``NhwcMaxPool``); with a Clip in between it falls back to its slow NCHW integer MaxPool.
    Clip is non-decreasing, so it commutes with taking maxima; it also runs on 4x fewer values.
    """
    count = 0
    for clip in list(index.graph.node):
        if clip.op_type != "Clip" or clip.attribute or not _integer_clip_bounds(index, clip):
            continue
        pool = index.sole_consumer(clip.output[0])
        if pool is None or pool.op_type != "MaxPool" or not _single_output(pool) or pool.input[0] != clip.output[0]:
            continue
        pool.input[0], clip.input[0] = clip.input[0], clip.output[0]
        pool.output[0], clip.output[0] = clip.output[0], pool.output[0]
        count += 1
    return count


def _integer_clip_bounds(index: _GraphIndex, clip: onnx.NodeProto) -> bool:
    """Whether the Clip has constant 8-bit integer bounds (so its data is an 8-bit tensor)."""
    bounds = [name for name in clip.input[1:3] if name]
    return bool(bounds) and all(
        name in index.inits and index.inits[name].data_type in _INT8_RANGE for name in bounds
    )


def _int8_activation_tree(index: _GraphIndex, q: onnx.NodeProto) -> list[onnx.NodeProto] | None:
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
                params = _qparams(index, user)
                if params is None or params.onnx_type != TensorProto.INT8:
                    return None
            elif user.op_type == "Clip" and not user.attribute:
                if any(n and (n not in index.inits or index.inits[n].data_type != TensorProto.INT8)
                       for n in user.input[1:3]):
                    return None
                pending.append(user.output[0])
            elif user.op_type in _ORDER_PRESERVING_OPS and _single_output(user):
                pending.append(user.output[0])
            else:
                return None
            tree.append(user)
    return tree


def _unsigned_activations(index: _GraphIndex) -> int:
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
        params = _is_activation_q(index, q)
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


def _drop_zero_bias_zero_points(index: _GraphIndex) -> int:
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


_FLOAT_BIAS_REWRITE = "float biases moved out of quantized layers"


def _move_float_biases_out(model: onnx.ModelProto) -> int:
    """``Gemm/Conv(DQ(x), DQ(W), float b)`` becomes ``Gemm/Conv(DQ(x), DQ(W)) + b``.

    onnxruntime quantizes such a float bias itself (``WeightBiasQuantization``: int32 with scale
    input scale x weight scale) so that it can fuse the layer, which rounds the bias; for low bit
    widths that can move the output by more than the tolerance. Not applied by default (usually
    the rounding is harmless and the fused layer fast), but when the verification fails: as a
    separate Add the bias keeps its exact float value, a Gemm still becomes a QGemm (with float
    output) and a Conv stays unfused.
    """
    index = _GraphIndex(model.graph)
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
        _topological_sort(model.graph)
        _clean_graph(model.graph)
    return count


_INTEGER_KERNEL_REWRITES: tuple[tuple[str, Callable[[_GraphIndex], int]], ...] = (
    ("weight transposes done offline", _transpose_weights_offline),
    ("biases dequantized offline (scale is not input x weight scale)", _fold_unfusable_bias),
    ("quantizers moved above layout ops and MaxPool", _hoist_quantize),
    ("dequantizers moved below layout ops", _sink_dequantize),
    ("ReLUs moved into the integer domain", _integer_relu),
    ("no-op integer Clips removed", _drop_noop_integer_clips),
    ("integer Clips moved below MaxPool", _sink_integer_clips),
    ("int8 activations stored as uint8", _unsigned_activations),
    ("zero bias zero points dropped", _drop_zero_bias_zero_points),
)


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for node in graph.node for a in node.attribute
    )


def _topological_sort(graph: onnx.GraphProto) -> None:
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


def _rewrite_for_integer_kernels(model: onnx.ModelProto) -> tuple[tuple[str, int], ...]:
    """Apply the rewrites above until none applies; returns ``(description, count)`` pairs.

    One rewrite can enable another (a ReLU moved behind its quantizer lets the quantizer move on
    up), so the whole sequence is repeated until a round changes nothing. No rewrite undoes
    another, so this ends after a few rounds; graphs with control flow are left alone.
    """
    graph = model.graph
    if _opset_of(model) < _MIN_REWRITE_OPSET or _has_subgraphs(graph):
        return ()
    totals = dict.fromkeys((description for description, _ in _INTEGER_KERNEL_REWRITES), 0)
    for _ in range(_MAX_REWRITE_ROUNDS):
        changed = 0
        for description, rewrite in _INTEGER_KERNEL_REWRITES:
            while applied := rewrite(_GraphIndex(graph)):
                totals[description] += applied
                changed += applied
        if not changed:
            break
    _topological_sort(graph)
    done = tuple((description, n) for description, n in totals.items() if n)
    for description, n in done:
        logger.debug("integer-kernel rewrite: %s (%d)", description, n)
    return done


def _postprocess(model: onnx.ModelProto, *, integer_kernels: bool) -> tuple[int, tuple[tuple[str, int], ...]]:
    folded = _fold_constant_quantization(model.graph)
    rewrites = _rewrite_for_integer_kernels(model) if integer_kernels else ()
    _clean_graph(model.graph)
    return folded, rewrites


def _opset_of(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ExportError("exported ONNX model declares no default-domain opset")
