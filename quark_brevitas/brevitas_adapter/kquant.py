"""``scale_type=gguf_k``: per-group weight scales snapped to what a GGUF K-quant super-block stores.

Brevitas computes one scale per group of 16 input channels (from max|w|, or an MSE search) and passes the final
scales through ``restrict_scale_threshold_impl``. :class:`KQuantScaleRestrict` is that hook: for every 256 input
channels of a row it picks one float16 ``d`` (the largest group scale over ``sub_scale_max``, rounded to float16)
and rounds every group scale to an integer multiple ``1..sub_scale_max`` of it, as llama.cpp's quantizer does
when it quantizes the sub-scales of a K-quant block. ``d * sub_scale`` (11 + 7 significant bits) and its product
with a code are exact in float32, so the weight Brevitas computes is what llama.cpp (and the ``gguf`` package)
dequantize from the block. Because the hook is a pure function of the group scales, RTN, GPTQ and checkpoints
(which store the unrestricted scale parameter) all see the same grid. The gradient is straight-through (QAT,
AutoRound's learned scales).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["KQuantScaleRestrict", "float16_scale", "is_kquant_layer", "snap_kquant_scales", "snap_super_blocks"]

_FLOAT16_TINY = 2.0 ** -24
_FLOAT16_MAX = 65504.0


def float16_scale(value: torch.Tensor) -> torch.Tensor:
    """``value`` as the positive float16 number a GGUF block stores (clamped into float16's range), in float32."""
    return value.clamp(min=_FLOAT16_TINY, max=_FLOAT16_MAX).to(torch.float16).float()


def snap_super_blocks(block: torch.Tensor, top_multiple: int, low: int) -> torch.Tensor:
    """``block`` (``[..., super-blocks, groups per super-block]``, >= 0) as ``d * k``: per super-block one float16
    ``d``, its largest value over ``top_multiple``, and integers ``k`` in ``low..top_multiple``: the K-quants'
    sub-scales (``low`` 1) and sub-minimums (``low`` 0)."""
    d = float16_scale(block.amax(dim=-1, keepdim=True) / top_multiple)
    return d * torch.clamp(torch.round(block / d), low, top_multiple)


def snap_kquant_scales(scales: torch.Tensor, groups_per_super_block: int, sub_scale_max: int,
                       groups_per_32: int = 2) -> torch.Tensor:
    """``scales`` (``[..., groups]``, positive) as ``d * s``: per run of ``groups_per_super_block`` groups one
    float16 ``d``, integer ``s`` in ``1..sub_scale_max``.

    A row that is no whole number of super-blocks (MiniLM's 384 input channels) cannot be a K-quant tensor;
    llama.cpp's quantizer then writes the tensor in a 32-channel type instead (Q6_K -> Q8_0, Q3_K -> IQ4_NL). Here
    such rows get the grid that a 32-channel float16-scale type holds exactly: the ``groups_per_32`` groups of
    each 32 channels share the largest scale, rounded to float16 (see :mod:`quark_brevitas.export.gguf.kquants`)."""
    shape = scales.shape
    groups = shape[-1]
    flat = scales.reshape(-1, groups).float().abs()
    if groups % groups_per_super_block:
        pairs = groups_per_32 if groups % groups_per_32 == 0 else 1
        top = flat.reshape(flat.shape[0], -1, pairs).amax(dim=-1, keepdim=True)
        return float16_scale(top).expand(-1, -1, pairs).reshape(shape).to(scales.dtype)
    block = flat.reshape(flat.shape[0], -1, groups_per_super_block)
    return snap_super_blocks(block, sub_scale_max, 1).reshape(shape).to(scales.dtype)


class _SnapScales(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: int, sub_max: int) -> torch.Tensor:
        squeeze = x.dim() >= 2 and x.shape[-1] == 1
        values = x.squeeze(-1) if squeeze else x
        snapped = snap_kquant_scales(values, groups, sub_max, max(1, groups * 32 // 256))  # groups per 32 channels
        return snapped.unsqueeze(-1) if squeeze else snapped

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class KQuantScaleRestrict(nn.Module):
    """Brevitas ``restrict_scale_threshold_impl`` of ``scale_type=gguf_k`` (final per-group scales, shaped
    ``[out, groups, 1]``, snapped by :func:`snap_kquant_scales`)."""

    def __init__(self, kquant_groups_per_super_block: int, kquant_sub_scale_max: int) -> None:
        super().__init__()
        self.groups = int(kquant_groups_per_super_block)
        self.sub_max = int(kquant_sub_scale_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SnapScales.apply(x, self.groups, self.sub_max)


def is_kquant_layer(layer: nn.Module) -> bool:
    """Whether ``layer``'s weight scales are ``scale_type=gguf_k`` ones (its quantizer restricts them with
    :class:`KQuantScaleRestrict`): the exporter writes such an int4 weight as Q4_K, not Q4_0."""
    proxy = getattr(layer, "weight_quant", None)
    return proxy is not None and any(isinstance(module, KQuantScaleRestrict) for module in proxy.modules())
