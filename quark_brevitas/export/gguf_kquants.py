"""GGUF's K-quant Q6_K, packed from our integer codes when the model's scales can be written exactly.

Q6_K (llama.cpp's ``block_q6_K``) holds 256 consecutive input channels of one row per super-block: 6-bit codes
(stored ``q + 32``), one signed 8-bit scale ``s`` per sub-block of 16 channels and one float16 ``d`` per
super-block; a weight is ``d * s * q``. So an int6 symmetric weight per group of 16 is exact in Q6_K when, in
every super-block, the 16 group scales are integer multiples ``s <= 127`` of one float16 number ``d``. This
module finds the largest such ``d`` (the scales' greatest common divisor: each float32 scale is an integer times a
power of two) and refuses a super-block that has none. Power-of-two scales (``scale_type=pof2``) always have one
when the scales of 256 consecutive channels lie within a factor 64 of each other (measured on Llama layers: within
a factor 8). Float16 scales with all 11 significant bits (the ``gguf_*`` presets) usually do not.

Q4_K (asymmetric 4-bit, a 6-bit scale and a 6-bit offset per sub-block of 32, two float16 super-block numbers) would
need every ``scale * zero_point`` of a super-block to be a multiple ``m <= 63`` of one float16 number as well as
the scales: with zero points up to 15, only scales within a factor 4 of each other qualify, so it is not written.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.intweights import IntegerWeight

__all__ = ["Q6_K_GROUP", "Q6_K_SUPER_BLOCK", "pack_q6_k"]

#: Input channels per Q6_K super-block and per sub-block (one int8 scale each).
Q6_K_SUPER_BLOCK = 256
Q6_K_GROUP = 16
_MAX_SUB_SCALE = 127


def _common_factor(scales: np.ndarray) -> tuple[float, np.ndarray] | None:
    """``(d, s)`` with ``scales == d * s`` exactly, ``s`` integers (the largest ``d``: the scales' greatest common
    divisor), or ``None`` when the scales are not positive float32 numbers of one binade range under 2**40."""
    if (scales <= 0).any():
        return None
    mantissa, exponent = np.frexp(scales.astype(np.float64))
    integers = (mantissa * 2.0 ** 24).astype(np.int64)  # exact: a float32 has 24 significant bits
    exponent = exponent.astype(np.int64) - 24
    shift = exponent - exponent.min()
    if shift.max() > 38:
        return None
    values = [int(v) << int(k) for v, k in zip(integers.tolist(), shift.tolist(), strict=True)]
    divisor = math.gcd(*values)
    d = math.ldexp(divisor, int(exponent.min()))
    return d, np.array([v // divisor for v in values], dtype=np.int64)


def _super_block_scales(name: str, scales: np.ndarray, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """``d`` (float16, one per super-block) and ``s`` (int8, one per sub-block) with ``d * s == scales``
    (``per_row``: super-blocks per row, for the message)."""
    d = np.empty(scales.shape[0], dtype=np.float16)
    s = np.empty(scales.shape, dtype=np.int8)
    for index, row in enumerate(scales):
        found = _common_factor(row)
        if found is not None and np.float16(found[0]) == found[0] and found[1].max() <= _MAX_SUB_SCALE:
            d[index], s[index] = found[0], found[1]
            continue
        row, start = divmod(index, per_row)
        raise ExportError(f"layer '{name}': the 16 scales of row {row}, input channels {start * Q6_K_SUPER_BLOCK}.."
                          f"{(start + 1) * Q6_K_SUPER_BLOCK - 1} are not integer multiples (at most {_MAX_SUB_SCALE}) "
                          "of one float16 number, so Q6_K cannot store them exactly; quantize with scale_type=pof2 "
                          "(power-of-two scales of int6 weights per group of 16)")
    return d, s


def pack_q6_k(name: str, entry: IntegerWeight) -> np.ndarray:
    """The Q6_K blocks of an int6 symmetric weight per group of 16 as ``uint8 [rows, bytes per row]``: per
    super-block 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, the float16 ``d``
    (llama.cpp's layout: element ``32 * c + l`` of chunk ``c = 4 * h + r`` has its low nibble in byte
    ``64 * h + 32 * (r % 2) + l`` (high half when ``r >= 2``) and its high bits at ``2 * r`` of byte ``32 * h + l``)."""
    rows, cols = entry.int_weight.shape
    codes = (entry.int_weight.to(torch.int32) + 32).to(torch.uint8).numpy().reshape(-1, 2, 4, 32)  # [n, h, r, l]
    scales = entry.scale.detach().float().numpy().reshape(-1, Q6_K_SUPER_BLOCK // Q6_K_GROUP)
    d, s = _super_block_scales(name, scales, cols // Q6_K_SUPER_BLOCK)
    low, high = codes & np.uint8(0x0F), codes >> np.uint8(4)
    ql = (low[:, :, 0:2, :] | (low[:, :, 2:4, :] << np.uint8(4))).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << np.uint8(2)) | (high[:, :, 2] << np.uint8(4))
          | (high[:, :, 3] << np.uint8(6))).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, s.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)
