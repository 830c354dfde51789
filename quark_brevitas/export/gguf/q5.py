"""GGUF's 5-bit block types ``Q5_0`` and ``Q5_1``, packed from our integer codes.

Why here: llama.cpp's quantizer writes them in place of ``Q4_K`` / ``Q5_K`` for tensors whose rows are no whole
K-quant super-block (all-MiniLM-L6-v2's 384-wide layers: ``Q4_K_M`` gives them ``Q5_0``, ``Q3_K_M``'s ``Q5_K`` value
layers become ``Q5_1``), so a mix preset that reproduces llama.cpp's per-tensor types needs them. Both hold one block
of 32 input channels per float16 scale ``d``:

- ``Q5_0`` (``block_q5_0``): int5 symmetric codes -16..15, stored ``q = code + 16``: weight ``d * (q - 16)``;
- ``Q5_1`` (``block_q5_1``): uint5 asymmetric codes 0..31 and a float16 offset ``m``: weight ``d * q + m``
  (``m = -zero_point * d``, a float16 number when the scale keeps ``11 - 5`` significant bits, which
  ``scale_type=float16`` gives an asymmetric 5-bit spec).

Layout (both): after the float16 field(s), four bytes ``qh`` whose bit ``j`` (little-endian ``uint32``) is the
fifth bit of element ``j``, then 16 bytes of low nibbles, element ``j`` in the low and ``j + 16`` in the high half.
"""

from __future__ import annotations

import numpy as np
import torch

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.intweights import IntegerWeight

__all__ = ["Q5_PACKERS", "pack_q5_0", "pack_q5_1"]

_BLOCK = 32


def _half(name: str, what: str, values: torch.Tensor) -> np.ndarray:
    half = values.to(torch.float16)
    if not torch.equal(half.to(values.dtype), values):
        raise ExportError(f"layer '{name}': its {what} are not float16 numbers, so GGUF cannot store them exactly; "
                          "quantize with scale_type=float16")
    return half.numpy().view(np.uint8)


def _five_bit_body(stored: np.ndarray) -> np.ndarray:
    """``qh`` (4 bytes) and ``qs`` (16 bytes) of blocks of unsigned 5-bit values ``[n, 32]``."""
    high = (stored >> np.uint8(4)).astype(np.uint32)
    qh = (high << np.arange(_BLOCK, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    low = stored & np.uint8(0x0F)
    qs = low[:, :16] | (low[:, 16:] << np.uint8(4))
    return np.concatenate([qh.astype("<u4").reshape(-1, 1).view(np.uint8), qs], axis=1)


def pack_q5_0(name: str, entry: IntegerWeight) -> np.ndarray:
    """The Q5_0 blocks of an int5 symmetric weight per group of 32 as ``uint8 [rows, bytes per row]``."""
    rows = entry.int_weight.shape[0]
    scale = entry.scale.detach().float().reshape(-1, 1)
    codes = entry.int_weight.to(torch.int32).reshape(-1, _BLOCK).numpy()
    stored = (codes + 16).astype(np.uint8)
    return np.concatenate([_half(name, "scales", scale), _five_bit_body(stored)], axis=1).reshape(rows, -1)


def pack_q5_1(name: str, entry: IntegerWeight) -> np.ndarray:
    """The Q5_1 blocks of a uint5 asymmetric weight per group of 32 as ``uint8 [rows, bytes per row]``."""
    rows = entry.int_weight.shape[0]
    scale = entry.scale.detach().float().reshape(-1, 1)
    offset = -entry.zero_point.float().reshape(-1, 1) * scale
    stored = entry.int_weight.to(torch.int32).reshape(-1, _BLOCK).numpy().astype(np.uint8)
    halves = [_half(name, "scales", scale), _half(name, "offsets (-zero_point * scale)", offset)]
    return np.concatenate([*halves, _five_bit_body(stored)], axis=1).reshape(rows, -1)


#: GGUF type -> packer.
Q5_PACKERS = {"Q5_0": pack_q5_0, "Q5_1": pack_q5_1}
