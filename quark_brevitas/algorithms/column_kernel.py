"""GPTQ's column loop on NumPy arrays: the same float operations as the torch loop, at a fraction of its per-call
cost (issue 32).

GPTQ rounds a weight one column at a time, each column's rounding error being spread on the columns after it, so
the loop is sequential: ``in_features`` iterations of about a dozen element-wise operations on one column (a few
hundred values) and a rank-1 update of the rest of the block. At these sizes the work is the cost of each call, not
the arithmetic: a torch operation costs several microseconds of dispatch, a NumPy ufunc with an ``out`` array well
under one. The loop here makes exactly the operations of the torch loop, in the same order and the same dtype
(float32), each of them correctly rounded IEEE arithmetic in both libraries (division, addition, subtraction,
multiplication, round half to even, min/max): the rounded columns, errors and updated weight are the same bit
for bit, which ``tests/algorithms/test_column_kernel.py`` checks against the torch loop.

Arrays are *transposed* (one row per weight column, ``[columns, out]``), so that a column and the rank-1 update's
rows are contiguous.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["round_columns"]

#: Below this many products a rank-1 update multiplies with NumPy; above it with a matrix product of inner size 1
#: (one product per element, nothing summed: the same values), which is several times faster for large blocks.
_MATMUL_PRODUCTS = 4096


def round_columns(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, low: float, high: float,
                  factor: torch.Tensor, rounded: torch.Tensor, delta: torch.Tensor, error: torch.Tensor,
                  first: int, last: int) -> None:
    """Round columns ``first:last`` of a block of ``width`` columns (all tensors ``[width, out]`` float32,
    contiguous, on the CPU, except ``factor``: the block's ``[width, width]`` part of the inverse Hessian's upper
    factor).

    For each column ``j``: ``rounded[j] = (clamp(round(values[j] / scale[j] + zero_point[j]), low, high) -
    zero_point[j]) * scale[j]`` (Brevitas's integer quantization), ``delta[j] = values[j] - rounded[j]``,
    ``error[j] = delta[j] / factor[j, j]``, and every later column of the block gets
    ``values[k] -= factor[j, k] * error[j]``. ``values`` is updated in place."""
    width, out = values.shape
    array, scales, zeros = values.numpy(), scale.numpy(), zero_point.numpy()
    rounded_, delta_, error_ = rounded.numpy(), delta.numpy(), error.numpy()
    low_, high_ = np.full(out, low, dtype=np.float32), np.full(out, high, dtype=np.float32)
    column = np.empty(out, dtype=np.float32)
    products = torch.empty_like(values)
    products_ = products.numpy()
    factor_ = factor.numpy()
    diagonal = factor_.diagonal()
    for j in range(first, last):
        current, scale_j, zero_j = array[j], scales[j], zeros[j]
        np.divide(current, scale_j, out=column)
        np.add(column, zero_j, out=column)
        np.rint(column, out=column)
        np.maximum(column, low_, out=column)  # torch.clamp(x, low, high) is min(max(x, low), high)
        np.minimum(column, high_, out=column)
        np.subtract(column, zero_j, out=column)
        np.multiply(column, scale_j, out=rounded_[j])
        np.subtract(current, rounded_[j], out=delta_[j])
        np.divide(delta_[j], diagonal[j], out=error_[j])
        later = width - j - 1
        if later == 0:  # the rounded column itself is not read again: only the later ones
            continue
        update = products_[:later]
        if later * out >= _MATMUL_PRODUCTS:
            torch.mm(factor[j, j + 1:, None], error[j:j + 1], out=products[:later])
        else:
            np.multiply(factor_[j, j + 1:, None], error_[j], out=update)
        np.subtract(array[j + 1:], update, out=array[j + 1:])
