"""Dynamic symmetric int8 per-group codes as onnxruntime's MLAS computes them: ``x * (127 / max|x|)``.

onnxruntime's ``MatMulNBits`` at ``accuracy_level`` 4 quantizes its float input per block of ``block_size`` along
K before the int8 x int4 products (MLAS ``QuantizeARow_CompInt8_avx2`` / ``_avx512``, the two x86 paths
agree): ``amax = max|a|`` over the block (float32), scale ``amax / 127`` (one float32 division), codes
``round_half_even(a * inverse)`` with ``inverse = 127 / amax`` (one float32 division, ``0`` when ``amax`` is 0),
the dequantized block ``codes * scale``. Brevitas's ``IntQuant`` divides by the scale instead
(``round(a / (amax / 127))``), which picks the other code about twice per million elements (near ties, where the
two roundings of the same real quotient differ). A model whose dynamic per-group int8 inputs use
:class:`ReciprocalIntQuant` computes exactly what the kernel computes, so its file can feed the raw float input
to the kernel (:mod:`quark_brevitas.export.onnx.dynamic`), without the explicit quantization ops that cost a quarter
of a decode step.

Brevitas pieces replaced for such a quantizer (:data:`RECIPROCAL_INT8_LETS`): ``int_quant`` (the code
computation) and ``scaling_min_val`` (Brevitas clamps ``amax`` at 1e-10 before dividing; MLAS does not, so a group
with ``0 < amax < 1e-10`` would otherwise get another scale). An all-zero group then has scale 0 and codes 0 (as in
MLAS). A group whose ``127 / amax`` overflows float32 (``amax`` below about 3.7e-37) gets codes 0 as MLAS's AVX-512
path computes them (its int32 conversion of infinity keeps a zero low byte; the AVX2 path saturates to -128 instead,
values of about 1e-37 either way).
Canary: ``tests/brevitas_adapter/test_adapter_reciprocal.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from brevitas.core.quant import IntQuant
from torch import nn

__all__ = ["RECIPROCAL_INT8_LETS", "ReciprocalIntQuant", "reciprocal_codes", "uses_reciprocal_codes"]


def reciprocal_codes(x: torch.Tensor, max_int: torch.Tensor, element_dim: int) -> torch.Tensor:
    """``x * (max_int / max|x|)`` per group (the groups' elements along ``element_dim``), unrounded: MLAS's order of
    operations in float32; groups whose reciprocal is not finite (all zero, or ``max|x|`` so small that it
    overflows) multiply by 0."""
    amax = x.abs().amax(dim=element_dim, keepdim=True)
    inverse = max_int.to(x.dtype) / amax
    inverse = torch.where(torch.isfinite(inverse), inverse, torch.zeros_like(inverse))
    return x * inverse


class ReciprocalIntQuant(IntQuant):
    """Brevitas's ``IntQuant`` (same constructor, same ``forward``: ``(codes - zero_point) * scale``) whose codes
    are ``round(x * (max_int / max|x|))`` over each group of its grouped input view rather than
    ``round(x / scale)`` (see the module docstring). Only for dynamic symmetric per-group quantizers, whose scale
    is ``max|x| / max_int`` of the same groups."""

    def to_int(self, scale: torch.Tensor, zero_point: torch.Tensor, bit_width: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
        x = self.input_view_impl(x)
        group_dim = int(getattr(self.input_view_impl, "group_dim", -1))
        element_dim = group_dim + 1 if group_dim >= 0 else group_dim
        y = reciprocal_codes(x, self.max_int(bit_width), element_dim) + zero_point
        y = self.float_to_int_impl(y)
        return self.tensor_clamp_impl(y, min_val=self.min_int(bit_width), max_val=self.max_int(bit_width))


#: ``.let`` arguments turning Brevitas's dynamic symmetric per-group int quantizer into MLAS's arithmetic.
RECIPROCAL_INT8_LETS: dict[str, Any] = {"int_quant": ReciprocalIntQuant, "scaling_min_val": None}


def uses_reciprocal_codes(proxy: nn.Module) -> bool:
    """Whether the quantizer ``proxy`` computes its codes with :class:`ReciprocalIntQuant`."""
    return any(isinstance(module, ReciprocalIntQuant) for module in proxy.modules())
