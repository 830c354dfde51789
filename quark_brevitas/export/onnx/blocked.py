"""Weights that Brevitas's QCDQ exporter cannot write: per-group, MX, fp6 and fp4.

Brevitas's QCDQ handlers assert on group-wise quantizers and know only the float8 minifloats, yet
onnxruntime runs ``DequantizeLinear`` with ``block_size`` (opset 21) on int4/uint4/int8/uint8/int16
and float8 weights. So :func:`export_onnx_qcdq <quark_brevitas.export.export_onnx_qcdq>` writes these
weights itself, exactly:

1. :func:`plan_weights` reads each such layer's quantized weight from Brevitas (codes, scales, zero
   points) and checks that ``DequantizeLinear`` reproduces it bit for bit;
2. :func:`float_weights` lets Brevitas export the layer with that (already quantized) weight as a
   plain float initializer;
3. :func:`insert_dequantize` converts the file to opset 21 and replaces each of those initializers by
   the integer (or float8) codes, their scales and zero points, and a ``DequantizeLinear`` whose output
   carries the initializer's name, so every consumer (Gemm, Conv, a MatMul's Transpose) is unchanged.

Element formats and how they are stored:

- int2..int4 (uint2..uint4): ``INT4``/``UINT4``; int5..int8: ``INT8``/``UINT8`` (zero points alike);
- MXFP8 / per-group fp8 (OCP e4m3, e5m2): ``FLOAT8E4M3FN`` / ``FLOAT8E5M2`` with float32 scales (the MX
  scales are powers of two, stored exactly);
- fp6 (e3m2, e2m3), fp4 (e2m1) and other minifloats without an ONNX type onnxruntime runs: every value
  of such a format is an integer multiple of its smallest subnormal ``2^(1 - bias - m)`` (e2m1: 0.5,
  e2m3: 0.125, e3m2: 0.0625), so the element is stored as that integer (int8 when the largest one fits,
  e2m1: 12, e2m3: 60; else int16, e3m2: 448) and the step is folded into the scale (a power of two:
  exact). Dequantized values are identical; the file is larger than a packed fp4/fp6 one would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from torch import nn

from quark_brevitas.brevitas_adapter import (
    float8_dtype,
    groupwise_parts,
    injector_value,
    is_float_quantizer,
    is_groupwise,
    quantizer_kind,
    weight_quant_disabled,
)
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.onnx.onnx_types import FLOAT8_ONNX_TYPES, TORCH_TO_ONNX
from quark_brevitas.export.onnx.passes.graph import module_path

__all__ = ["BLOCKED_OPSET", "PlannedWeight", "float_weights", "insert_dequantize", "needs_plan", "plan_weights",
           "weight_format"]

#: First opset with blocked DequantizeLinear and int4/uint4 (and int16) inputs.
BLOCKED_OPSET = 21

class _PlanError(QuarkBrevitasError):
    """A weight cannot be written exactly (converted to ExportError by the caller)."""


@dataclass
class PlannedWeight:
    """How one layer's quantized weight is written: ``DequantizeLinear(codes, scale, zero_point, axis,
    block_size)`` equals ``values`` exactly (``block_size`` 0: per tensor / per axis)."""

    name: str
    layer: nn.Module
    fmt: str
    values: np.ndarray
    codes: np.ndarray
    code_type: int
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int
    block_size: int


def _float_widths(proxy: nn.Module) -> tuple[int, int]:
    return int(proxy.exponent_bit_width()), int(proxy.mantissa_bit_width())


def needs_plan(proxy: nn.Module) -> bool:
    """Whether the weight quantizer ``proxy`` is written here rather than by Brevitas: group-wise (per-group,
    MX) weights, and minifloat weights other than OCP / FNUZ fp8."""
    if quantizer_kind(proxy) != "weight":
        return False
    if is_groupwise(proxy):
        return True
    if is_float_quantizer(proxy):
        return not (proxy.is_ocp or proxy.is_fnuz)
    return False


def weight_format(proxy: nn.Module) -> str:
    """A readable name of the weight format, e.g. ``int4 per-group g32``, ``mxfp4_e2m1 g32``, ``fp6_e3m2``."""
    groupwise = is_groupwise(proxy)
    group = f" g{int(proxy.group_size)}" if groupwise else ""
    restrict = injector_value(proxy, "restrict_scaling_type")
    pof2 = groupwise and restrict is not None and str(restrict).upper().endswith("POWER_OF_TWO")
    if is_float_quantizer(proxy):
        e, m = _float_widths(proxy)
        kind = f"fp{1 + e + m}_e{e}m{m}"
    else:
        kind = f"{'int' if proxy.is_signed else 'uint'}{int(proxy.bit_width())}"
    if pof2:
        return f"mx{kind}{group}"
    return f"{kind} per-group{group}" if groupwise else kind


def _ungroup(t: torch.Tensor, group_dim: int, shape: Sequence[int]) -> torch.Tensor:
    """[.., n, g, ..] (group_size after group_dim) -> the weight's shape (padding dropped)."""
    flat = t.flatten(group_dim, group_dim + 1)
    return flat.narrow(group_dim, 0, shape[group_dim])


def _int_codes(code: torch.Tensor, bits: int, signed: bool) -> tuple[np.ndarray, int]:
    if signed:
        code_type = TensorProto.INT4 if bits <= 4 else TensorProto.INT8
        dtype = np.int8
    else:
        code_type = TensorProto.UINT4 if bits <= 4 else TensorProto.UINT8
        dtype = np.uint8
    return code.numpy().astype(dtype), code_type


def _plan_one(name: str, layer: nn.Module, proxy: nn.Module) -> PlannedWeight:
    with torch.no_grad():
        qt = proxy(layer.weight)
    values = qt.value.detach().float()
    shape = list(values.shape)
    zero_point_full = torch.zeros(())
    zero_point_block: torch.Tensor | None = None
    if is_groupwise(proxy):
        grouped_value, grouped_scale, grouped_zp, axis, block_size = groupwise_parts(qt)
        grouped_value, grouped_scale = grouped_value.detach().float(), grouped_scale.detach().float()
        elements = _ungroup(grouped_value / grouped_scale, axis, shape)
        scale = grouped_scale.squeeze(axis + 1)
        if grouped_zp is not None and grouped_zp.dim():
            grouped_zp = grouped_zp.detach().float().expand_as(grouped_scale)
            zero_point_full = _ungroup(grouped_zp.expand_as(grouped_value), axis, shape)
            zero_point_block = grouped_zp.squeeze(axis + 1)
    else:
        block_size = 0
        scale_full = qt.scale.detach().float()
        elements = values / scale_full
        if scale_full.numel() == 1:
            axis, scale = 1, scale_full.reshape(())
        else:
            axis = next(i for i, n in enumerate(scale_full.shape) if n != 1)
            scale = scale_full.reshape(-1)
    fmt = weight_format(proxy)
    zero_point = None
    if is_float_quantizer(proxy):
        e, m = _float_widths(proxy)
        torch_type = float8_dtype(e, m) if proxy.is_ocp else None
        if torch_type is not None:
            code_type = TORCH_TO_ONNX[torch_type]
            codes8 = elements.to(torch_type)
            codes, code_values = codes8.view(torch.uint8).numpy(), codes8.float()
        else:
            # Every value of the format is an integer multiple of its smallest subnormal (a power of two).
            step = 2.0 ** (1 - int(proxy.exponent_bias()) - m)
            code_values = torch.round(elements / step)
            largest = float(code_values.abs().max()) if code_values.numel() else 0.0
            if largest > 2**15 - 1:
                raise _PlanError(f"{fmt} weight '{name}' has elements beyond int16 multiples of its smallest step")
            code_type, np_type = (TensorProto.INT8, np.int8) if largest <= 127 else (TensorProto.INT16, np.int16)
            codes = code_values.numpy().astype(np_type)
            scale = scale * step
    else:
        if not bool(torch.equal(zero_point_full, torch.round(zero_point_full))):
            raise _PlanError(f"{fmt} weight '{name}' has a float zero point; DequantizeLinear takes an integer one")
        code_values = torch.round(elements + zero_point_full)
        codes, code_type = _int_codes(code_values, int(proxy.bit_width()), bool(proxy.is_signed))
        if zero_point_block is not None and bool((zero_point_block != 0).any()):
            zero_point = zero_point_block.numpy().astype(codes.dtype)
    zp_values = _expand(torch.from_numpy(zero_point.astype(np.float32)), axis, block_size, shape) \
        if zero_point is not None else 0.0
    rebuilt = (code_values - zp_values) * _expand(scale, axis, block_size, shape)
    if not torch.equal(rebuilt, values):
        worst = float((rebuilt - values).abs().max())
        raise _PlanError(f"{fmt} weight '{name}' cannot be written exactly as DequantizeLinear codes "
                         f"(largest difference {worst:.3g})")
    return PlannedWeight(name=name, layer=layer, fmt=fmt, values=values.numpy(), codes=codes, code_type=code_type,
                         scale=scale.numpy().astype(np.float32), zero_point=zero_point, axis=axis,
                         block_size=block_size)


def _expand(scale: torch.Tensor, axis: int, block_size: int, shape: Sequence[int]) -> torch.Tensor:
    """What DequantizeLinear does with a per-tensor / per-axis / blocked scale: one value per element."""
    if scale.dim() == 0:
        return scale
    if block_size:
        return scale.repeat_interleave(block_size, dim=axis).narrow(axis, 0, shape[axis])
    view = [1] * len(shape)
    view[axis] = -1
    return scale.reshape(view)


def plan_weights(model: nn.Module, names: Sequence[str]) -> list[PlannedWeight]:
    """Plan the weight quantizers called ``names`` (module names of their proxies, ``<layer>.weight_quant``)."""
    modules = dict(model.named_modules())
    plans = []
    for proxy_name in names:
        layer_name = proxy_name.rsplit(".", 1)[0] if "." in proxy_name else ""
        layer, proxy = modules[layer_name], modules[proxy_name]
        plans.append(_plan_one(layer_name or "(model)", layer, proxy))
    return plans


@contextlib.contextmanager
def float_weights(plans: Sequence[PlannedWeight]) -> Iterator[None]:
    """While exporting: each planned layer computes with its quantized weight as a plain float tensor.

    The layer gets a parameter of its own for that time (its original is put back afterwards) rather than new
    values in its parameter: a weight tied to an embedding (``tie_word_embeddings``) must stay float in the
    embedding's lookup, as PyTorch computes it."""
    with contextlib.ExitStack() as stack:
        for plan in plans:
            original = plan.layer._parameters["weight"]
            stack.callback(plan.layer._parameters.__setitem__, "weight", original)
            plan.layer._parameters["weight"] = nn.Parameter(
                torch.from_numpy(plan.values.copy()).to(device=original.device, dtype=original.dtype),
                requires_grad=False)
            stack.enter_context(weight_quant_disabled(plan.layer.weight_quant))
        yield


def four_bit_tensor(name: str, code_type: int, codes: np.ndarray) -> TensorProto:
    """An ``INT4``/``UINT4`` initializer packed two codes per byte (first code in the low nibble), as the ONNX
    spec stores them in ``raw_data`` (a list of values would be stored as one varint per pair)."""
    nibbles = (np.asarray(codes).reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    return onnx.helper.make_tensor(name, code_type, list(np.shape(codes)), packed.tobytes(), raw=True)


def _code_tensor(plan: PlannedWeight, codes: np.ndarray, name: str) -> TensorProto:
    if plan.code_type in (TensorProto.INT4, TensorProto.UINT4):
        return four_bit_tensor(name, plan.code_type, codes)
    if plan.code_type in FLOAT8_ONNX_TYPES:
        raw = np.ascontiguousarray(codes).tobytes()
        return onnx.helper.make_tensor(name, plan.code_type, list(codes.shape), raw, raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(codes), name=name)


def to_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    current = next(int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if current >= opset:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, opset)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain RuntimeErrors
        raise _PlanError(f"onnx could not convert the graph from opset {current} to {opset}: {exc}") from exc
    converted.ir_version = max(converted.ir_version, 10)
    return converted


def insert_dequantize(model: onnx.ModelProto, plans: Sequence[PlannedWeight]) -> onnx.ModelProto:
    """Opset 21, and each planned weight's float initializer replaced by codes + ``DequantizeLinear``."""
    model = to_opset(model, BLOCKED_OPSET)
    graph = model.graph
    taken = {i.name for i in graph.initializer} | {n for node in graph.node for n in (*node.input, *node.output)}
    done: set[str] = set()
    for plan in plans:
        found = None
        for init in graph.initializer:
            if init.name in done or init.data_type != TensorProto.FLOAT:
                continue
            array = numpy_helper.to_array(init)
            if array.shape == plan.values.shape and np.array_equal(array, plan.values):
                found = (init, False)
                break
            if array.ndim == 2 and array.shape == plan.values.T.shape and np.array_equal(array, plan.values.T):
                found = (init, True)
                break
        if found is None:
            if any(numpy_helper.to_array(i).shape == plan.values.shape for i in graph.initializer
                   if i.name in done):
                continue  # an identical weight of another layer, already written (the exporter shares it)
            raise _PlanError(f"could not find the weight of layer '{plan.name}' ({plan.fmt}) in the exported graph")
        init, transposed = found
        codes, scale, zero_point, axis = plan.codes, plan.scale, plan.zero_point, plan.axis
        if transposed:
            codes, axis = codes.T, 1 - axis
            scale = scale.T if scale.ndim == 2 else scale
            zero_point = zero_point.T if zero_point is not None and zero_point.ndim == 2 else zero_point
        names = []
        for suffix in ("quant", "scale", "zero_point"):
            candidate, k = f"{init.name}_{suffix}", 1
            while candidate in taken:
                candidate, k = f"{init.name}_{suffix}_{k}", k + 1
            taken.add(candidate)
            names.append(candidate)
        tensors = [_code_tensor(plan, codes, names[0]),
                   numpy_helper.from_array(np.ascontiguousarray(scale, dtype=np.float32), name=names[1])]
        inputs = names[:2]
        if zero_point is not None:
            zp_plan = PlannedWeight(**{**plan.__dict__, "codes": zero_point})
            tensors.append(_code_tensor(zp_plan, np.ascontiguousarray(zero_point), names[2]))
            inputs.append(names[2])
        attributes = {"axis": axis}
        if plan.block_size:
            attributes["block_size"] = plan.block_size
        node = onnx.helper.make_node("DequantizeLinear", inputs, [init.name], name=f"{init.name}_DequantizeLinear",
                                     **attributes)
        graph.initializer.remove(init)
        graph.initializer.extend(tensors)
        graph.node.insert(0, node)
        done.add(init.name)
    return model



def pack_4bit_weights(model: onnx.ModelProto, weight_names: Sequence[str], *,
                      integer_layers: bool) -> tuple[onnx.ModelProto, int]:
    """Store the int8 codes of the 4-bit weight quantizers called ``weight_names`` (``<layer>.weight_quant``) as
    ``INT4``/``UINT4`` (opset 21), with their zero points; returns the converted model and how many were packed.

    ``integer_layers=False`` leaves the weights of layers whose activation input is quantized too (read through
    a ``DequantizeLinear``) as int8: onnxruntime 1.32 runs such a layer on its integer kernels (QGemm,
    QLinearConv, MatMulIntegerToFloat) only with 8-bit weights, and with INT4 ones dequantizes the weight on
    every call instead.

    Brevitas writes per-tensor / per-channel int2-4 weights as int8 codes (a file as large as an 8-bit one).
    The codes of a b-bit quantizer lie in the 4-bit range, so the conversion is exact; a DequantizeLinear whose
    codes do not fit (not expected) is left as it is. Matching uses the node names Brevitas gives the weight's
    ``DequantizeLinear`` (``/<layer path>/weight_quant/export_handler/DequantizeLinear``); ``weight_names`` are
    module paths in the exported module.
    """
    wanted = {f"{name}.export_handler.DequantizeLinear" for name in weight_names}
    inits = {init.name: init for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def feeds_integer_layer(dq: onnx.NodeProto) -> bool:
        for layer in consumers.get(dq.output[0], []):
            data = producers.get(layer.input[0]) if layer.input else None
            if data is not None and data.op_type == "DequantizeLinear" and data.input[0] not in inits:
                return True
        return False

    targets = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or module_path(node.name) not in wanted or node.input[0] not in inits:
            continue
        if not integer_layers and feeds_integer_layer(node):
            continue
        codes = numpy_helper.to_array(inits[node.input[0]])
        low, high = (-8, 7) if codes.dtype == np.int8 else (0, 15)
        if codes.dtype not in (np.int8, np.uint8) or codes.min(initial=0) < low or codes.max(initial=0) > high:
            continue
        targets.append(node)
    if not targets:
        return model, 0
    model = to_opset(model, BLOCKED_OPSET)
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    names = {n.name for n in targets}
    converted: dict[str, str] = {}
    for node in graph.node:
        if node.name not in names:
            continue
        for position in (0, 2):
            if len(node.input) <= position or not node.input[position] or node.input[position] not in inits:
                continue
            name = node.input[position]
            if name not in converted:
                values = numpy_helper.to_array(inits[name])
                code_type = TensorProto.INT4 if values.dtype == np.int8 else TensorProto.UINT4
                packed = f"{name}_4bit"
                graph.initializer.append(four_bit_tensor(packed, code_type, values))
                converted[name] = packed
            node.input[position] = converted[name]
    return model, len(targets)
