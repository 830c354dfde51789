"""MagR (weight magnitude reduction, Zhang et al. 2024): before a weight is rounded, shrink the largest magnitude
of each quantization group while keeping the layer's output on the calibration data.

Per output row ``w`` of a layer with input Hessian ``H = X^T X / n`` and original row ``w0``, MagR solves

    min_w  1/2 (w - w0) H (w - w0)^T  +  alpha * mean(diag H) * sum over groups g of max_j |w_g,j|

by accelerated proximal gradient descent (FISTA, Beck and Teboulle): a gradient step on the quadratic (step
``1 / ||H||_2``), then the proximal operator of the l-infinity norm of each group, which by Moreau's
decomposition is ``v - P(v)``, ``P`` the Euclidean
projection onto the l1 ball of radius ``step * lambda`` (Duchi et al.'s sort-based projection, vectorised over
rows). A smaller max|w| gives a finer grid (scales come from the group maximum), and the quadratic term keeps
``X w`` close to ``X w0``; ``H``'s near-null directions (inputs that barely vary) are where the weight can change
for free. ``alpha`` is relative to the mean of ``diag H`` so that it does not depend on the inputs' scale.

The groups are the weight spec's (``group_size``; a whole row for per-channel weights), so the reduced maxima are
the ones the scales are computed from. Used by ``GPTQConfig(magr_alpha=...)`` (quark_brevitas.algorithms.gptq).
"""

from __future__ import annotations

import torch

__all__ = ["MAGR_ITERATIONS", "magnitude_reduced", "project_l1_ball"]

#: Accelerated proximal-gradient iterations per layer: each costs one ``[out, in] x [in, in]`` product, which
#: dominates MagR's time (the paper runs 150 plain iterations; FISTA gets as far in fewer).
MAGR_ITERATIONS = 40


def project_l1_ball(values: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of each row of ``values`` (``[rows, n]``) onto the l1 ball of ``radius``
    (``[rows, 1]``, positive): rows inside are unchanged, others are soft-thresholded by the ``theta`` that makes
    their l1 norm ``radius`` (Duchi et al. 2008)."""
    magnitude = values.abs()
    inside = magnitude.sum(-1, keepdim=True) <= radius
    ordered = magnitude.sort(-1, descending=True).values
    excess = ordered.cumsum(-1) - radius
    index = torch.arange(1, values.shape[-1] + 1, dtype=values.dtype, device=values.device)
    support = (ordered - excess / index > 0).sum(-1, keepdim=True).clamp(min=1)
    theta = excess.gather(-1, support - 1) / support.to(values.dtype)
    projected = torch.sign(values) * (magnitude - theta).clamp(min=0)
    return torch.where(inside, values, projected)


def _prox_group_linf(values: torch.Tensor, threshold: float, group_size: int) -> torch.Tensor:
    """The proximal operator of ``threshold * sum_g max|v_g|`` on ``[out, in]`` values, groups of ``group_size``
    consecutive input channels (-1: the whole row); ``v - P_l1(threshold)(v)`` group by group."""
    rows, columns = values.shape
    size = columns if group_size <= 0 else group_size
    if columns % size:
        raise ValueError(f"MagR: {columns} input channels are not a whole number of groups of {size}")
    grouped = values.reshape(rows * (columns // size), size)
    radius = torch.full((grouped.shape[0], 1), threshold, dtype=values.dtype, device=values.device)
    return (grouped - project_l1_ball(grouped, radius)).reshape(rows, columns)


def magnitude_reduced(weight: torch.Tensor, hessian: torch.Tensor, alpha: float, group_size: int,
                      iterations: int = MAGR_ITERATIONS) -> torch.Tensor:
    """``weight`` (``[out, in]``) with each group's max magnitude reduced by MagR (see the module docstring);
    ``hessian`` is the ``[in, in]`` input Hessian, ``alpha > 0`` the relative weight of the l-infinity term."""
    if alpha <= 0:
        raise ValueError(f"MagR: alpha must be > 0, got {alpha}")
    original = weight.detach().float()
    hessian = hessian.detach().float()
    lipschitz = float(torch.linalg.eigvalsh(hessian)[-1])
    if lipschitz <= 0:
        return weight.detach().clone()
    step = 1.0 / lipschitz
    threshold = step * alpha * float(torch.diag(hessian).mean())
    current = original.clone()
    point, momentum = current, 1.0
    for _ in range(iterations):  # FISTA: the proximal step at an extrapolated point
        gradient = (point - original) @ hessian
        following = _prox_group_linf(point - step * gradient, threshold, group_size)
        next_momentum = (1 + (1 + 4 * momentum ** 2) ** 0.5) / 2
        point = following + ((momentum - 1) / next_momentum) * (following - current)
        current, momentum = following, next_momentum
    return current.to(weight.dtype)
