"""Integer weights: the quantized weights of every layer as integers (or float8) plus scale and zero point.

C, FPGA and accelerator flows do not want fake-quantized float weights; they want the integer codes
and the parameters that map them back: ``weight = (int_weight - zero_point) * scale``. Brevitas
computes exactly that product in float32 to produce the quantized weight, so extracting
``int_weight`` and ``zero_point`` as integers loses nothing. :func:`integer_weights` therefore
*proves* it for every layer: each :class:`IntegerWeight` is checked with ``torch.equal`` against the
layer's ``quant_weight().value`` before it is returned.

Per-group quantizers (``per_group``, MX) keep one scale (and zero point) per group: ``scale`` then has the
weight's shape with the grouped axis divided by ``group_size`` and :meth:`IntegerWeight.dequantize` repeats
each scale over its group; MX weights (power-of-two group scales) also carry their shared exponents.

Integer formats become ``int8``/``uint8`` (up to 8 bits; ``int16``/``int32`` beyond), zero points
use the weight's dtype (ONNX's convention). OCP fp8 weights become ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` (FNUZ: ``..fnuz``); minifloats without a torch dtype (fp6, fp4) are held
exactly in float32 with their format named in ``format``. :func:`save_integer_weights` writes
them to safetensors or numpy ``.npz`` (float8 as raw ``uint8`` bit patterns there, since numpy has
no float8 type) with the per-layer metadata as JSON; no pickle either way.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from brevitas.quant_tensor import FloatQuantTensor, GroupwiseFloatQuantTensor, GroupwiseIntQuantTensor, IntQuantTensor
from torch import nn

from quark_brevitas.brevitas_adapter import (
    FLOAT8_DTYPES,
    QuantLayer,
    groupwise_parts,
    injector_value,
    is_groupwise,
    iter_quantizers,
    offset_of,
    uses_offset_dequantization,
)
from quark_brevitas.errors import ModelError, QuarkBrevitasError
from quark_brevitas.export.readback import records_of, verify_npz_file, verify_safetensors_file
from quark_brevitas.outputs import write_file

__all__ = ["IntegerWeight", "integer_weights", "save_integer_weights"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntegerWeight:
    """One layer's quantized weight as integer (or minifloat) codes with its quantization parameters.

    ``dequantize()`` == ``(int_weight - zero_point) * scale`` (in ``scale``'s dtype, broadcasting; per group:
    each scale and zero point repeated ``group_size`` times along ``axis``) reproduces the layer's quantized
    weight bit for bit.

    Attributes:
        name: The layer's module name.
        int_weight: The codes: int8/uint8/int16/int32, or float8 (fp8), or float32 holding exact
            minifloat values (fp6/fp4; see ``format``). Same shape as the layer's weight.
        scale: Float scale, broadcastable to ``int_weight`` (one element per tensor or per channel); per group:
            the weight's shape with ``axis`` divided by ``group_size`` (``[out, in // group_size]`` for a
            Linear layer; rounded up when the axis is no multiple of ``group_size``).
        zero_point: Zero point, broadcastable like ``scale`` (a scalar zero when symmetric); same dtype as
            integer ``int_weight`` (float32 if it is not integral), zero for float formats.
        bit_width: Bits per code (sign included).
        signed: Whether codes are signed.
        narrow_range: Whether the most negative code is unused (symmetric signed int formats).
        axis: The per-channel axis of ``scale``/``zero_point``, the grouped axis (input channels) per group,
            ``None`` for per-tensor.
        format: E.g. ``"int8"``, ``"uint4"``, ``"fp8_e4m3"``, ``"fp6_e3m2"``.
        exponent_bit_width: Float formats only.
        mantissa_bit_width: Float formats only.
        exponent_bias: Float formats only.
        group_size: Consecutive elements along ``axis`` sharing one scale (per-group and MX), else ``None``.
        shared_exponent: MX (power-of-two group scales) only: ``scale == 2 ** shared_exponent`` as int16,
            the unbiased exponent (OCP MX's E8M0 stores it plus 127).
        offset_dequantization: Asymmetric K-quant grids (``scale_type=gguf_k``, ``symmetric=False``) only: the
            weight is ``int_weight * scale - offset`` with ``offset`` = ``zero_point * scale`` rounded to 17
            significant bits (llama.cpp's ``d * sc * q - dmin * m``, one rounding;
            :func:`quark_brevitas.brevitas_adapter.offset_of`), not ``(int_weight - zero_point) * scale``.
    """

    name: str
    int_weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bit_width: int
    signed: bool
    narrow_range: bool
    axis: int | None
    format: str
    exponent_bit_width: int | None = None
    mantissa_bit_width: int | None = None
    exponent_bias: int | None = None
    group_size: int | None = None
    shared_exponent: torch.Tensor | None = None
    offset_dequantization: bool = False

    def expanded(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (``scale`` or ``zero_point``) broadcastable to ``int_weight``: per group, each element
        repeated over its group along ``axis`` (a last group cut short where the axis is no multiple of
        ``group_size``: Brevitas pads it); otherwise unchanged."""
        if self.group_size is None or self.axis is None or tensor.dim() == 0:
            return tensor
        repeated = tensor.repeat_interleave(self.group_size, dim=self.axis)
        return repeated.narrow(self.axis, 0, self.int_weight.shape[self.axis])

    def dequantize(self) -> torch.Tensor:
        """``(int_weight - zero_point) * scale``: the layer's quantized weight, exactly (for a float16/bfloat16
        model: exactly before the layer rounds it to its dtype)."""
        dtype = self.scale.dtype
        scale, zero_point = self.expanded(self.scale), self.expanded(self.zero_point)
        if self.offset_dequantization:
            return self.int_weight.to(dtype) * scale - offset_of(zero_point.to(dtype), scale)
        return (self.int_weight.to(dtype) - zero_point.to(dtype)) * scale

    def metadata(self) -> dict[str, Any]:
        """The non-tensor fields plus the dtypes, as plain JSON-compatible values."""
        return {
            "bit_width": self.bit_width, "signed": self.signed, "narrow_range": self.narrow_range,
            "axis": self.axis, "group_size": self.group_size, "format": self.format,
            "exponent_bit_width": self.exponent_bit_width, "mantissa_bit_width": self.mantissa_bit_width,
            "exponent_bias": self.exponent_bias,
            "int_weight_dtype": _dtype_name(self.int_weight.dtype), "scale_dtype": _dtype_name(self.scale.dtype),
            "zero_point_dtype": _dtype_name(self.zero_point.dtype),
        }


@dataclass(frozen=True)
class _Grouped:
    """A per-group quant tensor in the weight's layout: expanded codes input plus compact per-group parameters."""

    scale: torch.Tensor  # weight shape with ``axis`` divided by ``group_size``
    zero_point: torch.Tensor | None  # like ``scale``; None when Brevitas keeps none
    axis: int
    group_size: int


def _grouped(qt: Any) -> _Grouped:
    """Brevitas keeps a per-group tensor as ``[..., groups, group_size, ...]`` with scales ``[..., groups, 1, ...]``
    (``groupwise_parts``); drop the singleton group-size dimension to get one scale per group in the weight's
    own axes."""
    _, scale, zero_point, group_dim, group_size = groupwise_parts(qt)
    compact = scale.detach().squeeze(group_dim + 1)
    if zero_point is not None:
        zero_point = zero_point.detach()
        zero_point = zero_point.squeeze(group_dim + 1) if zero_point.dim() == scale.dim() else zero_point
    return _Grouped(compact, zero_point, group_dim, group_size)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _int(value: Any) -> int:
    return int(round(float(value)))


def _axis(scale: torch.Tensor, weight: torch.Tensor) -> int | None:
    if scale.numel() <= 1:
        return None
    dims = [d for d in range(scale.dim()) if scale.shape[d] != 1]
    if scale.dim() != weight.dim() or len(dims) != 1 or scale.shape[dims[0]] != weight.shape[dims[0]]:
        raise ModelError(f"weight scale of shape {list(scale.shape)} for a weight of shape {list(weight.shape)} "
                         "is neither per-tensor nor per-channel; integer_weights supports those two")
    return dims[0]


def _int_dtype(bit_width: int, signed: bool) -> torch.dtype:
    if bit_width <= 8:
        return torch.int8 if signed else torch.uint8
    if bit_width <= 16 and (signed or bit_width <= 15):
        return torch.int16
    return torch.int32


def _from_int(name: str, qt: IntQuantTensor | GroupwiseIntQuantTensor, narrow: bool,
              grouped: _Grouped | None = None) -> IntegerWeight:
    # Per group, ``qt.scale`` / ``qt.zero_point`` are already expanded to the weight's shape.
    value, scale, zero_point = qt.value.detach(), qt.scale.detach(), qt.zero_point.detach()
    bit_width, signed = _int(qt.bit_width), bool(qt.signed)
    dtype = _int_dtype(bit_width, signed)
    codes = torch.round(value / scale + zero_point)
    info = torch.iinfo(dtype)
    if codes.numel() and (codes.min() < info.min or codes.max() > info.max):
        raise QuarkBrevitasError(f"weight codes of '{name}' fall outside {_dtype_name(dtype)} ([{codes.min():.0f}, "
                                 f"{codes.max():.0f}]); the quantizer is not a {bit_width}-bit one")
    zp = zero_point
    if grouped is not None:
        scale = grouped.scale
        zp = grouped.zero_point if grouped.zero_point is not None else torch.zeros((), dtype=scale.dtype)
    if torch.equal(zp, torch.round(zp)) and (zp.numel() == 0 or (zp.min() >= info.min and zp.max() <= info.max)):
        zp = zp.to(dtype)
    return IntegerWeight(
        name=name, int_weight=codes.to(dtype), scale=scale, zero_point=zp, bit_width=bit_width, signed=signed,
        narrow_range=narrow, axis=grouped.axis if grouped is not None else _axis(scale, value),
        format=f"{'int' if signed else 'uint'}{bit_width}", group_size=None if grouped is None else grouped.group_size,
    )


def _from_float(name: str, qt: FloatQuantTensor | GroupwiseFloatQuantTensor,
                grouped: _Grouped | None = None) -> IntegerWeight:
    value, scale = qt.value.detach(), qt.scale.detach()
    e, m, bias = _int(qt.exponent_bit_width), _int(qt.mantissa_bit_width), _int(qt.exponent_bias)
    signed = bool(qt.signed)
    if not torch.equal(qt.zero_point.detach(), torch.zeros_like(qt.zero_point)):
        raise ModelError(f"float weight quantizer of '{name}' has a non-zero zero point; not supported")
    codes = qt.minifloat().detach()
    dtype = FLOAT8_DTYPES.get((e, m, bias))
    if dtype is not None:
        codes = codes.to(dtype)
    if grouped is not None:
        scale = grouped.scale
    return IntegerWeight(
        name=name, int_weight=codes, scale=scale, zero_point=torch.zeros((), dtype=scale.dtype),
        bit_width=e + m + int(signed), signed=signed, narrow_range=False,
        axis=grouped.axis if grouped is not None else _axis(scale, value),
        format=f"fp{e + m + int(signed)}_e{e}m{m}", exponent_bit_width=e, mantissa_bit_width=m, exponent_bias=bias,
        group_size=None if grouped is None else grouped.group_size,
    )


def _is_power_of_two_scaled(proxy: nn.Module) -> bool:
    """Whether the quantizer restricts its scales to powers of two (MX's shared exponents)."""
    restrict = injector_value(proxy, "restrict_scaling_type")
    return getattr(restrict, "name", str(restrict)).upper().endswith("POWER_OF_TWO")


def _with_shared_exponent(name: str, entry: IntegerWeight) -> IntegerWeight:
    """``entry`` with ``shared_exponent = log2(scale)``, checked exact (the MX rule picks powers of two)."""
    exponent = torch.round(torch.log2(entry.scale.float()))
    if not torch.equal(torch.exp2(exponent).to(entry.scale.dtype), entry.scale):
        raise QuarkBrevitasError(f"weight scales of '{name}' are restricted to powers of two but are not; "
                                 "please report this")
    return replace(entry, shared_exponent=exponent.to(torch.int16))


def _extract(label: str, proxy: nn.Module, qt: Any) -> IntegerWeight:
    """The :class:`IntegerWeight` of one quant tensor (integer or minifloat, per tensor/channel/group)."""
    grouped = _grouped(qt) if is_groupwise(proxy) else None
    if isinstance(qt, IntQuantTensor | GroupwiseIntQuantTensor):
        entry = _from_int(label, qt, bool(proxy.is_narrow_range), grouped)
    elif isinstance(qt, FloatQuantTensor | GroupwiseFloatQuantTensor):
        entry = _from_float(label, qt, grouped)
    else:
        raise ModelError(f"weight quantizer of '{label}' returned a {type(qt).__name__}; integer_weights "
                         "supports integer and minifloat quantizers")
    if grouped is not None and _is_power_of_two_scaled(proxy):
        entry = _with_shared_exponent(label, entry)
    if uses_offset_dequantization(proxy):
        entry = replace(entry, offset_dequantization=True)
    return entry


def integer_weights(model: nn.Module, *, embeddings: bool = False) -> dict[str, IntegerWeight]:
    """For every layer with an enabled weight quantizer: its integer (or float8) weight and parameters.

    ``embeddings``: include quantized embedding tables (``QuantEmbedding``, a ``[vocab, width]`` weight) too, for
    formats that store them as blocks of rows like any weight (GGUF); by default they are left out with a warning.

    Keys are module names in model order. Each entry is verified: ``entry.dequantize()`` equals the
    layer's ``quant_weight().value`` exactly (``torch.equal``), else an error names the layer.
    Supports integer (any bit width, signed or unsigned, symmetric or asymmetric, float or power-of-two
    scales, per tensor, per channel or per group) and minifloat (fp8 e4m3/e5m2 OCP or FNUZ, fp6, fp4; MX) weights.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    result: dict[str, IntegerWeight] = {}
    other = []
    with torch.no_grad():
        for site in iter_quantizers(model):
            if site.kind != "weight":
                continue
            layer = site.layer
            table = embeddings and isinstance(layer, nn.Embedding) and hasattr(layer, "quant_weight")
            if not (isinstance(layer, QuantLayer) or table) or site.attribute != "weight_quant":
                other.append(site.name)
                continue
            label = site.layer_name or "(model)"
            qt = layer.quant_weight()
            entry = _extract(label, site.proxy, qt)
            # A float16/bfloat16 model computes the quantized weight in float32 and rounds it to its dtype.
            if not torch.equal(entry.dequantize().to(qt.value.dtype), qt.value):
                diff = (entry.dequantize() - qt.value.float()).abs().max().item()
                raise QuarkBrevitasError(f"integer weights of '{label}' ({entry.format}) do not reproduce its "
                                         f"quantized weight exactly (max difference {diff:.3g}); please report this")
            result[label] = entry
    if other:
        logger.warning("integer_weights: weight quantizers outside weight/bias layers are not extracted: %s",
                       ", ".join(other))
    return result


def save_integer_weights(
    weights: Mapping[str, IntegerWeight], path: str | os.PathLike[str], format: str = "safetensors"
) -> Path:
    """Write the output of :func:`integer_weights` for C/FPGA flows; returns the path.

    Tensors are named ``<layer>.int_weight``, ``<layer>.scale`` and ``<layer>.zero_point`` (MX also
    ``<layer>.shared_exponent``); the
    per-layer metadata (:meth:`IntegerWeight.metadata`) is stored as JSON: in the safetensors header
    (key ``quark_brevitas.integer_weights``) or as the string array ``__metadata__`` of the ``.npz``.

    - ``format="safetensors"``: float8 codes keep their float8 dtype.
    - ``format="npz"``: numpy arrays (load with ``numpy.load(path)``, no pickle); float8 codes are
      stored as their ``uint8`` bit patterns (``int_weight_dtype`` in the metadata says which format).
    """
    if format not in ("safetensors", "npz"):
        raise ValueError(f"format must be 'safetensors' or 'npz', got {format!r}")
    for key, entry in weights.items():
        if not isinstance(entry, IntegerWeight):
            raise TypeError(f"weights[{key!r}] must be an IntegerWeight, got {type(entry).__name__}")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"path {str(target)!r} is a directory; give the file to write")
    target.parent.mkdir(parents=True, exist_ok=True)
    metadata = json.dumps({name: entry.metadata() for name, entry in weights.items()})
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in weights.items():
        tensors[f"{name}.int_weight"] = entry.int_weight.detach().cpu().contiguous()
        tensors[f"{name}.scale"] = entry.scale.detach().cpu().contiguous()
        tensors[f"{name}.zero_point"] = entry.zero_point.detach().cpu().contiguous()
        if entry.shared_exponent is not None:
            tensors[f"{name}.shared_exponent"] = entry.shared_exponent.detach().cpu().contiguous()
    if format == "safetensors":
        from safetensors.torch import save_file

        def save_safetensors(tmp: Path) -> None:
            save_file(tensors, str(tmp), metadata={"quark_brevitas.integer_weights": metadata})
            verify_safetensors_file(tmp, target, records_of(tensors))  # read back before the rename

        write_file(target, save_safetensors)
        return target
    import numpy as np

    arrays: dict[str, Any] = {"__metadata__": np.array(metadata)}
    for key, tensor in tensors.items():
        if tensor.dtype in FLOAT8_DTYPES.values():
            tensor = tensor.view(torch.uint8)
        arrays[key] = tensor.numpy()
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as handle:  # an open file keeps numpy from appending ".npz" to the name
            np.savez(handle, **arrays)
        verify_npz_file(tmp, target, arrays)  # read back before the rename

    write_file(target, save)
    return target
