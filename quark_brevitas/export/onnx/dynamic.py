"""Dynamic int8 activations of Linear layers in ONNX: scales computed from each input, integer MatMul kernels.

Brevitas's QCDQ exporter has no form for activation quantizers whose scale is computed at run time, and
``QuantizeLinear`` takes a per-tensor or per-axis scale, not one per token. So the exporter writes them itself
(the recipe onnxruntime users know from ``quantize_dynamic``):

1. :func:`plan_dynamic` finds the ``QuantLinear`` layers whose input quantizer is dynamic 8-bit integer
   (per tensor or per token, symmetric int8 or asymmetric uint8);
2. :func:`float_inputs` lets Brevitas export those layers with their input unquantized (a float ``MatMul`` /
   ``Gemm`` on ``DequantizeLinear`` of the int8 weight);
3. :func:`insert_dynamic_quantization` replaces each such ``MatMul``/``Gemm`` by the quantization of its input,
   computed as Brevitas computes it, and an integer product: ``MatMulInteger(codes, W_int8)`` (exact int32
   sums), minus ``zero point x column sums of W`` for asymmetric rows (int32, exact), cast to float and
   scaled by the input scale(s) and the weight scale(s).

Scales as Brevitas computes them: symmetric ``max|x| / 127`` (codes in +-127), asymmetric
``(max(max x, 0) - min(min x, 0)) / 255`` with zero point ``round(-min(min x, 0) / scale)`` and codes
``clip(round(x / scale + zero point), 0, 255)``; per tensor over the whole input, per token over its last
dimension. Asymmetric per-tensor inputs use onnxruntime's fused ``DynamicQuantizeLinear`` (same scale and
zero point; it rounds before adding the zero point, which differs only at exact ties). The code-producing node
of each layer is named after the quantizer (``.../input_quant/export_handler/DynamicQuantize``), so the pinned
verification (:mod:`quark_brevitas.export.onnx.pinned`) pins it like a static quantizer.

A Linear input quantized dynamically to symmetric int8 **per group** of G input features, in front of an int4
weight quantized per group of the same G input features, is what onnxruntime's ``MatMulNBits`` computes at
``accuracy_level`` 4, several times faster than at level 1 (MLAS quantizes its input per block of ``block_size``
along K: ``amax = max|a|``, scale ``amax / 127``, codes ``a * (127 / amax)`` rounded half to even, int8 x int4
block products scaled by both scales). The weight becomes ``MatMulNBits``
(:mod:`~quark_brevitas.export.onnx.passes.nbits`) and :func:`mark_kernel_inputs` sets its level to 4. Two forms:

* **fused** (:attr:`DynamicInput.fused`): the quantizer computes MLAS's codes itself (the default for such inputs,
  :mod:`quark_brevitas.brevitas_adapter.reciprocal`), so the raw float input goes into the kernel and the file
  holds no quantization op for it: same op counts as the float file apart from ``MatMul`` -> ``MatMulNBits``.
  A layer whose weight does not become a matching ``MatMulNBits`` (another group size, ``int4_kernel="dequantize"``)
  gets the explicit ops below instead. The pinned verification cannot pin codes computed inside a kernel, so it
  runs the file with those explicit ops in front of every fused kernel (:func:`pinnable`): the kernel's
  quantization of an already quantized input gives back the same codes, so that graph computes what the file
  computes, with code nodes to pin.
* **explicit**: the input is quantized by ops computing the quantizer's codes (:func:`_quantize_groups`: MLAS's
  reciprocal for the default quantizer, Brevitas's ``x / scale`` for one built otherwise; the code node is pinned
  by the pinned verification like any dynamic quantizer) in front of the level-4 kernel. The kernel's own
  quantization of the already quantized input gives back the same codes (its maximum is ``127 * scale``), so the
  file computes what the model computes, up to float summation order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper
from torch import nn

from quark_brevitas.brevitas_adapter import (
    injector_value,
    is_dynamic_activation,
    is_float_quantizer,
    is_groupwise,
    uses_reciprocal_codes,
    weight_quant_disabled,
)
from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.onnx.passes.graph import GraphIndex, attr, module_path, topological_sort
from quark_brevitas.export.onnx.passes.nbits import INT8_ACCURACY_LEVEL, NBITS_OP, quantize_inputs_in_kernel

logger = logging.getLogger(__name__)

#: Suffix of the node producing a dynamic quantizer's codes (after the proxy's module path).
CODE_NODE = "export_handler/DynamicQuantize"
#: Suffix of the tensor holding an asymmetric dynamic quantizer's zero point (the pinned check pins it too).
ZERO_POINT_TENSOR = "export_handler/DynamicZeroPoint"


@dataclass
class DynamicInput:
    """A Linear layer whose input is quantized dynamically, and how."""

    layer: nn.Module
    proxy_name: str
    per_token: bool
    signed: bool
    group_size: int = 0  # > 0: int8 per group of the input features, quantized inside MatMulNBits (accuracy level 4)
    fused: bool = False  # the quantizer computes MLAS's codes: the raw input goes into MatMulNBits, no explicit ops
    reciprocal: bool = False  # the quantizer's codes are round(x * (127 / max|x|)) (explicit ops compute them so)

    @property
    def fmt(self) -> str:
        if self.group_size:
            return f"int8 dynamic per-group {self.group_size}"
        return f"{'int8' if self.signed else 'uint8'} dynamic per-{'token' if self.per_token else 'tensor'}"


def is_exportable_dynamic(layer: nn.Module, attribute: str, proxy: nn.Module) -> bool:
    """Whether a dynamic activation quantizer is one this module writes: the 8-bit integer input quantizer of a
    Linear layer (not per-group / MX, not float) whose weight is quantized to integers of at most 8 bits per
    tensor or channel (the integer product needs integer weights)."""
    if attribute != "input_quant" or not is_dynamic_activation(proxy):
        return False
    if is_float_quantizer(proxy) or not isinstance(layer, nn.Linear):
        return False
    if is_groupwise(proxy):
        return kernel_group_size(layer, proxy) is not None
    weight = getattr(layer, "weight_quant", None)
    if weight is None or not weight.is_quant_enabled or is_groupwise(weight) or is_float_quantizer(weight):
        return False
    bits, weight_bits = injector_value(proxy, "bit_width"), injector_value(weight, "bit_width")
    return bits is not None and int(bits) == 8 and weight_bits is not None and int(weight_bits) <= 8


def kernel_group_size(layer: nn.Module, proxy: nn.Module) -> int | None:
    """The group size G if ``proxy`` (the input quantizer of Linear ``layer``) is what ``MatMulNBits`` at accuracy
    level 4 computes (see the module docstring): dynamic symmetric int8 with codes in +-127, one float scale
    ``max|x| / 127`` per group of G along the last dimension, rounded half to even; the layer's weight int4 per group
    of the same G input features (G a power of two >= 16, the block sizes of MatMulNBits). ``None`` otherwise."""
    if not is_groupwise(proxy) or not proxy.is_signed or injector_value(proxy, "narrow_range") is not True:
        return None
    if _enum_name(injector_value(proxy, "restrict_scaling_type")) != "FP" or \
            _enum_name(injector_value(proxy, "scaling_stats_op")) != "MAX" or \
            type(injector_value(proxy, "float_to_int_impl")).__name__ != "RoundSte" or \
            injector_value(proxy, "group_dim") not in (-1, None):
        return None
    weight = getattr(layer, "weight_quant", None)
    if weight is None or not weight.is_quant_enabled or not is_groupwise(weight) or is_float_quantizer(weight):
        return None
    bits, weight_bits = injector_value(proxy, "bit_width"), injector_value(weight, "bit_width")
    group, weight_group = injector_value(proxy, "group_size"), injector_value(weight, "group_size")
    if bits is None or int(bits) != 8 or weight_bits is None or int(weight_bits) != 4 or group != weight_group:
        return None
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        return None
    return group


def _enum_name(value: object) -> str | None:
    return getattr(value, "name", None)


def plan_dynamic(model: nn.Module, proxy_names: Sequence[str]) -> list[DynamicInput]:
    """The dynamic inputs called ``proxy_names`` (``<layer>.input_quant``); :class:`ExportError` for a layer that
    also quantizes its bias (an integer bias would need the run-time input scale)."""
    modules = dict(model.named_modules())
    plans = []
    for name in proxy_names:
        layer_name = name.rsplit(".", 1)[0]
        layer, proxy = modules[layer_name], modules[name]
        bias_quant = getattr(layer, "bias_quant", None)
        if layer.bias is not None and bias_quant is not None and bias_quant.is_quant_enabled:
            raise ExportError(f"layer '{layer_name}' quantizes its bias with a dynamic input quantizer ({name}): the "
                              "bias scale would change with every input; export with bias=None (float bias)")
        group_size = kernel_group_size(layer, proxy) or 0
        per_token = group_size > 0 or injector_value(proxy, "stats_reduce_dim") is not None  # else over everything
        reciprocal = group_size > 0 and uses_reciprocal_codes(proxy)
        plans.append(DynamicInput(layer, name, per_token, bool(proxy.is_signed), group_size, reciprocal, reciprocal))
    return plans


@contextlib.contextmanager
def float_inputs(plans: Sequence[DynamicInput]) -> Iterator[None]:
    """While Brevitas exports: the planned layers take their input unquantized."""
    with contextlib.ExitStack() as stack:
        for plan in plans:
            stack.enter_context(weight_quant_disabled(plan.layer.input_quant))  # flips the proxy's disable_quant
        yield


def _weight(index: GraphIndex, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, str] | None:
    """The (K, N) int8 weight codes, their per-column scales and the name of the codes, of a MatMul/Gemm."""
    dq = index.producer.get(node.input[1])
    transposed = dq is not None and dq.op_type == "Transpose" and list(next(
        (a.ints for a in dq.attribute if a.name == "perm"), [1, 0])) == [1, 0]
    if transposed:  # integer_kernels=False keeps Brevitas's DQ -> Transpose -> MatMul
        dq = index.producer.get(dq.input[0])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in index.inits:
        return None
    codes, scale = index.const(dq.input[0]), index.const(dq.input[1])
    zero_point = index.const(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if codes is None or scale is None or codes.dtype != np.int8 or codes.ndim != 2 or \
            (zero_point is not None and np.any(zero_point)):
        return None
    axis = attr(dq, "axis", 1) % 2
    if transposed:
        codes, axis = codes.T, 1 - axis
    if node.op_type == "Gemm":
        if attr(node, "transA", 0) or not attr(node, "transB", 0):
            return None
        codes, axis = codes.T, 1 - axis
    if scale.ndim == 1 and axis != 1:
        return None
    return np.ascontiguousarray(codes), scale.astype(np.float32).reshape(-1), dq.input[0]


def insert_dynamic_quantization(model: onnx.ModelProto, plans: Sequence[DynamicInput],
                                layer_paths: dict[int, str]) -> int:
    """Replace the float MatMul/Gemm of every planned layer by dynamic quantization and an integer product.

    ``layer_paths`` maps ``id(layer)`` to the layer's module path in the exported module (the node name prefix
    Brevitas's exporter gives its ops). Returns the number of layers rewritten; :class:`ExportError` if a planned
    layer is not found.
    """
    graph = model.graph
    index = GraphIndex(graph)
    count = 0
    for plan in plans:
        path = layer_paths[id(plan.layer)]
        node = next((n for n in graph.node if n.op_type in ("MatMul", "Gemm") and
                     module_path(n.name) in (f"{path}.MatMul", f"{path}.Gemm")), None)
        if plan.group_size and node is not None:
            if not plan.fused:  # fused: the raw input goes into the kernel (mark_kernel_inputs)
                _quantize_groups(index, node, plan, "/" + path + "/input_quant")
            count += 1
            continue
        weight = _weight(index, node) if node is not None else None
        if node is None or weight is None:
            raise ExportError(f"cannot find the int8 MatMul/Gemm of layer '{layer_paths[id(plan.layer)]}' "
                              f"({plan.fmt} input) in the exported graph")
        codes, w_scale, _ = weight
        proxy_path = "/" + path + "/input_quant"
        _rewrite(index, node, plan, codes, w_scale, proxy_path)
        count += 1
    _drop_dead_nodes(graph)
    topological_sort(graph)
    return count


def mark_kernel_inputs(model: onnx.ModelProto, plans: Sequence[DynamicInput], layer_paths: dict[int, str]) -> int:
    """Give the ``MatMulNBits`` of every per-group int8 input of ``plans`` accuracy level 4 (run after the
    weight-only kernel rewrite; see the module docstring). Returns how many layers got it. A layer whose weight did
    not become a matching ``MatMulNBits`` keeps a float product of the quantized input (still what the model
    computes, only slower), named in an INFO log; a fused one gets its explicit quantization ops here."""
    grouped = {layer_paths[id(plan.layer)]: plan for plan in plans if plan.group_size}
    problems = quantize_inputs_in_kernel(model.graph, {path: plan.group_size for path, plan in grouped.items()})
    for path, why in sorted(problems.items()):
        if grouped[path].fused:
            _quantize_in_front(model.graph, path, grouped[path])
        logger.info("layer '%s': its per-group int8 input is quantized by explicit ops and multiplied in float32 "
                    "(not MatMulNBits at accuracy level 4): %s", path, why)
    return len(grouped) - len(problems)


def fused_layers(model: onnx.ModelProto, plans: Sequence[DynamicInput], layer_paths: dict[int, str]) -> list[str]:
    """The module paths of the fused layers of ``plans`` whose ``MatMulNBits`` at level 4 takes the raw input."""
    kernels = {module_path(node.name).rpartition(".")[0] for node in model.graph.node if node.op_type == NBITS_OP
               and attr(node, "accuracy_level", 0) == INT8_ACCURACY_LEVEL}
    return [layer_paths[id(plan.layer)] for plan in plans if plan.fused and layer_paths[id(plan.layer)] in kernels]


def pinnable(model: onnx.ModelProto, plans: Sequence[DynamicInput], layer_paths: dict[int, str]) -> onnx.ModelProto:
    """A copy of ``model`` with the explicit quantization ops of every fused layer in front of its kernel (the
    graph the pinned verification runs, see the module docstring): the kernel re-quantizes the quantized input to
    the same codes, so the copy computes what ``model`` computes, and its code nodes can be pinned."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    by_path = {layer_paths[id(plan.layer)]: plan for plan in plans}
    for path in fused_layers(model, plans, layer_paths):
        _quantize_in_front(copy.graph, path, by_path[path], ops=(NBITS_OP,))
    return copy


def _quantize_in_front(graph: onnx.GraphProto, path: str, plan: DynamicInput,
                       ops: Sequence[str] = ("MatMul", "Gemm")) -> None:
    """Explicit quantization ops (:func:`_quantize_groups`) in front of the product node of layer ``path``."""
    node = next(n for n in graph.node if n.op_type in ops and module_path(n.name).rpartition(".")[0] == path)
    _quantize_groups(GraphIndex(graph), node, plan, "/" + path + "/input_quant")


@dataclass
class _LayerNodes:
    """The nodes and constants one rewrite adds for a layer, named under its quantizer's path (``prefix``), in
    the order made (the caller inserts ``new`` into the graph)."""

    index: GraphIndex
    prefix: str
    new: list[onnx.NodeProto] = field(default_factory=list)

    def op(self, op_type: str, inputs: list[str], hint: str, **attrs: object) -> str:
        """A new node of ``op_type`` with one output, returned by name."""
        out = self.index.fresh_name(f"{self.prefix}/{hint}")
        self.new.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def const(self, value: np.ndarray, hint: str) -> str:
        """A new initializer holding ``value``, returned by name."""
        return self.index.add_initializer(value, f"{self.prefix}/{hint}")


def _quantize_groups(index: GraphIndex, node: onnx.NodeProto, plan: DynamicInput, proxy_path: str) -> None:
    """Quantize the input of ``node`` (MatMul/Gemm/MatMulNBits) as the layer's per-group int8 quantizer does, in
    front of it: groups of ``plan.group_size`` along the last dimension, ``amax = max|x|``, codes rounded half to
    even (int8; the code node named for the pinned verification), dequantized back with the scale ``amax / 127``.
    Codes ``x * (127 / amax)`` (0 where that reciprocal is not finite) for a reciprocal quantizer
    (``plan.reciprocal``, MLAS's arithmetic), else ``x / scale`` with ``amax`` clamped at ``scaling_min_val`` first
    (Brevitas's). A last partial group is the rest of the features (zero padding, as MLAS's last short block).
    ``MatMulNBits`` at level 4 re-quantizes such an input to the same codes: ``max|codes * scale|`` is
    ``127 * scale``, so its codes are ``codes * (1 + a few ulp)``, rounded back to ``codes``."""
    graph = index.graph
    nodes = _LayerNodes(index, proxy_path)
    op, const, new = nodes.op, nodes.const, nodes.new

    x, group = node.input[0], plan.group_size
    k = int(plan.layer.in_features)
    n_groups = -(-k // group)
    padded = x
    if n_groups * group != k:  # a last partial group: zeros change no group's max|x| (MLAS's last block is short)
        pads = const(np.array([0, n_groups * group - k], np.int64), "pads")
        padded = op("Pad", [x, pads, "", const(np.array([-1], np.int64), "last_axis")], "padded")
    grouped = op("Reshape", [padded, const(np.array([-1, n_groups, group], np.int64), "groups")], "grouped")
    amax = op("ReduceMax", [op("Abs", [grouped], "abs"), const(np.array([-1], np.int64), "group_axis")], "max_abs",
              keepdims=1)
    qmax = const(np.array(127.0, np.float32), "qmax")
    min_val = None if plan.reciprocal else injector_value(plan.layer.input_quant, "scaling_min_val")
    if min_val is not None:
        amax = op("Max", [amax, const(np.array(float(min_val), np.float32), "scaling_min_val")], "clamped")

    def per_element(per_group: str, hint: str) -> str:
        """A per-group tensor repeated for every element of its group, in the input's layout."""
        expanded = op("Reshape", [op("Expand", [per_group, const(np.array([1, 1, group], np.int64), "group_shape")],
                                     f"{hint}_expanded"), op("Shape", [padded], f"{hint}_shape")], hint)
        if padded == x:
            return expanded
        return op("Slice", [expanded, const(np.array([0], np.int64), "start"), const(np.array([k], np.int64), "end"),
                            const(np.array([-1], np.int64), "slice_axis")], f"{hint}_k")

    # every element's scale in the input's layout: codes there are PyTorch's (the pinned check feeds them)
    scale = per_element(op("Div", [amax, qmax], "scale"), "element_scale")
    if plan.reciprocal:
        inverse = op("Div", [qmax, amax], "inverse")
        inverse = op("Where", [op("IsInf", [inverse], "overflow"), const(np.array(0.0, np.float32), "zero"),
                               inverse], "finite_inverse")
        unrounded = op("Mul", [x, per_element(inverse, "element_inverse")], "x_times_inverse")
    else:
        unrounded = op("Div", [x, scale], "x_over_scale")
    rounded = op("Round", [unrounded], "round")
    code_name = index.fresh_name(f"{proxy_path}/{CODE_NODE}")
    new.append(helper.make_node("Cast", [rounded], [code_name], name=code_name, to=TensorProto.INT8))
    node.input[0] = op("Mul", [op("Cast", [code_name], "codes_float", to=TensorProto.FLOAT), scale], "quantized")
    position = list(graph.node).index(node)
    for offset, added in enumerate(new):
        graph.node.insert(position + offset, added)


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is read (the replaced layers' weight DequantizeLinear / Transpose)."""
    while True:
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        dead = [node for node in graph.node if not any(name in used for name in node.output if name)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def _rewrite(index: GraphIndex, node: onnx.NodeProto, plan: DynamicInput, codes: np.ndarray, w_scale: np.ndarray,
             proxy_path: str) -> None:
    graph = index.graph
    nodes = _LayerNodes(index, proxy_path)
    op, const, new = nodes.op, nodes.const, nodes.new

    x = node.input[0]
    axes = {"axes": [-1], "keepdims": 1} if plan.per_token else {"keepdims": 0}
    code_name = index.fresh_name(f"{proxy_path}/{CODE_NODE}")
    correction = None
    if plan.signed:  # symmetric: scale max|x| / 127, codes round(x / scale) (never beyond +-127)
        scale = op("Div", [op("ReduceMax", [op("Abs", [x], "abs")], "max_abs", **axes),
                           const(np.array(127.0, np.float32), "qmax")], "scale")
        rounded = op("Round", [op("Div", [x, scale], "x_over_scale")], "round")
        # Stored as uint8 with zero point 128 (exact: the codes are within +-127): onnxruntime's int8 x int8
        # MatMulInteger is several times slower than its uint8 x int8 kernel (MiniLM per token: 0.3x float speed).
        shifted = op("Add", [rounded, const(np.array(128.0, np.float32), "offset")], "shifted")
        new.append(helper.make_node("Cast", [shifted], [code_name], name=code_name, to=TensorProto.UINT8))
        correction = const(np.array(128, np.uint8), "zero_point")
    elif not plan.per_token:  # asymmetric per tensor: onnxruntime's DynamicQuantizeLinear
        scale = index.fresh_name(f"{proxy_path}/scale")
        zero_point = index.fresh_name(f"{proxy_path}/{ZERO_POINT_TENSOR}")
        new.append(helper.make_node("DynamicQuantizeLinear", [x], [code_name, scale, zero_point], name=code_name))
        correction = zero_point
    else:  # asymmetric per token: range containing 0, zero point round(-min / scale), codes round(x/s + zp)
        zero = const(np.array(0.0, np.float32), "zero")
        low = op("Min", [op("ReduceMin", [x], "min", **axes), zero], "min_or_zero")
        high = op("Max", [op("ReduceMax", [x], "max", **axes), zero], "max_or_zero")
        scale = op("Div", [op("Sub", [high, low], "range"), const(np.array(255.0, np.float32), "levels")], "scale")
        zp_float = index.fresh_name(f"{proxy_path}/{ZERO_POINT_TENSOR}")
        new.append(helper.make_node("Round", [op("Div", [op("Neg", [low], "neg_min"), scale], "zp_unrounded")],
                                    [zp_float], name=zp_float))
        shifted = op("Add", [op("Div", [x, scale], "x_over_scale"), zp_float], "x_shifted")
        clipped = op("Clip", [op("Round", [shifted], "round"), zero, const(np.array(255.0, np.float32), "top")],
                     "clip")
        new.append(helper.make_node("Cast", [clipped], [code_name], name=code_name, to=TensorProto.UINT8))
        correction = op("Cast", [zp_float], "zp_int32", to=TensorProto.INT32)
    weight_codes = const(codes, "weight_codes")
    if correction is not None and (plan.signed or not plan.per_token):  # one zero point: MatMulInteger takes it
        product = op("MatMulInteger", [code_name, weight_codes, correction], "matmul_integer")
    else:
        product = op("MatMulInteger", [code_name, weight_codes], "matmul_integer")
    if correction is not None and plan.per_token and not plan.signed:  # (q - zp) @ W = q @ W - zp * sums of W
        column_sums = const(codes.astype(np.int32).sum(axis=0).astype(np.int32), "weight_column_sums")
        product = op("Sub", [product, op("Mul", [correction, column_sums], "zp_times_sums")], "product")
    accumulated = op("Cast", [product], "product_float", to=TensorProto.FLOAT)
    if plan.per_token:
        # Weight scale first, then the row scales: onnxruntime 1.32 fuses MatMulInteger -> Cast -> Mul into
        # MatMulIntegerToFloat and, given the product of per-row and per-column scales, computes wrong values
        # (the pinned verification caught it); a constant per-column scale it fuses correctly.
        output = op("Mul", [op("Mul", [accumulated, const(w_scale, "weight_scale")], "times_weight_scale"), scale],
                    "dequantized")
    else:  # the pattern of onnxruntime's quantize_dynamic (Cast -> Mul by input x weight scale), which it fuses
        output = op("Mul", [accumulated, op("Mul", [scale, const(w_scale, "weight_scale")], "scales")],
                    "dequantized")
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        output = op("Add", [output, node.input[2]], "bias")
    new[-1].output[0] = node.output[0]
    graph.node.remove(node)
    graph.node.extend(new)

