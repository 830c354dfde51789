"""Weight-only integer Linear layers as onnxruntime's ``MatMulNBits`` (com.microsoft) kernel.

A 4-bit per-group weight is written as ``DequantizeLinear(codes, scale, zero_point, axis, block_size)`` (opset 21,
:mod:`~quark_brevitas.export.onnx.blocked`), a per-channel / per-tensor one as a plain ``DequantizeLinear``, in front
of a
float ``MatMul``/``Gemm``. As written, onnxruntime runs such a layer in float, dequantizing the whole weight on
every call: no faster than the float model. Its contrib op ``MatMulNBits`` reads the packed codes directly
(``Y = A @ dequant(B)^T + bias``; decoding, which is memory-bound, reads an eighth of the bytes at 4 bits) and
computes ``(code - zero_point) * scale`` per block of ``block_size`` elements along K: exactly what the blocked
``DequantizeLinear`` computes when its blocks run along K, and what a per-channel (per-tensor) one computes when
every block of a column repeats the column's (the tensor's) scale and zero point.

Worse, onnxruntime (1.32) fuses a weight-only ``DequantizeLinear -> MatMul`` into a ``MatMulNBits`` of its own at
``accuracy_level`` 4, which quantizes the activations to int8 on the fly: a default session then computes something
else than the file says (0.004 off on a small MLP). The level is an attribute of the node, so a file holding
explicit ``MatMulNBits`` nodes with ``accuracy_level = 1`` (float32 arithmetic) is right in a default
``InferenceSession``.

:func:`matmul_nbits` replaces each such weight ``DequantizeLinear`` and its consumers by ``MatMulNBits`` nodes with
the same codes, scales and zero points (nothing is re-quantized):

* ``B``: uint8 ``[N, k_blocks, block_size * bits / 8]``, column ``n``'s K codes in blocks, at 4 bits two codes a
  byte, the first in the low nibble; codes are stored unsigned (a signed code ``c`` as ``c + 2^(bits-1)``), the
  padding of a last partial block as the zero point (it dequantizes to 0 and meets no element of ``A``);
* ``scales``: float32 ``[N, k_blocks]``;
* ``zero_points``: uint8 ``[N, ceil(k_blocks * bits / 8)]`` packed the same way, left out where every stored zero
  point is the op's default ``2^(bits-1)`` (signed codes without a zero point); a signed zero point ``z`` is stored
  as ``z + 2^(bits-1)``, so the difference ``code - zero_point`` is unchanged;
* a ``Gemm`` bias as the op's ``bias`` input (added after the product, as ``Gemm`` adds ``C``), or as an ``Add``
  after it when it is not a constant float vector of length N;
* per-group weights keep their group size as ``block_size``; per-channel and per-tensor weights get blocks of
  :data:`CHANNEL_BLOCK` (fewer for a short K).

Rewritten: 4-bit and 8-bit integer weights read as operand B by a ``MatMul`` or a plain ``Gemm`` (alpha 1, beta 1,
A not transposed) whose input is float (weight-only), and blocked 4-bit weights whatever their input (no integer
kernel takes them). A layer whose input is quantized to 8 bits keeps its ``DequantizeLinear`` so that onnxruntime
fuses it into its integer kernels. ``MatMulNBits`` takes block sizes that are powers of two >= 16; a weight with
another group size, groups along N, or another consumer (an embedding ``Gather`` sharing it) keeps the
``DequantizeLinear`` form, named in an INFO log.

Level 4 is written only where it is what the model computes: a Linear whose input is quantized dynamically to
symmetric int8 per group of the int4 weight's group size is exported with its input unquantized, and
:func:`quantize_inputs_in_kernel` then sets its node's level to :data:`INT8_ACCURACY_LEVEL`
(:mod:`~quark_brevitas.export.onnx.dynamic` plans which layers, and whether the raw input goes into the kernel, which
then
computes the quantizer's codes itself, or explicit ops quantize it first).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.onnx.passes.graph import LAYOUT_OPS, GraphIndex, attr, module_path

logger = logging.getLogger(__name__)

#: The domain and op of onnxruntime's block-quantized MatMul.
MS_DOMAIN = "com.microsoft"
NBITS_OP = "MatMulNBits"
#: How the export report names this rewrite.
NBITS_REWRITE = "weight-only Linear layers as MatMulNBits (com.microsoft)"
#: accuracy_level 1: float32 compute (the quantized model's arithmetic); 4 would quantize the activations to int8.
FP32_ACCURACY_LEVEL = 1
#: accuracy_level 4: the kernel quantizes its input to int8 per block of ``block_size`` along K (scale
#: ``max|a| / 127``, codes ``a * (127 / max|a|)`` rounded half to even) and sums int8 x int4 block products: what a
#: Linear computes whose input is quantized dynamically, symmetric int8 per group of the weight's group size.
INT8_ACCURACY_LEVEL = 4
#: Block size given to per-channel and per-tensor weights (their scale repeats in every block of a column).
CHANNEL_BLOCK = 128
_MIN_BLOCK = 16
#: Integer code types MatMulNBits takes -> (bits, signed).
_CODE_TYPES = {TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False),
               TensorProto.INT8: (8, True), TensorProto.UINT8: (8, False)}


class _Weight(NamedTuple):
    """A constant integer weight behind a ``DequantizeLinear``, as stored there."""

    codes: np.ndarray  # int16, the DequantizeLinear's shape
    scale: np.ndarray  # scalar, [channels] or blocked
    zero_point: np.ndarray | None
    bits: int
    signed: bool
    axis: int
    block_size: int  # 0: per-tensor / per-channel


def _float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    for a in node.attribute:
        if a.name == name:
            return float(onnx.helper.get_attribute_value(a))
    return default


def _k_axis(node: onnx.NodeProto, weight: str) -> int | None:
    """The axis of the weight (operand B of ``node``) that ``node`` reduces over, if ``node`` is a MatMul or a
    plain Gemm (alpha 1, A not transposed, beta 1) reading the weight as B only; else ``None``."""
    if len(node.input) < 2 or node.input[1] != weight or node.input[0] == weight:
        return None
    if node.op_type == "MatMul":
        return 0
    if node.op_type != "Gemm" or attr(node, "transA", 0) or _float_attr(node, "alpha", 1.0) != 1.0:
        return None
    if len(node.input) > 2 and node.input[2] and (node.input[2] == weight or _float_attr(node, "beta", 1.0) != 1.0):
        return None
    return 1 if attr(node, "transB", 0) else 0


def _quantized_input(index: GraphIndex, node: onnx.NodeProto) -> bool:
    """Whether operand A of ``node`` comes out of a DequantizeLinear (through layout ops): a quantized input."""
    producer = index.producer.get(node.input[0])
    while producer is not None and producer.op_type in LAYOUT_OPS:
        producer = index.producer.get(producer.input[0])
    return producer is not None and producer.op_type == "DequantizeLinear"


def _weight(index: GraphIndex, dq: onnx.NodeProto) -> _Weight | None:
    """The constant 4/8-bit 2-D weight a ``DequantizeLinear`` reads; ``None`` for anything else."""
    if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or len(dq.input) < 2:
        return None
    init = index.inits.get(dq.input[0])
    if init is None or init.data_type not in _CODE_TYPES or len(init.dims) != 2:
        return None
    scale = index.const(dq.input[1])
    zp_name = dq.input[2] if len(dq.input) > 2 else ""
    zero_point = index.const(zp_name) if zp_name else None
    if scale is None or scale.dtype != np.float32 or (zp_name and zero_point is None):
        return None
    bits, signed = _CODE_TYPES[init.data_type]
    return _Weight(numpy_helper.to_array(init).astype(np.int16), scale, zero_point, bits, signed,
                   attr(dq, "axis", 1) % 2, attr(dq, "block_size", 0))


def _why_not(index: GraphIndex, dq: onnx.NodeProto, weight: _Weight) -> str | None:
    """Why the weight of ``dq`` does not become MatMulNBits (``None``: it does)."""
    if dq.output[0] in index.graph_outputs:
        return "the dequantized weight is a graph output"
    users = index.consumers.get(dq.output[0], [])
    if not users:
        return "nothing reads the weight"
    blocked = weight.block_size > 0
    axes = {_k_axis(user, dq.output[0]) for user in users}
    if len(axes) > 1 and None not in axes:
        return "its consumers reduce over different axes"
    for user in users:
        k_axis = _k_axis(user, dq.output[0])
        if k_axis is None:
            return f"it is read by {user.op_type} '{user.name}'"
        if not (blocked and weight.bits == 4) and _quantized_input(index, user):
            return f"the input of {user.op_type} '{user.name}' is quantized (integer kernels)"
        if blocked and k_axis != weight.axis:
            return f"its groups run along N, not along K, in {user.op_type} '{user.name}'"
        if not blocked and weight.scale.ndim and (weight.scale.ndim != 1 or weight.axis == k_axis):
            return f"its scales vary along K in {user.op_type} '{user.name}'"
    if blocked and (weight.block_size < _MIN_BLOCK or weight.block_size & (weight.block_size - 1)):
        return f"group size {weight.block_size} (MatMulNBits takes powers of two >= {_MIN_BLOCK})"
    return None


def _per_column(values: np.ndarray | None, n: int, k_blocks: int) -> np.ndarray | None:
    """A scalar or per-column ([N]) scale / zero point repeated over the blocks of each column: [N, k_blocks]."""
    if values is None:
        return None
    return np.ascontiguousarray(np.broadcast_to(np.reshape(values, (-1, 1)), (n, k_blocks)))


def _oriented(weight: _Weight, k_axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """``(codes [N, K], scales [N, k_blocks], zero points [N, k_blocks] or None, block_size)``."""
    codes, scale, zero_point = weight.codes, weight.scale, weight.zero_point
    if k_axis == 0:  # weight [K, N] (MatMul): MatMulNBits wants [N, K]
        codes = codes.T
        if weight.block_size:
            scale = scale.T
            zero_point = None if zero_point is None else zero_point.T
    n, k = codes.shape
    if weight.block_size:
        return codes, scale, zero_point, weight.block_size
    block_size = min(CHANNEL_BLOCK, max(_MIN_BLOCK, 1 << (k - 1).bit_length()))
    k_blocks = -(-k // block_size)
    return codes, _per_column(scale, n, k_blocks), _per_column(zero_point, n, k_blocks), block_size


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-bit values packed along the last axis, the first in the low bits (padded with 0)."""
    values = values.astype(np.uint8)
    per_byte = 8 // bits
    if values.shape[-1] % per_byte:
        pad = per_byte - values.shape[-1] % per_byte
        values = np.concatenate([values, np.zeros((*values.shape[:-1], pad), np.uint8)], axis=-1)
    packed = np.zeros((*values.shape[:-1], values.shape[-1] // per_byte), np.uint8)
    for i in range(per_byte):
        packed |= (values[..., i::per_byte] << (bits * i)).astype(np.uint8)
    return packed


def nbits_tensors(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, bits: int, signed: bool,
                  block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(B, scales, zero_points)`` of ``MatMulNBits`` from a weight's codes ``[N, K]``, its scales and zero points
    ``[N, k_blocks]`` (``None``: 0), its bit width and signedness (see the module docstring for the layout).

    ``zero_points`` is ``None`` where the op's default ``2^(bits-1)`` is every stored zero point.
    """
    n, k = codes.shape
    k_blocks = -(-k // block_size)
    offset = 1 << (bits - 1) if signed else 0
    stored_zp = (np.zeros((n, k_blocks), np.int16) if zero_point is None else zero_point.astype(np.int16)) + offset
    unsigned = codes.astype(np.int16) + offset
    padding = k_blocks * block_size - k
    if padding:
        unsigned = np.concatenate([unsigned, np.repeat(stored_zp[:, -1:], padding, axis=1)], axis=1)
    packed = _pack(unsigned.reshape(n, k_blocks, block_size), bits)
    default = bool((stored_zp == 1 << (bits - 1)).all())
    return packed, np.ascontiguousarray(scale, dtype=np.float32), None if default else _pack(stored_zp, bits)


def _rewrite_user(index: GraphIndex, user: onnx.NodeProto, inputs: list[str], k: int, n: int, bits: int,
                  block_size: int) -> None:
    """Turn ``user`` (MatMul / Gemm) into MatMulNBits in place (same name, same output), the Gemm bias as the
    op's bias input or an ``Add`` after it."""
    bias = user.input[2] if user.op_type == "Gemm" and len(user.input) > 2 else ""
    bias_value = index.const(bias) if bias else None
    operands = [user.input[0], *inputs]
    after_add = bool(bias) and not (bias_value is not None and bias_value.shape == (n,)
                                    and bias_value.dtype == np.float32)
    if bias and not after_add:
        operands += [""] * (5 - len(operands)) + [bias]  # A, B, scales, zero_points, g_idx, bias
    output = user.output[0]
    product = index.fresh_name(f"{output}_nbits") if after_add else output
    replacement = onnx.helper.make_node(NBITS_OP, operands, [product], name=user.name, domain=MS_DOMAIN, K=k, N=n,
                                        bits=bits, block_size=block_size, accuracy_level=FP32_ACCURACY_LEVEL)
    user.CopyFrom(replacement)
    if after_add:
        position = list(index.graph.node).index(user) + 1
        add = onnx.helper.make_node("Add", [product, bias], [output], name=index.fresh_name(f"{user.name}_bias"))
        index.graph.node.insert(position, add)


def matmul_nbits(index: GraphIndex) -> int:
    """Integer weight ``DequantizeLinear -> MatMul/Gemm`` becomes ``MatMulNBits`` (see the module docstring for
    which and why it is exact); returns how many weights were rewritten."""
    count = 0
    for dq in list(index.graph.node):
        weight = _weight(index, dq)
        if weight is None:
            continue
        reason = _why_not(index, dq, weight)
        if reason is not None:
            if weight.block_size:
                logger.info("4-bit weight '%s' stays DequantizeLinear + MatMul (not MatMulNBits): %s",
                            dq.input[0], reason)
            continue
        users = list(index.consumers[dq.output[0]])
        codes, scale, zero_point, block_size = _oriented(weight, _k_axis(users[0], dq.output[0]) or 0)
        n, k = codes.shape
        packed, scales, zero_points = nbits_tensors(codes, scale, zero_point, weight.bits, weight.signed, block_size)
        base = dq.input[0]
        names = [index.add_initializer(packed, f"{base}_nbits"), index.add_initializer(scales, f"{base}_nbits_scale")]
        if zero_points is not None:
            names.append(index.add_initializer(zero_points, f"{base}_nbits_zero_point"))
        for user in users:
            _rewrite_user(index, user, names, k, n, weight.bits, block_size)
        index.graph.node.remove(dq)
        count += 1
    return count


def declare_ms_domain(model: onnx.ModelProto) -> None:
    """Declare the com.microsoft opset when the graph uses one of its ops (MatMulNBits)."""
    uses = any(node.domain == MS_DOMAIN for node in model.graph.node)
    if uses and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))


def quantize_inputs_in_kernel(graph: onnx.GraphProto, layers: dict[str, int]) -> dict[str, str]:
    """Set ``accuracy_level`` 4 on the ``MatMulNBits`` node of every layer in ``layers`` (the node's module path, as
    :func:`~quark_brevitas.export.onnx.passes.graph.module_path` writes it, without the op -> the group size of the
    layer's int8 input), so that the kernel quantizes the input exactly as the layer's dynamic per-group int8
    quantizer does (:data:`INT8_ACCURACY_LEVEL`).

    Returns, for every layer that could not be given the level, why not (no ``MatMulNBits`` node: the weight kept
    its ``DequantizeLinear``; a block size other than the input's group size; a weight of another bit width).
    """
    found: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        path, _, op = module_path(node.name).rpartition(".")
        if path in layers and op in ("MatMul", "Gemm"):
            found[path] = node
    problems = {}
    for path, group_size in layers.items():
        node = found.get(path)
        if node is None or node.op_type != NBITS_OP or node.domain != MS_DOMAIN:
            problems[path] = "its weight is not a MatMulNBits kernel (the weight stayed DequantizeLinear + MatMul)"
        elif attr(node, "bits", 4) != 4 or attr(node, "block_size", 0) != group_size:
            problems[path] = (f"its MatMulNBits has {attr(node, 'bits', 4)}-bit blocks of "
                              f"{attr(node, 'block_size', 0)}, the input groups of {group_size}")
        else:
            _set_int_attr(node, "accuracy_level", INT8_ACCURACY_LEVEL)
    return problems


def _set_int_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for attribute in node.attribute:
        if attribute.name == name:
            attribute.i = value
            return
    node.attribute.append(onnx.helper.make_attribute(name, value))
