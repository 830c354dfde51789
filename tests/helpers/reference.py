"""An independent quantize/dequantize reference, written from the definitions in plain torch.

Nothing here imports Brevitas or quark_brevitas: the tests compare what the library produces
(through Brevitas) against these functions. All arithmetic is done in the dtype of the input
(float32 in the tests) with the same elementary operations a straightforward implementation uses
(``x / scale``, round, clamp, ``* scale``), so results on the grid agree bit for bit.

Integers
    ``q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax)``, dequantized ``(q - zp) * scale``.
    Signed range ``[-2^(b-1) (+1 if narrow), 2^(b-1) - 1]``, unsigned ``[0, 2^b - 1]``.

Scales from statistics
    - symmetric: ``scale = max|x| / (2^(b-1) - 1)`` (per tensor or per output channel);
    - asymmetric (unsigned, zero point): ``lo = min(min(x), 0)``, ``hi = max(max(x), 0)``,
      ``scale = (hi - lo) / (2^b - 1)``, ``zero_point = clamp(round(-lo / scale), 0, 2^b - 1)``;
    - power of two: ``2^ceil(log2(float_scale))``.

OCP-style minifloats (sign, e exponent bits, m mantissa bits)
    ``bias = 2^(e-1) - 1``; a code (E, M) is ``2^(E - bias) * (1 + M / 2^m)`` for E > 0 and
    ``2^(1 - bias) * M / 2^m`` for E = 0 (subnormals). The largest finite value follows OCP: e4m3 448
    (the all-ones mantissa at the top exponent is NaN), e5m2 57344 (the top exponent is inf/NaN);
    every other format has no inf/NaN and its largest value is the all-ones code. Quantization rounds
    to the nearest grid value (ties to the even code) and saturates at the largest finite value.
"""

from __future__ import annotations

import math

import torch

# ----------------------------------------------------------------------------------------- integers


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties to the even one (written out, not ``torch.round``)."""
    floor = torch.floor(x)
    frac = x - floor
    up = floor + 1
    is_even_floor = torch.remainder(floor, 2) == 0
    tie = torch.where(is_even_floor, floor, up)
    return torch.where(frac < 0.5, floor, torch.where(frac > 0.5, up, tie))


def int_range(bit_width: int, signed: bool, narrow_range: bool) -> tuple[int, int]:
    """(qmin, qmax) of a ``bit_width``-bit integer."""
    if signed:
        qmin = -(2 ** (bit_width - 1)) + (1 if narrow_range else 0)
        return qmin, 2 ** (bit_width - 1) - 1
    return (1 if narrow_range else 0), 2**bit_width - 1


def int_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | float, bit_width: int,
              signed: bool, narrow_range: bool) -> torch.Tensor:
    """The integer codes q = clamp(round_half_even(x / scale) + zp, qmin, qmax)."""
    qmin, qmax = int_range(bit_width, signed, narrow_range)
    return torch.clamp(round_half_even(x / scale) + zero_point, qmin, qmax)


def int_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | float, bit_width: int,
            signed: bool, narrow_range: bool) -> torch.Tensor:
    """Quantize then dequantize: (q - zp) * scale."""
    q = int_quant(x, scale, zero_point, bit_width, signed, narrow_range)
    return (q - zero_point) * scale


def _reduce(x: torch.Tensor, per_channel: bool, op: str) -> torch.Tensor:
    """max/min over the whole tensor (0-dim result) or over all but dim 0 (shape [C, 1, ...])."""
    if not per_channel:
        return getattr(x, op)()
    flat = x.reshape(x.shape[0], -1)
    out = flat.amax(dim=1) if op == "max" else flat.amin(dim=1)
    return out.reshape(x.shape[0], *([1] * (x.dim() - 1)))


def absmax(x: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    return _reduce(x.abs(), per_channel, "max")


def pof2(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or above ``scale``: 2^ceil(log2(scale))."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def symmetric_scale(x: torch.Tensor, bit_width: int, per_channel: bool = False) -> torch.Tensor:
    """max|x| / (2^(b-1) - 1): the largest magnitude lands exactly on the largest signed code."""
    return absmax(x, per_channel) / (2 ** (bit_width - 1) - 1)


def asymmetric_scale_zero_point(x: torch.Tensor, bit_width: int, per_channel: bool = False,
                                power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned b-bit scale (hi - lo) / (2^b - 1) and zero point round(-lo / scale), range widened to 0."""
    lo = torch.clamp(_reduce(x, per_channel, "min"), max=0.0)
    hi = torch.clamp(_reduce(x, per_channel, "max"), min=0.0)
    scale = (hi - lo) / (2**bit_width - 1)
    if power_of_two:
        scale = pof2(scale)
    zero_point = torch.clamp(round_half_even(-lo / scale), 0, 2**bit_width - 1)
    return scale, zero_point


def kth_smallest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest element (1-indexed) of a flattened tensor, by sorting."""
    return torch.sort(x.reshape(-1)).values[k - 1]


def high_percentile_rank(q: float, n: int) -> int:
    """1-indexed rank of an upper percentile: q/100 * n rounded to the nearest rank (halves up).

    For n < 100 / (2 * (100 - q)) this is n, i.e. the maximum (n < 50000 for q = 99.999).
    """
    return max(1, min(n, int(math.floor(q / 100 * n + 0.5))))


def low_percentile_rank(q: float, n: int) -> int:
    """1-indexed rank of a lower percentile: q/100 * n rounded up (the minimum for small n)."""
    return max(1, min(n, int(math.ceil(q / 100 * n))))


# ----------------------------------------------------------------------------------------- minifloats

_OCP_SPECIAL_MAX = {(4, 3): 448.0, (5, 2): 57344.0}


def exponent_bias(exponent_bits: int) -> int:
    return 2 ** (exponent_bits - 1) - 1


def float_code_value(exponent: int, mantissa: int, exponent_bits: int, mantissa_bits: int) -> float:
    """The value of the positive code (E, M), from the definition (E = 0: subnormal)."""
    bias = exponent_bias(exponent_bits)
    frac = mantissa / 2**mantissa_bits
    if exponent == 0:
        return 2.0 ** (1 - bias) * frac
    return 2.0 ** (exponent - bias) * (1 + frac)


def float_max_finite(exponent_bits: int, mantissa_bits: int) -> float:
    """Largest finite magnitude: OCP e4m3 448, e5m2 57344, otherwise the all-ones code."""
    if (exponent_bits, mantissa_bits) in _OCP_SPECIAL_MAX:
        return _OCP_SPECIAL_MAX[(exponent_bits, mantissa_bits)]
    return float_code_value(2**exponent_bits - 1, 2**mantissa_bits - 1, exponent_bits, mantissa_bits)


def float_grid(exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """All finite non-negative values, ascending, in code order (index parity = mantissa LSB parity)."""
    max_finite = float_max_finite(exponent_bits, mantissa_bits)
    values = []
    for exponent in range(2**exponent_bits):
        for mantissa in range(2**mantissa_bits):
            value = float_code_value(exponent, mantissa, exponent_bits, mantissa_bits)
            if value <= max_finite:
                values.append(value)
    grid = torch.tensor(values, dtype=torch.float64)
    assert torch.all(grid[1:] > grid[:-1]), "codes must be strictly increasing"
    return grid


def float_round(y: torch.Tensor, exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """Round (already scaled) values to the minifloat grid: nearest, ties to even code, saturating."""
    grid = float_grid(exponent_bits, mantissa_bits)
    # The grid values are exact in float32 for every format of at most 8 bits.
    grid32 = grid.to(y.dtype)
    mag = y.abs().reshape(-1).to(torch.float64)
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo = (mag - grid[lo]).abs()
    d_hi = (grid[hi] - mag).abs()
    even_hi = torch.remainder(hi, 2) == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    index = torch.where(pick_hi, hi, lo)
    # Saturation: beyond the largest finite value everything maps to it.
    index = torch.where(mag >= grid[-1], torch.full_like(index, len(grid) - 1), index)
    out = grid32[index].reshape(y.shape)
    return torch.copysign(out, y)


def float_qdq(x: torch.Tensor, scale: torch.Tensor, exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """Scale, round to the minifloat grid (saturating), scale back."""
    return float_round(x / scale, exponent_bits, mantissa_bits) * scale


def float_symmetric_scale(x: torch.Tensor, exponent_bits: int, mantissa_bits: int,
                          per_channel: bool = False) -> torch.Tensor:
    """max|x| / max_finite: the largest magnitude lands on the largest finite value."""
    return absmax(x, per_channel) / float_max_finite(exponent_bits, mantissa_bits)


# ----------------------------------------------------------------------------------------- groups and MX
#
# Per-group quantization: ``group_size`` consecutive elements along the input-channel axis (axis 1 of a
# weight [out, in, *kernel]; the last axis of an activation) share one scale. A group that runs past the
# end of the axis is padded with zeros, which changes neither max|x| nor min(min(x), 0) / max(max(x), 0).
#
# OCP MX (Microscaling Formats Specification v1.0): a block of 32 elements shares the power-of-two scale
# X = 2^(floor(log2(max|block|)) - emax_elem), where emax_elem is the exponent of the element format's
# largest normal value (fp8 e4m3: 8, e5m2: 15, fp6 e3m2: 4, e2m3: 2, fp4 e2m1: 2; int8: 0, its elements
# being 8-bit two's complement with an implicit scale 2^-6, used here in the symmetric range +-127). Each
# element is x / X rounded to the element format (ties to even) and saturated at its largest magnitude.


def to_groups(x: torch.Tensor, group_size: int, axis: int = 1) -> torch.Tensor:
    """``x`` with ``axis`` moved last, zero padded to a multiple of ``group_size`` and split: [..., n, g]."""
    y = x.movedim(axis, -1)
    pad = (-y.shape[-1]) % group_size
    if pad:
        y = torch.cat([y, torch.zeros(*y.shape[:-1], pad, dtype=y.dtype)], dim=-1)
    return y.reshape(*y.shape[:-1], -1, group_size)


def from_groups(y: torch.Tensor, like: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Inverse of :func:`to_groups` (padding dropped)."""
    flat = y.reshape(*y.shape[:-2], -1)
    flat = flat[..., : like.shape[axis]]
    return flat.movedim(-1, axis)


def per_group(stat: torch.Tensor, like: torch.Tensor, group_size: int, axis: int = 1) -> torch.Tensor:
    """A per-group statistic of shape [..., n, 1] broadcast back to one value per element of ``like``."""
    return from_groups(stat.expand(*stat.shape[:-1], group_size), like, axis)


def group_absmax(x: torch.Tensor, group_size: int, axis: int = 1) -> torch.Tensor:
    return per_group(to_groups(x, group_size, axis).abs().amax(dim=-1, keepdim=True), x, group_size, axis)


def group_symmetric_scale(x: torch.Tensor, bit_width: int, group_size: int, axis: int = 1) -> torch.Tensor:
    """max|group| / (2^(b-1) - 1), one value per element."""
    return group_absmax(x, group_size, axis) / (2 ** (bit_width - 1) - 1)


def group_asymmetric_scale_zero_point(x: torch.Tensor, bit_width: int, group_size: int,
                                      axis: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned b-bit scale and zero point per group (range widened to include 0), one value per element."""
    groups = to_groups(x, group_size, axis)
    lo = torch.clamp(groups.amin(dim=-1, keepdim=True), max=0.0)
    hi = torch.clamp(groups.amax(dim=-1, keepdim=True), min=0.0)
    scale = (hi - lo) / (2**bit_width - 1)
    zero_point = torch.clamp(round_half_even(-lo / scale), 0, 2**bit_width - 1)
    return per_group(scale, x, group_size, axis), per_group(zero_point, x, group_size, axis)


def group_float_scale(x: torch.Tensor, exponent_bits: int, mantissa_bits: int, group_size: int,
                      axis: int = 1) -> torch.Tensor:
    """max|group| / max_finite, one value per element."""
    return group_absmax(x, group_size, axis) / float_max_finite(exponent_bits, mantissa_bits)


def mx_emax(exponent_bits: int | None, mantissa_bits: int | None) -> int:
    """Exponent of the element format's largest normal value; 0 for integer elements."""
    if exponent_bits is None:
        return 0
    return int(math.floor(math.log2(float_max_finite(exponent_bits, mantissa_bits))))


def mx_shared_scale(x: torch.Tensor, emax: int, group_size: int = 32, axis: int = 1) -> torch.Tensor:
    """X = 2^(floor(log2(max|block|)) - emax), clamped to the E8M0 range 2^-127..2^127, per element."""
    amax = to_groups(x, group_size, axis).abs().amax(dim=-1, keepdim=True)
    exponent = torch.clamp(torch.floor(torch.log2(amax)) - emax, -127, 127)
    return per_group(torch.exp2(exponent), x, group_size, axis)


def mx_int_qdq(x: torch.Tensor, bit_width: int, group_size: int = 32,
               axis: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXINT-b: (element step X * 2^-(b-2), values). Elements in [-(2^(b-1)-1), 2^(b-1)-1] steps."""
    step = mx_shared_scale(x, 0, group_size, axis) * 2.0 ** -(bit_width - 2)
    return step, int_qdq(x, step, 0.0, bit_width, True, True)


def mx_float_qdq(x: torch.Tensor, exponent_bits: int, mantissa_bits: int, group_size: int = 32,
                 axis: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP: (shared scale X, values float_round(x / X) * X)."""
    scale = mx_shared_scale(x, mx_emax(exponent_bits, mantissa_bits), group_size, axis)
    return scale, float_qdq(x, scale, exponent_bits, mantissa_bits)


# ----------------------------------------------------------------------------------------- rounding methods
#
# RoundType: ``half_even`` (nearest, ties to even: the default above), ``floor`` (towards -inf) and ``round``
# (nearest, ties away from zero, as C's round()). For minifloats the same rule picks between the two grid
# values around x / scale; saturation at the largest finite value comes after.


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Nearest integer, ties away from zero: sign(x) * floor(|x| + 1/2), written with exact steps."""
    magnitude = x.abs()
    floor = torch.floor(magnitude)
    return torch.copysign(torch.where(magnitude - floor >= 0.5, floor + 1, floor), x)


ROUNDING = {"half_even": round_half_even, "floor": torch.floor, "round": round_half_away}


def int_qdq_rounded(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | float, bit_width: int,
                    signed: bool, narrow_range: bool, rounding: str) -> torch.Tensor:
    """(clamp(rounding(x / scale + zp), qmin, qmax) - zp) * scale."""
    qmin, qmax = int_range(bit_width, signed, narrow_range)
    q = torch.clamp(ROUNDING[rounding](x / scale + zero_point), qmin, qmax)
    return (q - zero_point) * scale


def float_round_mode(y: torch.Tensor, exponent_bits: int, mantissa_bits: int, rounding: str) -> torch.Tensor:
    """Round to the minifloat grid with ``rounding`` (see above), saturating at the largest finite value."""
    if rounding == "half_even":
        return float_round(y, exponent_bits, mantissa_bits)
    grid = float_grid(exponent_bits, mantissa_bits)
    signed_grid = torch.cat([-grid.flip(0)[:-1], grid])  # ascending, -max .. max
    flat = y.reshape(-1).to(torch.float64)
    hi = torch.searchsorted(signed_grid, flat).clamp(max=len(signed_grid) - 1)
    lo = (hi - 1).clamp(min=0)
    exact = signed_grid[hi] == flat
    below = torch.where(exact, hi, lo)  # largest grid value <= y (or the minimum)
    above = hi  # smallest grid value >= y (or the maximum)
    if rounding == "floor":
        index = below
    else:
        d_below, d_above = (flat - signed_grid[below]).abs(), (signed_grid[above] - flat).abs()
        away = torch.where(flat >= 0, above, below)
        index = torch.where(d_below < d_above, below, torch.where(d_above < d_below, above, away))
    out = signed_grid[index]
    out = torch.where(flat > grid[-1], grid[-1], torch.where(flat < -grid[-1], -grid[-1], out))
    return out.to(y.dtype).reshape(y.shape)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal within 1e-6 relative; a value one grid step off can never pass."""
    actual, expected = actual.detach(), expected.detach()
    bad = (actual - expected).abs() > 1e-6 * expected.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} differ, e.g. got {actual[bad][:4].tolist()} "
        f"expected {expected[bad][:4].tolist()}"
    )
