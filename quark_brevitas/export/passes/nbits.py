"""4-bit per-group weights as onnxruntime's ``MatMulNBits`` (com.microsoft) kernel.

A per-group int4/uint4 weight is written as ``DequantizeLinear(codes, scale, zero_point, axis, block_size)``
(opset 21, :mod:`~quark_brevitas.export.blocked`) in front of a float ``MatMul``/``Gemm``. onnxruntime runs that
as a float layer, dequantizing the whole weight on every call: no faster than the float model. Its contrib op
``MatMulNBits`` reads the packed 4-bit codes directly (``Y = A @ dequant(B)^T + bias``, memory-bound decoding
reads an eighth of the bytes) and computes ``(code - zero_point) * scale`` per block of ``block_size`` elements
along K, which is exactly what the blocked ``DequantizeLinear`` computes when its blocks run along K.

:func:`matmul_nbits` replaces each such ``DequantizeLinear`` and its consumers by ``MatMulNBits`` nodes holding the
same codes, scales and zero points (nothing is re-quantized):

* ``B``: uint8 ``[N, k_blocks, block_size / 2]``, column ``n``'s K codes in blocks, two codes a byte, the first in
  the low nibble; the codes are stored unsigned (int4 code ``c`` as ``c + 8``), the padding of a last partial
  block as the zero point (it dequantizes to 0; onnxruntime never reads it against an element of ``A``);
* ``scales``: float32 ``[N, k_blocks]``;
* ``zero_points``: uint8 ``[N, ceil(k_blocks / 2)]`` packed the same way, written whenever the stored zero point
  is not the op's default 8 (unsigned codes, or signed codes with a zero point); an int4 zero point ``z`` is stored
  as ``z + 8``, so ``(c + 8) - (z + 8) == c - z``;
* a ``Gemm`` bias as the op's ``bias`` input (added after the product, as ``Gemm`` adds ``C``), or as an ``Add``
  after it when it is not a constant vector of length N;
* ``accuracy_level = 1``: float32 arithmetic. onnxruntime's default for a ``MatMulNBits`` it makes itself out of
  ``DequantizeLinear -> MatMul`` is level 4, which quantizes the activations to int8 on the fly (not what the
  quantized model computes); with the level in the node a default ``InferenceSession`` computes the file's values.

``MatMulNBits`` takes block sizes that are powers of two >= 16; a weight with another group size, blocks along N,
or a consumer other than such a ``MatMul``/``Gemm`` (e.g. an embedding ``Gather`` sharing it) keeps the
``DequantizeLinear`` form, named in an INFO log.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from quark_brevitas.export.passes.graph import GraphIndex, attr

logger = logging.getLogger(__name__)

#: The domain and op of onnxruntime's block-quantized MatMul.
MS_DOMAIN = "com.microsoft"
NBITS_OP = "MatMulNBits"
#: accuracy_level 1: float32 compute (the quantized model's arithmetic); 4 would quantize the activations to int8.
FP32_ACCURACY_LEVEL = 1
_MIN_BLOCK = 16
_FOUR_BIT = {TensorProto.INT4: 8, TensorProto.UINT4: 0}  # code type -> offset making its codes unsigned


def _float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    for a in node.attribute:
        if a.name == name:
            return float(onnx.helper.get_attribute_value(a))
    return default


def _k_axis(node: onnx.NodeProto, dq: onnx.NodeProto) -> int | None:
    """The axis of the weight (operand B of ``node``) that ``node`` reduces over, if ``node`` is a MatMul or a
    plain Gemm (alpha 1, A not transposed, beta 1) reading the weight as B only; else ``None``."""
    weight = dq.output[0]
    if len(node.input) < 2 or node.input[1] != weight or node.input[0] == weight:
        return None
    if node.op_type == "MatMul":
        return 0
    if node.op_type != "Gemm" or attr(node, "transA", 0) or _float_attr(node, "alpha", 1.0) != 1.0:
        return None
    if len(node.input) > 2 and node.input[2] and (node.input[2] == weight or _float_attr(node, "beta", 1.0) != 1.0):
        return None
    return 1 if attr(node, "transB", 0) else 0


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pairs along the last axis as bytes, the first value in the low nibble (an odd length padded with 0)."""
    values = values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def nbits_tensors(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, offset: int,
                  block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(B, scales, zero_points)`` of ``MatMulNBits`` from a weight's codes ``[N, K]``, scales and zero points
    ``[N, k_blocks]`` (``None``: 0) and the ``offset`` that makes its codes unsigned (8 for int4, 0 for uint4).

    ``zero_points`` is ``None`` where the op's default (8) is the stored zero point: signed codes without one.
    """
    n, k = codes.shape
    k_blocks = -(-k // block_size)
    stored_zp = np.zeros((n, k_blocks), np.int16) if zero_point is None else zero_point.astype(np.int16)
    stored_zp = stored_zp + offset
    unsigned = codes.astype(np.int16) + offset
    padding = k_blocks * block_size - k
    if padding:
        unsigned = np.concatenate([unsigned, np.repeat(stored_zp[:, -1:], padding, axis=1)], axis=1)
    packed = _pack_nibbles(unsigned.reshape(n, k_blocks, block_size))
    zero_points = None if zero_point is None and offset == 8 else _pack_nibbles(stored_zp)
    return packed, np.ascontiguousarray(scale, dtype=np.float32), zero_points


def _weight_parts(index: GraphIndex, dq: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                  int, int, int] | None:
    """``(codes, scale, zero_point, offset, axis, block_size)`` of a constant blocked 4-bit 2-D weight
    ``DequantizeLinear``; ``None`` for anything else."""
    if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or len(dq.input) < 2:
        return None
    init = index.inits.get(dq.input[0])
    block_size = attr(dq, "block_size", 0)
    if init is None or init.data_type not in _FOUR_BIT or len(init.dims) != 2 or block_size <= 0:
        return None
    scale = index.const(dq.input[1])
    zp_name = dq.input[2] if len(dq.input) > 2 else ""
    zero_point = index.const(zp_name) if zp_name else None
    if scale is None or scale.ndim != 2 or (zp_name and zero_point is None):
        return None
    axis = attr(dq, "axis", 1) % 2
    return (numpy_helper.to_array(init).astype(np.int16), scale, zero_point, _FOUR_BIT[init.data_type], axis,
            block_size)


def _why_not(index: GraphIndex, dq: onnx.NodeProto, axis: int, block_size: int) -> str | None:
    """Why the weight of ``dq`` cannot become MatMulNBits (``None``: it can)."""
    if block_size < _MIN_BLOCK or block_size & (block_size - 1):
        return f"group size {block_size} (MatMulNBits takes powers of two >= {_MIN_BLOCK})"
    if dq.output[0] in index.graph_outputs:
        return "the dequantized weight is a graph output"
    users = index.consumers.get(dq.output[0], [])
    if not users:
        return "nothing reads the weight"
    for user in users:
        k_axis = _k_axis(user, dq)
        if k_axis is None:
            return f"it is read by {user.op_type} '{user.name}'"
        if k_axis != axis:
            return f"its groups run along N, not along K, in {user.op_type} '{user.name}'"
    return None


def _rewrite_user(index: GraphIndex, user: onnx.NodeProto, inputs: list[str], k: int, n: int,
                  block_size: int) -> None:
    """Turn ``user`` (MatMul / Gemm) into MatMulNBits in place (same name, same output), the Gemm bias as the
    op's bias input or an ``Add`` after it."""
    bias = user.input[2] if user.op_type == "Gemm" and len(user.input) > 2 else ""
    bias_value = index.const(bias) if bias else None
    operands = [user.input[0], *inputs]
    after_add = False
    if bias:
        if bias_value is not None and bias_value.shape == (n,) and bias_value.dtype == np.float32:
            operands += [""] * (5 - len(operands)) + [bias]  # A, B, scales, zero_points, g_idx, bias
        else:
            after_add = True
    output = user.output[0]
    product = index.fresh_name(f"{output}_nbits") if after_add else output
    attributes = {"K": k, "N": n, "bits": 4, "block_size": block_size, "accuracy_level": FP32_ACCURACY_LEVEL}
    replacement = onnx.helper.make_node(NBITS_OP, operands, [product], name=user.name, domain=MS_DOMAIN,
                                        **attributes)
    user.CopyFrom(replacement)
    if after_add:
        position = list(index.graph.node).index(user) + 1
        add = onnx.helper.make_node("Add", [product, bias], [output], name=index.fresh_name(f"{user.name}_bias"))
        index.graph.node.insert(position, add)


def matmul_nbits(index: GraphIndex) -> int:
    """Blocked 4-bit weight ``DequantizeLinear -> MatMul/Gemm`` becomes ``MatMulNBits`` (see the module docstring
    for why it is exact); returns how many weights were rewritten."""
    count = 0
    for dq in list(index.graph.node):
        parts = _weight_parts(index, dq)
        if parts is None:
            continue
        codes, scale, zero_point, offset, axis, block_size = parts
        reason = _why_not(index, dq, axis, block_size)
        if reason is not None:
            logger.info("4-bit weight '%s' stays DequantizeLinear + MatMul (not MatMulNBits): %s",
                        dq.input[0], reason)
            continue
        if axis == 0:  # weight [K, N] (MatMul): MatMulNBits wants [N, K]
            codes, scale = codes.T, scale.T
            zero_point = None if zero_point is None else zero_point.T
        n, k = codes.shape
        packed, scales, zero_points = nbits_tensors(codes, scale, zero_point, offset, block_size)
        base = dq.input[0]
        names = [index.add_initializer(packed, f"{base}_nbits"), index.add_initializer(scales, f"{base}_nbits_scale")]
        if zero_points is not None:
            names.append(index.add_initializer(zero_points, f"{base}_nbits_zero_point"))
        for user in list(index.consumers[dq.output[0]]):
            _rewrite_user(index, user, names, k, n, block_size)
        index.graph.node.remove(dq)
        count += 1
    return count


def declare_ms_domain(model: onnx.ModelProto) -> None:
    """Declare the com.microsoft opset when the graph uses one of its ops (MatMulNBits)."""
    uses = any(node.domain == MS_DOMAIN for node in model.graph.node)
    if uses and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
