"""Asymmetric K-quant grids (``scale_type=gguf_k`` with ``symmetric=False``): what llama.cpp's Q4_K, Q5_K and Q2_K
store, ``w = d * sc * q - dmin * m`` with unsigned codes ``q``, per sub-block an integer sub-scale ``sc`` and
sub-minimum ``m`` (6-bit; Q2_K: 4-bit) and per super-block of 256 input channels one float16 ``d`` and ``dmin``.

Brevitas's asymmetric quantizer keeps a scale ``s`` and a zero point ``z`` (in code units) per group and computes
``(q - z) * s``. Three hooks make that grid the K-quant one, exactly:

- the scale: :class:`~quark_brevitas.brevitas_adapter.kquant.KQuantScaleRestrict` (``s = d * sc``, as for the
  symmetric K grids);
- the zero point: :class:`KQuantMinimumShift` (Brevitas's ``scale_shift_zero_point_impl``) snaps each group's
  offset ``z * s`` (minus its minimum) to ``dmin * m`` per super-block and returns ``z = dmin * m / s``;
- the dequantization: :class:`KQuantOffsetIntQuant` computes ``q * s - dmin * m`` rather than ``(q - z) * s``. The
  two are the same number, but ``z = dmin * m / s`` is rarely a float32 number, so ``(q - z) * s`` is off by an
  ulp where llama.cpp (and the ``gguf`` package) compute ``d * sc * q - dmin * m`` with one rounding.
  ``dmin * m`` (at most 11 + 6 significant bits) is recovered from ``z * s`` by rounding it to
  :data:`OFFSET_SIGNIFICANT_BITS` significant bits (:func:`offset_of`): ``z`` is within a float32 rounding of the
  exact quotient, far closer than half a step at 17 bits.

The initial scale and minimum of each group come from a least-squares search (:class:`KQuantRangeSearch`,
:class:`KQuantMinimumSearch`, both :func:`search_scale_minimum`): codes from a few candidate scales around the
min-max one, then the scale and minimum that fit those codes best; the snapped grid rounds every weight to its
nearest code again. RTN, GPTQ, Qronos and AutoRound all round on the snapped grid.
"""

from __future__ import annotations

from typing import Any

import torch
from brevitas.core.quant.int_base import IntQuant
from torch import nn

from quark_brevitas.brevitas_adapter.kquant import snap_super_blocks
from quark_brevitas.errors import ModelError

__all__ = ["KQUANT_MINIMUM_LETS", "OFFSET_SIGNIFICANT_BITS", "KQuantMinimumSearch", "KQuantMinimumShift",
           "KQuantOffsetIntQuant", "KQuantRangeSearch", "offset_dequantize", "offset_of", "search_scale_minimum",
           "snap_kquant_minimums", "uses_offset_dequantization"]

#: Significant bits of a sub-minimum ``dmin * m``: float16's 11 times a 6-bit integer.
OFFSET_SIGNIFICANT_BITS = 17
#: Candidate scales of the search: (code range + k * step) / (max - min) for k in -steps..steps.
_SEARCH_STEPS, _SEARCH_STEP = 10, 0.1


def offset_of(zero_point: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dmin * m`` of a K grid's group from its zero point and scale: ``z * s`` rounded to
    :data:`OFFSET_SIGNIFICANT_BITS` significant bits (exact: see the module docstring)."""
    product = zero_point * scale
    mantissa, exponent = torch.frexp(product)
    unit = float(2 ** OFFSET_SIGNIFICANT_BITS)
    return torch.ldexp(torch.round(mantissa * unit), exponent - OFFSET_SIGNIFICANT_BITS)


def snap_kquant_minimums(offsets: torch.Tensor, scales: torch.Tensor, groups_per_super_block: int,
                         minimum_max: int) -> torch.Tensor:
    """Zero points (code units) of the groups' ``offsets`` (``[..., groups]``, >= 0: minus each group's minimum)
    snapped to ``dmin * m``: per run of ``groups_per_super_block`` groups one float16 ``dmin`` (the largest offset
    over ``minimum_max``), integers ``m`` in ``0..minimum_max``; ``scales``: the groups' final scales."""
    shape = scales.shape
    groups = shape[-1]
    if groups % groups_per_super_block:
        raise ModelError(f"an asymmetric K-quant grid (scale_type=gguf_k, symmetric=False) needs rows of whole "
                         f"super-blocks ({groups_per_super_block} groups); a weight has {groups} groups per row: "
                         "quantize it with a symmetric gguf_k grid or a 32-channel type (gguf_q4_1, gguf_q5_0)")
    block = offsets.reshape(-1, groups // groups_per_super_block, groups_per_super_block).float().clamp(min=0)
    minimum = snap_super_blocks(block, minimum_max, 0)
    return (minimum.reshape(shape) / scales.float()).to(scales.dtype)


class _SnapMinimums(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, offsets: torch.Tensor, scales: torch.Tensor, groups: int, minimum_max: int) -> torch.Tensor:
        squeeze = offsets.dim() >= 2 and offsets.shape[-1] == 1
        values = offsets.squeeze(-1) if squeeze else offsets
        steps = scales.squeeze(-1) if squeeze else scales
        snapped = snap_kquant_minimums(values, steps.expand_as(values), groups, minimum_max)
        return snapped.unsqueeze(-1) if squeeze else snapped

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        return None, None, None, None


class KQuantMinimumShift(nn.Module):
    """Brevitas ``scale_shift_zero_point_impl`` of an asymmetric K grid: the zero point parameter (each group's
    offset, minus its minimum) -> ``dmin * m / s`` in code units (:func:`snap_kquant_minimums`). The offsets are
    learned straight-through like the scales (QAT); the zero point's value follows the snapped scale."""

    def __init__(self, kquant_groups_per_super_block: int, kquant_minimum_max: int) -> None:
        super().__init__()
        self.groups = int(kquant_groups_per_super_block)
        self.minimum_max = int(kquant_minimum_max)

    def forward(self, zero_point: torch.Tensor, scale: torch.Tensor, bit_width: torch.Tensor) -> torch.Tensor:
        snapped = _SnapMinimums.apply(zero_point.detach(), scale.detach(), self.groups, self.minimum_max)
        straight = zero_point / scale  # the gradient of Brevitas's own shift (offset / scale)
        return straight + (snapped - straight).detach()


def offset_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """``codes * scale - offset_of(zero_point, scale)``, with the gradient of ``(codes - zero_point) * scale`` (the
    same number up to an ulp; the rounding inside :func:`offset_of` would stop it): QAT, AutoRound."""
    straight = (codes - zero_point) * scale
    exact = codes.detach() * scale.detach() - offset_of(zero_point.detach(), scale.detach())
    return straight + (exact - straight).detach()


class KQuantOffsetIntQuant(IntQuant):
    """Brevitas's ``IntQuant`` (same codes) whose dequantization is ``q * s - offset_of(z, s)``: llama.cpp's
    ``d * sc * q - dmin * m`` with its single rounding (see the module docstring)."""

    def forward(self, scale: torch.Tensor, zero_point: torch.Tensor, bit_width: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
        return offset_dequantize(self.to_int(scale, zero_point, bit_width, x), scale, zero_point)


def uses_offset_dequantization(proxy: nn.Module) -> bool:
    """Whether the quantizer ``proxy`` dequantizes as ``q * s - offset_of(z, s)`` (an asymmetric K grid)."""
    return any(isinstance(module, KQuantOffsetIntQuant) for module in proxy.modules())


def search_scale_minimum(x: torch.Tensor, code_max: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (the elements along ``dim``), a scale ``s > 0`` and offset ``o >= 0`` for ``x ~ s * q - o`` with
    codes ``q`` in ``0..code_max``, chosen for the least squared error: for each candidate scale around the min-max
    one (its code range widened or narrowed by up to one code) the codes it gives, then the scale and offset that
    fit those codes best (least squares, the offset held >= 0 so the grid contains zero); the best fit wins."""
    x = x.float().movedim(dim, -1)
    low = x.amin(dim=-1, keepdim=True).clamp(max=0)
    high = x.amax(dim=-1, keepdim=True).clamp(min=0)
    width = (high - low).clamp(min=torch.finfo(torch.float32).tiny)
    best_scale = width / code_max
    best_offset = -low
    best_error = ((torch.clamp(torch.round((x - low) / best_scale), 0, code_max) * best_scale - best_offset - x) ** 2
                  ).sum(dim=-1, keepdim=True)
    count = x.shape[-1]
    for step in range(-_SEARCH_STEPS, _SEARCH_STEPS + 1):
        inverse = (code_max + step * _SEARCH_STEP) / width
        codes = torch.clamp(torch.round((x - low) * inverse), 0, code_max)
        sum_q, sum_qq = codes.sum(-1, keepdim=True), (codes * codes).sum(-1, keepdim=True)
        sum_x, sum_qx = x.sum(-1, keepdim=True), (codes * x).sum(-1, keepdim=True)
        det = count * sum_qq - sum_q * sum_q
        scale = (count * sum_qx - sum_q * sum_x) / det.clamp(min=1e-30)
        offset = (scale * sum_q - sum_x) / count
        clamped = offset < 0  # the grid must reach zero: fit the scale alone
        scale = torch.where(clamped, sum_qx / sum_qq.clamp(min=1e-30), scale)
        offset = torch.where(clamped, torch.zeros_like(offset), offset)
        valid = (det > 0) & (scale > 0)
        error = ((codes * scale - offset - x) ** 2).sum(dim=-1, keepdim=True)
        better = valid & (error < best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
        best_error = torch.where(better, error, best_error)
    return best_scale.movedim(-1, dim), best_offset.movedim(-1, dim)


class _GroupSearch(nn.Module):
    """A Brevitas statistic (reduced along ``stats_reduce_dim``) from :func:`search_scale_minimum`."""

    def __init__(self, kquant_code_max: int, stats_reduce_dim: int | None = None, keepdim: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.code_max = int(kquant_code_max)
        self.stats_reduce_dim = -1 if stats_reduce_dim is None else stats_reduce_dim
        self.keepdim = keepdim

    def _search(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, offset = search_scale_minimum(x.detach(), self.code_max, self.stats_reduce_dim)
        if not self.keepdim:
            scale, offset = scale.squeeze(self.stats_reduce_dim), offset.squeeze(self.stats_reduce_dim)
        return scale.to(x.dtype), offset.to(x.dtype)


class KQuantRangeSearch(_GroupSearch):
    """``scaling_stats_impl`` of an asymmetric K grid: the searched scale times the code range (Brevitas divides
    the statistic by ``2^b - 1``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._search(x)[0] * self.code_max


class KQuantMinimumSearch(_GroupSearch):
    """``zero_point_stats_impl`` of an asymmetric K grid: minus the searched offset (Brevitas's statistic is the
    group's minimum, <= 0; the zero point parameter keeps its magnitude)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -self._search(x)[1]


#: ``.let`` arguments turning Brevitas's asymmetric per-group weight quantizer (scales restricted by
#: :class:`~quark_brevitas.brevitas_adapter.kquant.KQuantScaleRestrict`) into an asymmetric K grid; the injector
#: also needs ``kquant_minimum_max`` and ``kquant_code_max``.
KQUANT_MINIMUM_LETS: dict[str, Any] = {
    "scaling_stats_impl": KQuantRangeSearch, "zero_point_stats_impl": KQuantMinimumSearch,
    "scale_shift_zero_point_impl": KQuantMinimumShift, "int_quant": KQuantOffsetIntQuant,
    "quantize_zero_point": False}
