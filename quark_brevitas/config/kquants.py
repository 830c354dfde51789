"""GGUF K-quant block types as weight formats: which integer grid each one stores (plain data, no torch).

llama.cpp's K-quants group 256 consecutive input channels of one row into a *super-block*, split it into
sub-blocks of 16 (Q3_K, Q6_K) or 32 channels and store, per sub-block, a small integer *sub-scale*, and per
super-block one float16 number ``d`` that the sub-scales multiply: a weight is ``d * sub_scale * code``. A
per-group integer weight whose group scales are, in every super-block, integer multiples ``1..sub_scale_max`` of
one float16 number is therefore a K-quant block exactly; ``scale_type=gguf_k`` makes the scales so (the
restriction is :class:`quark_brevitas.brevitas_adapter.kquant.KQuantScaleRestrict`) and
:mod:`quark_brevitas.export.gguf_kquants` packs them.

The symmetric K-quants are written: ``Q6_K`` (int6 codes -32..31, int8 sub-scales) and ``Q3_K`` (int3 codes
-4..3, 6-bit signed sub-scales, used 1..31). The asymmetric ones (Q2_K, Q4_K, Q5_K: ``d * sc * q - dmin * m``)
subtract a second per-sub-block term that Brevitas's ``(q - zero_point) * scale`` cannot reproduce bit for bit
with a non-integer zero point, so they have no grid here yet.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KQUANT_BY_BITS", "KQUANT_SUPER_BLOCK", "KQUANT_TYPES", "KQuantType"]

#: Input channels per K-quant super-block (llama.cpp's ``QK_K``).
KQUANT_SUPER_BLOCK = 256


@dataclass(frozen=True)
class KQuantType:
    """One symmetric K-quant type: GGUF name, code bits, channels per sub-block and the largest sub-scale used."""

    name: str
    bit_width: int
    group_size: int
    sub_scale_max: int

    @property
    def groups_per_super_block(self) -> int:
        return KQUANT_SUPER_BLOCK // self.group_size


#: The symmetric K-quant types a ``scale_type=gguf_k`` weight can be.
KQUANT_TYPES: dict[str, KQuantType] = {
    "Q6_K": KQuantType("Q6_K", 6, 16, 127),  # int8 sub-scales (positive ones used)
    "Q3_K": KQuantType("Q3_K", 3, 16, 31),  # 6-bit signed sub-scales stored + 32 (positive ones used)
}
#: bit width -> the K-quant type of a symmetric ``gguf_k`` weight with that many bits.
KQUANT_BY_BITS: dict[int, KQuantType] = {t.bit_width: t for t in KQUANT_TYPES.values()}
