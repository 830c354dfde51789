"""GGUF's symmetric K-quants Q6_K and Q3_K, packed from our integer codes when the scales can be written exactly.

A K-quant super-block holds 256 consecutive input channels of one row: per sub-block of 16 channels one small
integer sub-scale ``s``, per super-block one float16 ``d``; a weight is ``d * s * q``.

- ``Q6_K`` (llama.cpp's ``block_q6_K``): int6 codes ``q`` in -32..31 (stored ``q + 32``), int8 sub-scales;
- ``Q3_K`` (``block_q3_K``): int3 codes in -4..3 (stored ``q + 4``: two low bits, one high bit in a mask),
  6-bit signed sub-scales (stored ``s + 32``, twelve bytes for sixteen).

So an int6 / int3 symmetric weight per group of 16 is exact in the K-quant when, in every super-block, the 16
group scales are integer multiples of one float16 number within the sub-scale's range. ``scale_type=gguf_k`` (the
presets ``gguf_q6_k`` / ``gguf_q3_k``) makes them so; power-of-two scales (``scale_type=pof2``) usually are too.
This module finds, per super-block, the largest such float16 ``d`` (the scales over each candidate sub-scale of
the largest one) and refuses a super-block that has none.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from quark_brevitas.config.kquants import KQUANT_SUPER_BLOCK, KQUANT_TYPES
from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.intweights import IntegerWeight

__all__ = ["KQUANT_FALLBACK", "Q6_K_GROUP", "Q6_K_SUPER_BLOCK", "kquant_fallback", "kquant_scales", "pack_q3_k",
           "pack_q6_k"]

#: Input channels per Q6_K super-block and per sub-block (one int8 scale each).
Q6_K_SUPER_BLOCK = KQUANT_SUPER_BLOCK
Q6_K_GROUP = KQUANT_TYPES["Q6_K"].group_size


def kquant_scales(name: str, scales: np.ndarray, qtype: str, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """``d`` (float16, one per super-block) and ``s`` (int, one per sub-block, ``1..sub_scale_max``) with
    ``d * s == scales`` exactly; ``scales`` is ``[super-blocks, sub-blocks]`` (``per_row``: super-blocks per row,
    for the message). The candidates ``d = max(scales) / k`` are tried for ``k = 1, 2, ...``: the first that is a
    float16 number dividing every scale of the super-block into an integer in range is the largest ``d``."""
    top_sub = KQUANT_TYPES[qtype].sub_scale_max
    values = scales.astype(np.float64)
    top = values.max(axis=1)
    d = np.zeros(len(values))
    sub = np.zeros(values.shape, dtype=np.int64)
    found = np.zeros(len(values), dtype=bool)
    if (values > 0).all():
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
        raise ExportError(f"layer '{name}': the 16 scales of row {row}, input channels {start * KQUANT_SUPER_BLOCK}.."
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


#: K-quant -> the 32-channel type its fallback grid is written as (rows that are no whole super-blocks).
KQUANT_FALLBACK = {"Q6_K": "Q8_0", "Q3_K": "Q4_0"}


def kquant_fallback(name: str, entry: IntegerWeight, qtype: str) -> tuple[IntegerWeight, str]:
    """A ``gguf_k`` weight whose rows are no whole super-blocks as the 32-channel type that holds it exactly
    (Q6_K's int6 codes as Q8_0, Q3_K's int3 codes as Q4_0): the grid gave each pair of groups of 16 one float16
    scale (:func:`~quark_brevitas.brevitas_adapter.kquant.snap_kquant_scales`), which becomes the scale of the
    group of 32. llama.cpp's own quantizer falls back to Q8_0 and IQ4_NL there (``llama_tensor_get_type``), and to
    F16 when the rows are no multiple of 32 either; those are written here as ``"F32"`` (the quantized weight
    itself: ``d * q`` has more significant bits than float16 holds)."""
    cols = entry.int_weight.shape[1]
    scale = entry.scale.detach()
    if cols % 32:
        return entry, "F32"
    if not torch.equal(scale[:, 0::2], scale[:, 1::2]):
        raise ExportError(f"layer '{name}' has {cols} input channels, not a multiple of {KQUANT_SUPER_BLOCK} (the "
                          f"{qtype} super-block), and its scales are not shared by each 32 channels, so no GGUF type "
                          f"holds it exactly; quantize it with scale_type=gguf_k (which gives such rows the "
                          f"{KQUANT_FALLBACK[qtype]} grid)")
    return replace(entry, scale=scale[:, 0::2].contiguous(), group_size=32), KQUANT_FALLBACK[qtype]
