"""GGUF K-quant block types as weight formats: which integer grid each one stores (plain data, no torch).

llama.cpp's K-quants group 256 consecutive input channels of one row into a *super-block*, split it into
sub-blocks of 16 (Q3_K, Q6_K) or 32 channels and store, per sub-block, a small integer *sub-scale*, and per
super-block one float16 number ``d`` that the sub-scales multiply: a weight is ``d * sub_scale * code``. A
per-group integer weight whose group scales are, in every super-block, integer multiples ``1..sub_scale_max`` of
one float16 number is therefore a K-quant block exactly; ``scale_type=gguf_k`` makes the scales so (the
restriction is :class:`quark_brevitas.brevitas_adapter.kquant.KQuantScaleRestrict`) and
:mod:`quark_brevitas.export.gguf.kquants` packs them.

``Q6_K`` (int6 codes -32..31, int8 sub-scales) and ``Q3_K`` (int3 codes -4..3, 6-bit signed sub-scales) are
symmetric. ``Q2_K``, ``Q4_K`` and ``Q5_K`` store unsigned codes ``q`` and a second per-sub-block term:
``d * s * q - dmin * m`` (sub-minimums ``m`` of the same width as ``s``, one float16 ``dmin`` per super-block).
Two grids hold them:

- ``symmetric=False`` (uint2 / uint4 / uint5): llama.cpp's own, a minimum per sub-block
  (:mod:`quark_brevitas.brevitas_adapter.kquant_minimum` snaps the zero points to ``dmin * m`` and dequantizes as
  ``d * s * q - dmin * m``); the ``gguf_q4_k_m`` / ``gguf_q5_k_m`` / ``gguf_q3_k_m`` / ``gguf_q2_k_mix`` mixes use it;
- ``symmetric=True`` (int2 / int4 / int5, the presets ``gguf_q2_k``, ``gguf_q4_k``, ``gguf_q5_k``): a signed code on
  the sub-block's scale, written with ``dmin = 2 ** (bits - 1) * d`` and ``m = s`` (``d * s * q - dmin * m`` then
  equals ``d * s * (q - 2 ** (bits - 1))``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quark_brevitas.config.enums import ParamType, QuantType, ScaleType
from quark_brevitas.errors import ConfigError

__all__ = ["GGUF_0_BIT_WIDTHS", "GGUF_0_GROUP_SIZE", "KQUANT_BY_BITS", "KQUANT_SUPER_BLOCK", "KQUANT_TYPES",
           "KQuantType", "verify_gguf_scales"]

#: Input channels per K-quant super-block (llama.cpp's ``QK_K``).
KQUANT_SUPER_BLOCK = 256


@dataclass(frozen=True)
class KQuantType:
    """One K-quant type: GGUF name, code bits, channels per sub-block, the largest sub-scale used and whether the
    type stores sub-minimums (``d * s * q - dmin * m``; written with ``dmin = 2 ** (bits - 1) * d``, ``m = s``)."""

    name: str
    bit_width: int
    group_size: int
    sub_scale_max: int
    with_minimum: bool = False

    @property
    def minimum_max(self) -> int:
        """The largest sub-minimum ``m`` (types with sub-minimums: as wide as the sub-scales)."""
        return self.sub_scale_max if self.with_minimum else 0

    @property
    def groups_per_super_block(self) -> int:
        return KQUANT_SUPER_BLOCK // self.group_size


#: The K-quant types a ``scale_type=gguf_k`` weight can be.
KQUANT_TYPES: dict[str, KQuantType] = {
    "Q6_K": KQuantType("Q6_K", 6, 16, 127),  # int8 sub-scales (positive ones used)
    "Q3_K": KQuantType("Q3_K", 3, 16, 31),  # 6-bit signed sub-scales stored + 32 (positive ones used)
    "Q2_K": KQuantType("Q2_K", 2, 16, 15, with_minimum=True),  # 4-bit sub-scales and sub-minimums
    "Q4_K": KQuantType("Q4_K", 4, 32, 63, with_minimum=True),  # 6-bit sub-scales and sub-minimums
    "Q5_K": KQuantType("Q5_K", 5, 32, 63, with_minimum=True),
}
#: bit width -> the K-quant type of a ``gguf_k`` weight with that many bits.
KQUANT_BY_BITS: dict[int, KQuantType] = {t.bit_width: t for t in KQUANT_TYPES.values()}


def _verify_kquant(spec: Any, kind: str, per_group: bool, path: str) -> None:
    """``scale_type=gguf_k``: integer weights per group with the bits and sub-block of a K-quant type, symmetric, or
    asymmetric (a float minimum per sub-block) for the types that store sub-minimums."""
    kquant = KQUANT_BY_BITS.get(spec.bit_width)
    fits = ", ".join(f"{t.name}: int{t.bit_width} {'symmetric or asymmetric' if t.with_minimum else 'symmetric'} "
                     f"per_group group_size={t.group_size}" for t in KQUANT_TYPES.values())
    if (kind != "weight" or spec.quant_type is not QuantType.int_quant or not per_group
            or kquant is None or spec.group_size != kquant.group_size
            or not (spec.symmetric or (kquant.with_minimum and spec.param_type is ParamType.stats))):
        raise ConfigError(f"{path}.scale_type", f"gguf_k scales are GGUF K-quant super-blocks of weights; allowed: "
                          f"{fits}; asymmetric ones with param_type=stats (presets gguf_q2_k .. gguf_q6_k, "
                          f"gguf_q4_k_m ...)")


#: Bit widths of ``scale_type=gguf_0`` (GGUF Q4_0 and Q5_0) and its group size.
GGUF_0_BIT_WIDTHS = (4, 5)
GGUF_0_GROUP_SIZE = 32


def _verify_gguf_0(spec: Any, kind: str, per_group: bool, path: str) -> None:
    """``scale_type=gguf_0``: int4 / int5 symmetric weights per group of 32 on the full code range, scales from
    the statistic (the signed largest-magnitude weight; an MSE search has no sign to keep)."""
    if (kind != "weight" or spec.quant_type is not QuantType.int_quant or not per_group or not spec.symmetric
            or spec.bit_width not in GGUF_0_BIT_WIDTHS or spec.group_size != GGUF_0_GROUP_SIZE
            or spec.narrow_range or spec.param_type is not ParamType.stats):
        raise ConfigError(f"{path}.scale_type", "gguf_0 scales are GGUF Q4_0 / Q5_0 blocks as llama.cpp fills them; "
                          "allowed: int4 or int5 symmetric per_group group_size=32 weights, narrow_range not True, "
                          "param_type=stats")


def verify_gguf_scales(spec: Any, kind: str, per_group: bool, path: str) -> None:
    """Raise ConfigError unless a ``scale_type=gguf_k`` / ``gguf_0`` spec (``path``: its field) describes weights a
    GGUF block type stores exactly; ``per_group``: whether its scheme is per_group."""
    if spec.scale_type is ScaleType.gguf_k:
        _verify_kquant(spec, kind, per_group, path)
    elif spec.scale_type is ScaleType.gguf_0:
        _verify_gguf_0(spec, kind, per_group, path)
