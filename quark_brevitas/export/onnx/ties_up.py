"""Ties-up activations (``RoundType.half_up``) in a QONNX file, stated with the ops every QONNX reader has.

FINN turns an activation ``Quant`` into a ``MultiThreshold`` that counts ``x >= (k + 1/2) * scale``: ties round up.
QONNX's ``Quant`` with ``rounding_mode="ROUND"`` is ``np.round``, ties to even, and the qonnx that FINN pins knows
no other rounding to nearest. Where the graph's arithmetic is exact (power-of-two scales, integer accumulation:
the values reaching a quantizer lie on a grid of the step's powers of two), exact ties are frequent and the two
rules disagree on them, so FINN's converted model would compute something else than the file.

A ``half_up`` quantizer rounds ``x / scale + 2^-16`` half to even (:data:`~quark_brevitas.quantizers.TIES_UP_OFFSET`):
on any grid of at least 2^-15 steps that is ties up, and elsewhere it changes nothing. Brevitas writes such a node
with the ``rounding_mode`` :data:`~quark_brevitas.quantizers.TIES_UP_MODE`; :func:`rewrite_ties_up` replaces it with
``Add(x, offset)`` in front of a ``Quant`` that rounds half to even (the offset: half the step of the grid the input
is known to lie on, else ``scale * 2^-16``), which is the same arithmetic exactly when the scale is a power of two
(dividing by it is exact in float32). In front of a quantized ReLU the ``Add`` goes
before the ``Relu``, as ``ReLU(x + e)`` quantizes like ``ReLU(x) + e`` for ``e`` below half a step, and FINN's ReLU
handler needs the ``Relu`` right before the ``Quant``. FINN absorbs the ``Add`` into the thresholds it builds.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.onnx.passes.graph import BIAS_CONSUMERS, GRID_KEEPING_OPS, GraphIndex
from quark_brevitas.quantizers import TIES_UP_MODE, TIES_UP_OFFSET

__all__ = ["fold_bias_quants", "rewrite_ties_up"]


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _is_power_of_two(values: np.ndarray) -> bool:
    mantissa, _ = np.frexp(values.astype(np.float64))
    return bool(values.size) and bool(np.all(values > 0)) and bool(np.all(mantissa == 0.5))


#: Ops whose output is on their input's grid: the layout and pooling ops, and a ReLU (of values on a grid).
_KEEPS_GRID = GRID_KEEPING_OPS | {"Relu"}


def _input_grid(tensor: str, index: GraphIndex) -> np.ndarray | None:
    """The step of the grid ``tensor`` lies on when it comes from per-tensor power-of-two ``Quant`` nodes through
    grid-keeping ops (and adds / concatenations of such values: the finest of their steps); ``None`` when
    unknown."""
    node = index.producer.get(tensor)
    while node is not None and node.op_type in _KEEPS_GRID:
        node = index.producer.get(node.input[0])
    if node is None:
        return None
    if node.op_type in ("Concat", "Add", "Sub"):  # a merge of values on grids is on the finest of them
        if any(name in index.inits for name in node.input):
            return None  # a constant added: not a grid this function knows
        grids = [_input_grid(name, index) for name in node.input]
        return None if any(g is None for g in grids) else min(grids, key=lambda g: float(g.max()))
    value = index.const(node.input[1]) if node.op_type == "Quant" else None
    return value if value is not None and value.size == 1 and _is_power_of_two(value) else None


#: qonnx's ``RemoveIdentityOps`` removes an ``Add`` whose constant is within this of zero (its default ``atol``).
_IDENTITY_ATOL = 1e-5


def _scaled_offset(name: str, tensor: str, scale: np.ndarray, shape: list[int] | None
                   ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """``x + scale * 2^-16`` as ``(x * (2^16 / scale) + 1) * (scale / 2^16)``: the same value exactly (power-of-two
    factors, and ``x / scale`` on a grid of 2^-15 steps below 2^8), with no constant that qonnx's
    ``RemoveIdentityOps`` takes for an identity. Used where the value feeds other nodes too: qonnx removes a
    near-zero ``Add`` by renaming its input, which breaks the input's other readers."""
    up = (np.float32(1 / TIES_UP_OFFSET) / scale).astype(np.float32)
    down = (scale * np.float32(TIES_UP_OFFSET)).astype(np.float32)
    one = np.ones_like(scale, dtype=np.float32)
    inits = [numpy_helper.from_array(_per_channel(value, shape), f"{name}_ties_up_{suffix}")
             for value, suffix in ((up, "up"), (one, "one"), (down, "down"))]
    nodes = [helper.make_node("Mul", [tensor, f"{name}_ties_up_up"], [f"{name}_ties_up_scaled"],
                              name=f"{name}_ties_up_scale"),
             helper.make_node("Add", [f"{name}_ties_up_scaled", f"{name}_ties_up_one"], [f"{name}_ties_up_shifted"],
                              name=f"{name}_ties_up"),
             helper.make_node("Mul", [f"{name}_ties_up_shifted", f"{name}_ties_up_down"], [f"{name}_ties_up_input"],
                              name=f"{name}_ties_up_unscale")]
    return nodes, inits, f"{name}_ties_up_input"


def _per_channel(offset: np.ndarray, shape: list[int] | None) -> np.ndarray:
    """A per-tensor ``offset`` repeated over the channel axis (1) of a value of ``shape``: FINN absorbs a per-channel
    ``Add`` into the thresholds behind it, but a scalar ``Add`` right behind another quantizer's thresholds it takes
    for the sign bias of a signed export (``AbsorbSignBiasIntoMultiThreshold``) and fails on. Per-channel offsets
    (and values of unknown shape or one channel) stay as they are."""
    if offset.size != 1 or not shape or len(shape) < 2 or shape[1] <= 1:
        return offset
    return np.full([1, shape[1], *[1] * (len(shape) - 2)], offset.reshape(()), dtype=np.float32)


def rewrite_ties_up(model: onnx.ModelProto) -> int:
    """Rewrite every ties-up ``Quant`` node of ``model`` (in place; see the module docstring); how many there were.

    Raises :class:`ExportError` for a ties-up node whose scale is not a constant power of two: the rewritten
    file would not compute what the quantizer computes (use ``scale_type=pof2_round`` or ``pof2`` with
    ``round_method=half_up``)."""
    graph = model.graph
    index = GraphIndex(graph)
    shapes = {info.name: [d.dim_value for d in info.type.tensor_type.shape.dim]
              for info in (*graph.input, *graph.value_info)}
    rewritten = 0
    for node in list(graph.node):
        mode = _attribute(node, "rounding_mode")
        if node.op_type != "Quant" or mode is None or mode.s.decode() != TIES_UP_MODE:
            continue
        scale = index.const(node.input[1])
        if scale is None or not _is_power_of_two(scale):
            raise ExportError(
                f"QONNX Quant node {node.name!r} rounds ties up (round_method=half_up), which a QONNX file states "
                "exactly only with a constant power-of-two scale (scale_type=pof2_round or pof2); its scale is "
                f"{'not a constant' if scale is None else scale.ravel()[:4].tolist()}")
        target = node
        producer = index.producer.get(node.input[0])
        if producer is not None and producer.op_type == "Relu" and len(index.consumers.get(node.input[0], [])) == 1:
            target = producer
        mode.s = b"ROUND"
        rewritten += 1
        grid = _input_grid(target.input[0], index)
        if grid is not None and bool(np.all(grid >= scale)):
            continue  # values on a grid of whole steps: no ties, and an Add would only be one more node
        # On a known grid, half its step: it moves ties up and nothing else, and it is large enough that qonnx's
        # RemoveIdentityOps (which takes an Add of less than 1e-5 for an identity, and breaks a forked input when
        # it removes one) leaves it alone. Elsewhere (accumulators) the quantizer's own 2^-16 steps.
        offset = (grid / 2 if grid is not None else scale * np.float32(TIES_UP_OFFSET)).astype(np.float32)
        shape = shapes.get(target.input[0])
        forked = len(index.consumers.get(target.input[0], [])) > 1
        if forked and float(np.max(offset)) < _IDENTITY_ATOL:
            new_nodes, new_inits, shifted = _scaled_offset(node.name, target.input[0], scale, shape)
        else:
            offset_name = f"{node.name}_ties_up_offset"
            new_inits = [numpy_helper.from_array(_per_channel(offset, shape), offset_name)]
            shifted = f"{node.name}_ties_up_input"
            new_nodes = [helper.make_node("Add", [target.input[0], offset_name], [shifted],
                                          name=f"{node.name}_ties_up")]
        graph.initializer.extend(new_inits)
        target.input[0] = shifted
        position = list(graph.node).index(target)
        for new_node in reversed(new_nodes):
            graph.node.insert(position, new_node)
    return rewritten


def fold_bias_quants(model: onnx.ModelProto) -> int:
    """Replace every ``Quant`` node on a constant bias (the third input of a Conv / ConvTranspose / Gemm) with the
    float32 values it computes (in place); how many there were.

    An exact FINN file has its integer biases on the accumulator's power-of-two grid, so the values are exact in
    float32. FINN's converter cannot take them as ``Quant`` nodes: it moves a bias's per-channel scale into a
    division in front of the bias add whose output it then annotates as integer, and its executor refuses the
    non-integer values ("Rounding error is too high"). As float initializers FINN absorbs them into the next
    thresholds, exactly. The values are computed by qonnx's own ``Quant``, the file's reader."""
    from qonnx.custom_op.registry import getCustomOp

    graph = model.graph
    index = GraphIndex(graph)
    folded = 0
    for node in list(graph.node):
        if node.op_type != "Quant" or any(name not in index.inits for name in node.input[:4]):
            continue
        out = node.output[0]
        users = index.consumers.get(out, [])
        if not users or any(user.op_type not in BIAS_CONSUMERS or list(user.input).index(out) != 2
                            or list(user.input).count(out) != 1 for user in users):
            continue
        context = {name: index.const(name) for name in node.input[:4]}
        getCustomOp(node).execute_node(context, graph)
        graph.node.remove(node)
        graph.initializer.append(numpy_helper.from_array(context[out].astype(np.float32), out))
        folded += 1
    return folded
