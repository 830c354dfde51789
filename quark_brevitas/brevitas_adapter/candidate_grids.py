"""Fake-quantizing many candidate weights of one layer, each on the grid its own statistics give, without a
Brevitas quantizer call per candidate.

AWQ tries 20 scalings and 10 clipping ranges per layer: each candidate weight is quantized on the grid the layer's
weight quantizer would initialise from it (:func:`~quark_brevitas.brevitas_adapter.grids.weight_grid`). Through
Brevitas that is a full proxy call (dependency-injected modules, state reset, a quant tensor) of about 2.5 ms for a
256 x 688 layer, a tenth of AWQ's search on a small Llama. For the common quantizer (per group, absolute-maximum
statistics, float scale, zero zero point, constant bit width, plain round half to even and clamp) the same result
is a handful of tensor operations: the ones Brevitas performs, in its order, so the values are bit for bit the
same (``tests/brevitas_adapter/test_candidate_grids.py`` compares them on many random weights and grids). Any other
quantizer gets ``None`` and the caller goes through Brevitas. Every quantizer accepted is also checked once, on the
layer's own weight, against Brevitas's result before it is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quark_brevitas.brevitas_adapter.grids import int_weight_quant, plain_round_and_clamp, weight_grid
from quark_brevitas.brevitas_adapter.introspection import injector_value, is_groupwise

__all__ = ["candidate_quantizer"]

Quantizer = Callable[[torch.Tensor], torch.Tensor]


def _clamp_min(module: nn.Module) -> float | None:
    """The minimum of a ``ScalarSignedClampMinSte`` (Brevitas's scale floor), ``None`` for any other clamp."""
    from brevitas.core.function_wrapper.ops_ste import ScalarSignedClampMinSte

    return float(module.min_val) if type(module) is ScalarSignedClampMinSte else None


def _plain_parts(layer: nn.Module) -> tuple[int, float, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(group size, scale floor, int threshold, min int, max int)`` of ``layer``'s weight quantizer when it is the
    plain per-group absolute-maximum one whose operations :func:`candidate_quantizer` repeats, else ``None``."""
    from brevitas.core.bit_width.const import BitWidthConst
    from brevitas.core.function_wrapper.misc import Identity
    from brevitas.core.quant.delay import _NoDelay
    from brevitas.core.quant.int import RescalingIntQuant
    from brevitas.core.quant.int_base import IntQuant
    from brevitas.core.restrict_val import FloatRestrictValue
    from brevitas.core.scaling.standalone import ParameterFromStatsFromParameterScaling
    from brevitas.core.stats.stats_op import AbsMax
    from brevitas.core.zero_point import ZeroZeroPoint

    proxy, int_quant = int_weight_quant(layer)
    tensor_quant = proxy.tensor_quant
    scaling = getattr(tensor_quant, "scaling_impl", None)
    if (type(tensor_quant) is not RescalingIntQuant or type(int_quant) is not IntQuant or not is_groupwise(proxy)
            or not plain_round_and_clamp(int_quant.float_to_int_impl, int_quant.tensor_clamp_impl)
            or type(int_quant.delay_wrapper.delay_impl) is not _NoDelay
            or type(tensor_quant.zero_point_impl) is not ZeroZeroPoint
            or type(tensor_quant.msb_clamp_bit_width_impl) is not BitWidthConst
            or type(scaling) is not ParameterFromStatsFromParameterScaling or scaling.local_loss_mode
            or layer.weight.dim() != 2 or int_quant.input_view_impl.group_dim != 1):
        return None
    stats, inner = scaling.parameter_list_stats.stats, scaling.stats_scaling_impl
    floors = {_clamp_min(scaling.clamp_scaling.clamp_min_ste), _clamp_min(inner.restrict_clamp_scaling.clamp_ste)}
    if (type(stats.stats_impl) is not AbsMax or stats.stats_impl.stats_reduce_dim != 2
            or type(inner.affine_rescaling) is not Identity
            or type(inner.restrict_clamp_scaling.restrict_value_impl) is not FloatRestrictValue
            or type(inner.restrict_clamp_threshold.restrict_value_impl) is not FloatRestrictValue
            or type(inner.restrict_clamp_threshold.clamp_ste) is not Identity
            or type(inner.restrict_clamp_scale_threshold.restrict_value_impl) is not Identity
            or type(inner.restrict_clamp_scale_threshold.clamp_ste) is not Identity
            or len(floors) != 1 or None in floors):
        return None
    with torch.no_grad():
        bit_width = tensor_quant.msb_clamp_bit_width_impl()
        threshold = tensor_quant.int_scaling_impl(bit_width).abs()
        return (int(injector_value(proxy, "group_size")), floors.pop(), threshold,
                int_quant.min_int(bit_width), int_quant.max_int(bit_width))


def candidate_quantizer(layer: nn.Module) -> Quantizer | None:
    """A function giving, for an ``[out, in]`` float32 weight ``w``, exactly ``weight_grid(layer, w).quantize(w)``
    (``layer``'s quantizer re-initialised from ``w``, then ``w`` on that grid), without touching the quantizer's
    state; ``None`` when ``layer``'s weight quantizer is not one it covers (then use :func:`weight_grid`).

    The operations are Brevitas's, in its order: group absolute maxima, the scale floor, division by the integer
    threshold (``ParameterFromStatsFromParameterScaling``'s first call, whose multiplications by its initial 1 and
    additions of 0 are exact), then ``IntQuant``: divide, add the zero point, round half to even, clamp, subtract
    the zero point, multiply by the scale."""
    parts = _plain_parts(layer)
    if parts is None:
        return None
    size, floor, threshold, min_int, max_int = parts
    zero = torch.zeros((), dtype=threshold.dtype, device=threshold.device)

    def quantize(weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        groups = -(-in_features // size)
        grouped = torch.nn.functional.pad(weight, (0, groups * size - in_features)).view(out_features, groups, size)
        stats = torch.max(torch.abs(grouped), dim=2, keepdim=True)[0]
        scale = torch.clamp_min(stats, floor) / threshold
        codes = torch.clamp(torch.round(grouped / scale + zero), min_int, max_int)
        return ((codes - zero) * scale).view(out_features, -1)[:, :in_features]

    with torch.no_grad():
        weight = layer.weight.detach()
        if weight.dtype != torch.float32 or not torch.equal(quantize(weight), weight_grid(layer).quantize(weight)):
            return None
    return quantize
