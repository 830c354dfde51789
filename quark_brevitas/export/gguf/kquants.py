"""GGUF's K-quants Q2_K .. Q6_K, packed from our integer codes when the scales can be written exactly.

A K-quant super-block holds 256 consecutive input channels of one row: per sub-block of 16 channels one small
integer sub-scale ``s``, per super-block one float16 ``d``; a weight is ``d * s * q``.

- ``Q6_K`` (llama.cpp's ``block_q6_K``): int6 codes ``q`` in -32..31 (stored ``q + 32``), int8 sub-scales;
- ``Q3_K`` (``block_q3_K``): int3 codes in -4..3 (stored ``q + 4``: two low bits, one high bit in a mask),
  6-bit signed sub-scales (stored ``s + 32``, twelve bytes for sixteen).

So an int6 / int3 symmetric weight per group of 16 is exact in the K-quant when, in every super-block, the 16
group scales are integer multiples of one float16 number within the sub-scale's range. ``scale_type=gguf_k`` (the
presets ``gguf_q2_k`` .. ``gguf_q6_k``) makes them so; power-of-two scales (``scale_type=pof2``) usually are too.
Q2_K, Q4_K and Q5_K (``d * s * q - dmin * m``) hold the asymmetric K grids (unsigned codes, a sub-minimum per
sub-block: :mod:`quark_brevitas.brevitas_adapter.kquant_minimum`), and symmetric codes with
``dmin = 2 ** (bits - 1) * d`` and ``m = s`` (:mod:`quark_brevitas.config.kquants`).
This module finds, per super-block, the largest such float16 ``d`` (the scales over each candidate sub-scale of
the largest one) and refuses a super-block that has none.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from quark_brevitas.brevitas_adapter import offset_of
from quark_brevitas.config.kquants import KQUANT_SUPER_BLOCK, KQUANT_TYPES
from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.intweights import IntegerWeight

__all__ = ["KQUANT_FALLBACK", "KQUANT_PACKERS", "Q6_K_GROUP", "Q6_K_SUPER_BLOCK", "kquant_fallback", "kquant_scales",
           "pack_q2_k", "pack_q3_k", "pack_q4_k", "pack_q5_k", "pack_q6_k"]

#: Input channels per Q6_K super-block and per sub-block (one int8 scale each).
Q6_K_SUPER_BLOCK = KQUANT_SUPER_BLOCK
Q6_K_GROUP = KQUANT_TYPES["Q6_K"].group_size


def kquant_scales(name: str, scales: np.ndarray, qtype: str, per_row: int, minimums: bool = False,
                  top_sub: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``d`` (float16, one per super-block) and ``s`` (int, one per sub-block, ``1..sub_scale_max``) with
    ``d * s == scales`` exactly; ``scales`` is ``[super-blocks, sub-blocks]`` (``per_row``: super-blocks per row,
    for the message). The candidates ``d = max(scales) / k`` are tried for ``k = 1, 2, ...``: the first that is a
    float16 number dividing every scale of the super-block into an integer in range is the largest ``d``.
    ``minimums``: the sub-minimums (``0..top_sub``; a super-block of zeros gets ``d = 0``)."""
    top_sub = KQUANT_TYPES[qtype].sub_scale_max if top_sub is None else top_sub
    lowest = 0 if minimums else 1
    what = "sub-minimums" if minimums else "16 scales"
    values = scales.astype(np.float64)
    top = values.max(axis=1)
    d = np.zeros(len(values))
    sub = np.zeros(values.shape, dtype=np.int64)
    found = (top == 0) & (lowest == 0) & (values == 0).all(axis=1)
    if (values >= lowest * np.finfo(np.float64).tiny).all():
        for k in range(1, top_sub + 1):
            todo = ~found
            if not todo.any():
                break
            candidate = top[todo] / k
            ratio = values[todo] / candidate[:, None]
            rounded = np.round(ratio)
            ok = ((candidate.astype(np.float16).astype(np.float64) == candidate)
                  & (ratio == rounded).all(axis=1) & (rounded <= top_sub).all(axis=1)
                  & ((candidate[:, None] * rounded).astype(np.float32) == scales[todo]).all(axis=1))
            index = np.flatnonzero(todo)[ok]
            d[index], sub[index], found[index] = candidate[ok], rounded[ok], True
    if not found.all():
        row, start = divmod(int(np.flatnonzero(~found)[0]), per_row)
        raise ExportError(f"layer '{name}': the {what} of row {row}, input channels {start * KQUANT_SUPER_BLOCK}.."
                          f"{(start + 1) * KQUANT_SUPER_BLOCK - 1} are not integer multiples (at most {top_sub}) of "
                          f"one float16 number, so {qtype} cannot store them exactly; quantize with "
                          f"scale_type=gguf_k (presets gguf_q6_k, gguf_q3_k) or scale_type=pof2")
    return d.astype(np.float16), sub


def _codes_and_scales(name: str, entry: IntegerWeight, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The codes as ``int32 [super-blocks, 256]`` and the super-blocks' ``d`` and sub-scales."""
    rows, cols = entry.int_weight.shape
    codes = entry.int_weight.to(torch.int32).numpy().reshape(-1, KQUANT_SUPER_BLOCK)
    groups = KQUANT_SUPER_BLOCK // KQUANT_TYPES[qtype].group_size
    scales = entry.scale.detach().float().numpy().reshape(-1, groups)
    d, sub = kquant_scales(name, scales, qtype, cols // KQUANT_SUPER_BLOCK)
    return codes, d, sub


def pack_q6_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """The Q6_K blocks of an int6 symmetric weight per group of 16 as ``uint8 [rows, bytes per row]``: per
    super-block 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, the float16 ``d``
    (llama.cpp's layout: element ``32 * c + l`` of chunk ``c = 4 * h + r`` has its low nibble in byte
    ``64 * h + 32 * (r % 2) + l`` (high half when ``r >= 2``) and its high bits at ``2 * r`` of byte ``32 * h + l``)."""
    rows = entry.int_weight.shape[0]
    codes, d, sub = _codes_and_scales(name, entry, "Q6_K")
    codes = (codes + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, h, r, l]
    low, high = codes & np.uint8(0x0F), codes >> np.uint8(4)
    ql = (low[:, :, 0:2, :] | (low[:, :, 2:4, :] << np.uint8(4))).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << np.uint8(2)) | (high[:, :, 2] << np.uint8(4))
          | (high[:, :, 3] << np.uint8(6))).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sub.astype(np.int8).view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def pack_q3_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """The Q3_K blocks of an int3 symmetric weight per group of 16 as ``uint8 [rows, bytes per row]``: per
    super-block a 32-byte high-bit mask, 64 bytes of 2-bit low parts, 12 bytes of 6-bit sub-scales, the float16
    ``d`` (llama.cpp's layout: element ``128 * h + 32 * j + l`` has its low bits at ``2 * j`` of byte
    ``32 * h + l`` and its high bit at bit ``4 * h + j`` of mask byte ``l``; sub-scale ``i`` (stored ``s + 32``)
    has its low nibble in byte ``i % 8`` (high half when ``i >= 8``) and its top two bits at ``2 * (i // 4)`` of
    byte ``8 + i % 4``)."""
    rows = entry.int_weight.shape[0]
    codes, d, sub = _codes_and_scales(name, entry, "Q3_K")
    stored = (codes + 4).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, h, j, l]
    low, high = stored & np.uint8(3), stored >> np.uint8(2)
    qs = (low[:, :, 0] | (low[:, :, 1] << np.uint8(2)) | (low[:, :, 2] << np.uint8(4))
          | (low[:, :, 3] << np.uint8(6))).reshape(-1, 64)
    bits = high.reshape(-1, 8, 32)  # bit index 4 * h + j
    hmask = np.zeros((bits.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= bits[:, bit] << np.uint8(bit)
    scales6 = (sub + 32).astype(np.uint8)  # [n, 16]
    nibbles = scales6 & np.uint8(0x0F)
    low_bytes = nibbles[:, :8] | (nibbles[:, 8:] << np.uint8(4))
    top = (scales6 >> np.uint8(4)).reshape(-1, 4, 4)  # [n, i // 4, i % 4]
    high_bytes = (top[:, 0] | (top[:, 1] << np.uint8(2)) | (top[:, 2] << np.uint8(4)) | (top[:, 3] << np.uint8(6)))
    blocks = np.concatenate([hmask, qs, low_bytes, high_bytes, d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


#: K-quant -> the 32-channel type its fallback grid is written as (rows that are no whole super-blocks): one that
#: holds its codes (Q4_0: -8..7, Q8_0: -127..127) with one float16 scale per 32 channels.
KQUANT_FALLBACK = {"Q6_K": "Q8_0", "Q5_K": "Q8_0", "Q4_K": "Q4_0", "Q3_K": "Q4_0", "Q2_K": "Q4_0"}


def kquant_fallback(name: str, entry: IntegerWeight, qtype: str) -> tuple[IntegerWeight, str]:
    """A ``gguf_k`` weight whose rows are no whole super-blocks as the 32-channel type that holds it exactly
    (Q6_K's / Q5_K's codes as Q8_0, the others' as Q4_0): the grid gave the groups of each 32 channels one
    float16 scale (:func:`~quark_brevitas.brevitas_adapter.kquant.snap_kquant_scales`), which becomes the scale of the
    group of 32. llama.cpp's own quantizer falls back to Q8_0 and IQ4_NL there (``llama_tensor_get_type``), and to
    F16 when the rows are no multiple of 32 either; those are written here as ``"F32"`` (the quantized weight
    itself: ``d * q`` has more significant bits than float16 holds)."""
    cols = entry.int_weight.shape[1]
    scale = entry.scale.detach()
    if entry.offset_dequantization:  # the quantizer refuses such rows; an entry built by hand may still have them
        raise ExportError(f"layer '{name}' has {cols} input channels, not a multiple of {KQUANT_SUPER_BLOCK}: its "
                          f"asymmetric {qtype} grid has no whole super-blocks")
    if cols % 32:
        return entry, "F32"
    per_32 = 32 // entry.group_size
    if any(not torch.equal(scale[:, 0::per_32], scale[:, k::per_32]) for k in range(1, per_32)):
        raise ExportError(f"layer '{name}' has {cols} input channels, not a multiple of {KQUANT_SUPER_BLOCK} (the "
                          f"{qtype} super-block), and its scales are not shared by each 32 channels, so no GGUF type "
                          f"holds it exactly; quantize it with scale_type=gguf_k (which gives such rows the "
                          f"{KQUANT_FALLBACK[qtype]} grid)")
    return replace(entry, scale=scale[:, 0::per_32].contiguous(), group_size=32), KQUANT_FALLBACK[qtype]


def _minimum_form(name: str, entry: IntegerWeight, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                         np.ndarray]:
    """A type with sub-minimums: unsigned codes ``q``, the super-blocks' ``d`` and ``dmin`` as float16 bytes
    ``[n, 4]``, the sub-scales and the sub-minimums. An asymmetric K grid (``entry.offset_dequantization``) has
    them: ``zero_point * scale`` is ``dmin * m`` (:func:`~quark_brevitas.brevitas_adapter.offset_of`). A symmetric
    weight gets ``q = code + 2 ** (bits - 1)``, ``dmin = 2 ** (bits - 1) * d`` and ``m = s``:
    ``d * s * q - dmin * s == d * s * code`` exactly."""
    kquant = KQUANT_TYPES[qtype]
    codes, d, sub = _codes_and_scales(name, entry, qtype)
    if entry.offset_dequantization:
        offsets = offset_of(entry.zero_point.float(), entry.scale.float()).numpy()
        per_row = entry.int_weight.shape[1] // KQUANT_SUPER_BLOCK
        dmin, minimums = kquant_scales(name, offsets.reshape(sub.shape), qtype, per_row, True,
                                       kquant.minimum_max)
        halves = np.stack([d, dmin], axis=1).view(np.uint8)
        return codes.astype(np.uint8), halves, sub.astype(np.uint8), minimums.astype(np.uint8)
    half = 2 ** (kquant.bit_width - 1)
    dmin = (d.astype(np.float32) * half).astype(np.float16)
    if not np.array_equal(dmin.astype(np.float32), d.astype(np.float32) * half):  # only at float16's top end
        raise ExportError(f"layer '{name}': a super-block scale {float(d.max())} times {half} overflows float16, "
                          f"so {qtype} cannot store its minimum")
    halves = np.stack([d, dmin], axis=1).view(np.uint8)
    return (codes + half).astype(np.uint8), halves, sub.astype(np.uint8), sub.astype(np.uint8)


def pack_q2_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """Q2_K blocks (``block_q2_K``: 16 bytes of 4-bit sub-scale | sub-minimum << 4, 64 bytes of 2-bit codes,
    float16 ``d`` and ``dmin``; element ``128 * h + 32 * j + l`` at bits ``2 * j`` of byte ``32 * h + l``)."""
    rows = entry.int_weight.shape[0]
    q, halves, sub, minimums = _minimum_form(name, entry, "Q2_K")
    q = q.reshape(-1, 2, 4, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << np.uint8(2)) | (q[:, :, 2] << np.uint8(4))
          | (q[:, :, 3] << np.uint8(6))).reshape(-1, 64)
    scales = sub | (minimums << np.uint8(4))
    return np.concatenate([scales, qs, halves], axis=1).reshape(rows, -1)


def _scale_min_bytes(sub: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit sub-scales and eight 6-bit sub-minimums: bytes 0..3 / 4..7 hold
    scales / minimums 0..3 and the top two bits of 4..7; bytes 8..11 the low nibbles of 4..7 (scale low, minimum
    high)."""
    def first(values: np.ndarray) -> np.ndarray:
        return values[:, :4] | ((values[:, 4:] >> np.uint8(4)) << np.uint8(6))

    last = (sub[:, 4:] & np.uint8(0x0F)) | ((minimums[:, 4:] & np.uint8(0x0F)) << np.uint8(4))
    return np.concatenate([first(sub), first(minimums), last], axis=1)


def pack_q4_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """Q4_K blocks (``block_q4_K``: float16 ``d``, ``dmin``, 12 bytes of sub-scales / sub-minimums, 128 bytes of
    4-bit codes; element ``64 * h + 32 * k + l`` in nibble ``k`` of byte ``32 * h + l``)."""
    rows = entry.int_weight.shape[0]
    q, halves, sub, minimums = _minimum_form(name, entry, "Q4_K")
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(-1, 128)
    return np.concatenate([halves, _scale_min_bytes(sub, minimums), qs], axis=1).reshape(rows, -1)


def pack_q5_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """Q5_K blocks (``block_q5_K``: Q4_K's layout of the low four bits, after 32 bytes whose bit ``b`` of byte
    ``l`` is the fifth bit of element ``32 * b + l``)."""
    rows = entry.int_weight.shape[0]
    q, halves, sub, minimums = _minimum_form(name, entry, "Q5_K")
    low = (q & np.uint8(0x0F)).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << np.uint8(4))).reshape(-1, 128)
    top = (q >> np.uint8(4)).reshape(-1, 8, 32)
    qh = np.zeros((top.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        qh |= top[:, bit] << np.uint8(bit)
    return np.concatenate([halves, _scale_min_bytes(sub, minimums), qh, qs], axis=1).reshape(rows, -1)


#: K-quant type -> its packer.
KQUANT_PACKERS = {"Q2_K": pack_q2_k, "Q3_K": pack_q3_k, "Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}
