"""The integer-kernel rewrites: their one registry and the loop that applies them.

onnxruntime executes a QDQ graph with integer kernels only where its QDQ fusions find complete
``DequantizeLinear -> op [-> QuantizeLinear]`` groups (QGemm, QLinearConv, QLinearMatMul,
MatMulIntegerToFloat, integer MaxPool, ...). An op left outside such a group runs in float32 and, worse,
dequantizes its int8 weight on every call, which makes the "quantized" model slower than the float one.
Brevitas' QCDQ graph breaks these groups in a few ways; each rewrite in :data:`INTEGER_KERNEL_REWRITES`
repairs one of them. Every rewrite is exact -- the rewritten graph computes the same values as the
original on every input, argued in its docstring. Activations are only touched where their
QuantizeLinear/DequantizeLinear are 8-bit integer per tensor (:mod:`~quark_brevitas.export.onnx.passes.qparams`);
weights and biases only where they are constant integer initializers; float8 tensors are never touched.
The exporter still verifies the rewritten file against PyTorch.

:data:`WEIGHT_ONLY_KERNEL_REWRITES` holds the rewrites onto onnxruntime's weight-only kernel (``MatMulNBits``,
:mod:`~quark_brevitas.export.onnx.passes.nbits`); they run last, once every weight is written (per-group ones as
blocked ``DequantizeLinear``, opset 21), and are exact in the same sense.

Adding a rewrite means writing it (a function of a :class:`~quark_brevitas.export.onnx.passes.graph.GraphIndex`
returning how often it applied) and registering it here, with the description the report shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import onnx

from quark_brevitas.export.onnx.inspect import DEFAULT_INT_OPSET
from quark_brevitas.export.onnx.passes.bias import drop_zero_bias_zero_points, fold_unfusable_bias
from quark_brevitas.export.onnx.passes.clips import drop_noop_integer_clips, integer_relu, sink_integer_clips
from quark_brevitas.export.onnx.passes.graph import GraphIndex, has_subgraphs, opset_of, topological_sort
from quark_brevitas.export.onnx.passes.layout import (
    gather_before_dequantize,
    hoist_quantize,
    sink_dequantize,
    transpose_weights_offline,
)
from quark_brevitas.export.onnx.passes.nbits import NBITS_REWRITE, declare_ms_domain, matmul_nbits
from quark_brevitas.export.onnx.passes.unsigned import unsigned_activations

logger = logging.getLogger(__name__)

#: Rewrites need integer Clip and MaxPool (opset >= 12); applied from the default int opset up.
_MIN_REWRITE_OPSET = DEFAULT_INT_OPSET
_MAX_REWRITE_ROUNDS = 8


class Rewrite(NamedTuple):
    """One exact graph rewrite: what the report calls it, and the function applying it once over the graph."""

    description: str
    apply: Callable[[GraphIndex], int]


#: Every integer-kernel rewrite, in the order one round applies them.
INTEGER_KERNEL_REWRITES: tuple[Rewrite, ...] = (
    Rewrite("weight transposes done offline", transpose_weights_offline),
    Rewrite("biases dequantized offline (scale is not input x weight scale)", fold_unfusable_bias),
    Rewrite("quantizers moved above layout ops and MaxPool", hoist_quantize),
    Rewrite("dequantizers moved below layout ops", sink_dequantize),
    Rewrite("ReLUs moved into the integer domain", integer_relu),
    Rewrite("no-op integer Clips removed", drop_noop_integer_clips),
    Rewrite("integer Clips moved below MaxPool", sink_integer_clips),
    Rewrite("int8 activations stored as uint8", unsigned_activations),
    Rewrite("zero bias zero points dropped", drop_zero_bias_zero_points),
    Rewrite("embedding rows gathered before dequantization", gather_before_dequantize),
)


#: The rewrites onto onnxruntime's weight-only kernel, applied once every weight is written (per-group ones as
#: blocked DequantizeLinear, 4-bit ones as INT4/UINT4).
WEIGHT_ONLY_KERNEL_REWRITES: tuple[Rewrite, ...] = (
    Rewrite(NBITS_REWRITE, matmul_nbits),
)


def rewrite_for_weight_only_kernels(model: onnx.ModelProto) -> tuple[tuple[str, int], ...]:
    """Apply :data:`WEIGHT_ONLY_KERNEL_REWRITES` (and declare the com.microsoft opset if they used it); returns
    ``(description, count)`` pairs like :func:`rewrite_for_integer_kernels`."""
    done = apply_rewrites(model, WEIGHT_ONLY_KERNEL_REWRITES)
    declare_ms_domain(model)
    return done


def rewrite_for_integer_kernels(model: onnx.ModelProto) -> tuple[tuple[str, int], ...]:
    """Apply :data:`INTEGER_KERNEL_REWRITES`; see :func:`apply_rewrites`."""
    return apply_rewrites(model, INTEGER_KERNEL_REWRITES)


def apply_rewrites(model: onnx.ModelProto, rewrites: tuple[Rewrite, ...]) -> tuple[tuple[str, int], ...]:
    """Apply ``rewrites`` until none applies; returns ``(description, count)`` pairs.

    One rewrite can enable another (a ReLU moved behind its quantizer lets the quantizer move on
    up), so the whole sequence is repeated until a round changes nothing. No rewrite undoes
    another, so this ends after a few rounds; graphs with control flow are left alone.
    """
    graph = model.graph
    if opset_of(model) < _MIN_REWRITE_OPSET or has_subgraphs(graph):
        return ()
    totals = dict.fromkeys((rewrite.description for rewrite in rewrites), 0)
    for _ in range(_MAX_REWRITE_ROUNDS):
        changed = 0
        for description, rewrite in rewrites:
            while applied := rewrite(GraphIndex(graph)):
                totals[description] += applied
                changed += applied
        if not changed:
            break
    topological_sort(graph)
    done = tuple((description, n) for description, n in totals.items() if n)
    for description, n in done:
        logger.debug("kernel rewrite: %s (%d)", description, n)
    return done
