"""Integer-kernel rewrites of ReLUs and integer Clips.

onnxruntime fuses ``op -> Relu -> QuantizeLinear`` only when the Relu is redundant, runs MaxPool in its
fast NHWC layout only right behind a QLinearConv, and keeps no-op integer Clips as separate nodes.
These rewrites move ReLUs behind their quantizer as integer Clips, drop Clips that clip nothing and sink
Clips below MaxPool; quantization and Clip are non-decreasing, so each move is exact (argued in its
docstring).
"""

from __future__ import annotations

import numpy as np
import onnx

from quark_brevitas.export.onnx.passes.graph import GraphIndex, single_output
from quark_brevitas.export.onnx.passes.qparams import INT8_RANGE, NUMPY_INT8, QParams, activation_qparams


def integer_relu(index: GraphIndex) -> int:
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
        params = activation_qparams(index, q) if q is not None else None
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


def _raise_clip_minimum(index: GraphIndex, q: onnx.NodeProto, params: QParams) -> bool:
    """Raise the lower bound of the Clip (if any) that alone reads ``q`` to ``q``'s zero point."""
    clip = index.sole_consumer(q.output[0])
    if clip is None or clip.op_type != "Clip" or clip.attribute or clip.input[0] != q.output[0]:
        return False
    low = index.const(clip.input[1]) if len(clip.input) > 1 else None
    if low is None:
        return False
    value = np.array(max(int(low), params.zero_point), dtype=NUMPY_INT8[params.onnx_type])
    clip.input[1] = index.add_initializer(value, f"{q.output[0]}_relu_min")
    return True


def drop_noop_integer_clips(index: GraphIndex) -> int:
    """Remove integer Clips whose bounds include the whole range of their 8-bit type."""
    count = 0
    for clip in list(index.graph.node):
        if clip.op_type != "Clip" or clip.attribute or clip.output[0] in index.graph_outputs:
            continue
        if not _integer_clip_bounds(index, clip):
            continue
        bounds = [name for name in clip.input[1:3] if name]
        type_low, type_high = INT8_RANGE[index.inits[bounds[0]].data_type]
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


def sink_integer_clips(index: GraphIndex) -> int:
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
        if pool is None or pool.op_type != "MaxPool" or not single_output(pool) or pool.input[0] != clip.output[0]:
            continue
        pool.input[0], clip.input[0] = clip.input[0], clip.output[0]
        pool.output[0], clip.output[0] = clip.output[0], pool.output[0]
        count += 1
    return count


def _integer_clip_bounds(index: GraphIndex, clip: onnx.NodeProto) -> bool:
    """Whether the Clip has constant 8-bit integer bounds (so its data is an 8-bit tensor)."""
    bounds = [name for name in clip.input[1:3] if name]
    return bool(bounds) and all(
        name in index.inits and index.inits[name].data_type in INT8_RANGE for name in bounds
    )

