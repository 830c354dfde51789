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
``d * s * q - dmin * m`` (sub-minimums ``m`` of the same width as ``s``). Brevitas's ``(q - zero_point) * scale``
reproduces that bit for bit only when ``dmin * m / (d * s)`` is an integer, so they are written here with the
symmetric code range: ``dmin = 2 ** (bits - 1) * d`` and ``m = s`` make ``d * s * q - dmin * m`` equal
``d * s * (q - 2 ** (bits - 1))``, a signed code on the sub-block's scale (llama.cpp's quantizer fits a minimum
per sub-block instead; GPTQ on the symmetric grid is what this exporter offers in its place).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KQUANT_BY_BITS", "KQUANT_SUPER_BLOCK", "KQUANT_TYPES", "KQuantType"]

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
