"""Hadamard rotations built from Brevitas's Hadamard matrices, and the online rotation module.

A normalised Hadamard matrix ``H`` (``H @ H.T == I``) spreads each channel's outliers over all channels;
QuaRot/SpinQuant fold such rotations into the weights so the quantizers see flatter tensors. Brevitas ships the
non-power-of-two Hadamard blocks (12, 20, 28, 36, 40, 52, 60, 108, 140, 152, 156, 172, the sizes QuaRot uses)
in ``brevitas.graph.hadamard``; its own transform (``matmul_hadU``) writes into slices in place, which the
TorchScript ONNX exporter turns into scatter operations. Here a rotation of size ``n = K * 2**m`` is the
Kronecker product of Brevitas's ``K`` block and Sylvester blocks of at most :data:`MAX_FACTOR`, each applied by a
reshape and one matrix product: in PyTorch a few small matmuls, in ONNX a few ``Transpose``/``MatMul`` nodes by
constants (the online rotation is graph operations, no custom op).

``rotation_size`` (Quark's field) makes the rotation block-diagonal: ``I_(n/r) (x) H_r``.
"""

from __future__ import annotations

import functools
import math

import torch
from brevitas.graph import hadamard as _brevitas_hadamard
from torch import nn

__all__ = ["MAX_FACTOR", "OnlineHadamard", "RotatedInput", "hadamard_factors", "hadamard_supported",
           "rotation_matrix"]

#: Largest Sylvester factor of an online rotation (its constant is MAX_FACTOR**2 floats).
MAX_FACTOR = 256


@functools.cache
def _brevitas_block(n: int) -> tuple[int, tuple[tuple[float, ...], ...] | None]:
    """``(K, block)``: Brevitas's non-power-of-two Hadamard block (entries +-1) for size ``n`` (``K = 1`` and no
    block when ``n`` is a power of two). Raises ValueError for sizes Brevitas has no Hadamard matrix for."""
    if n < 1:
        raise ValueError(f"a Hadamard size must be >= 1, got {n}")
    try:
        block, k = _brevitas_hadamard.get_hadK(n)
    except AssertionError:  # Brevitas asserts that n / K is a power of two
        raise ValueError(f"no Hadamard matrix of size {n}: sizes are K * 2**m with K in 1, 12, 20, 28, 36, 40, 52, "
                         "60, 108, 140, 152, 156, 172 (Brevitas's blocks)") from None
    if k == 1:
        return 1, None
    return k, tuple(tuple(float(v) for v in row) for row in block.tolist())


def hadamard_supported(n: int) -> bool:
    """Whether a Hadamard matrix of size ``n`` exists among Brevitas's blocks times powers of two."""
    try:
        _brevitas_block(n)
    except ValueError:
        return False
    return True


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h, base)
    return h


def hadamard_factors(n: int) -> list[torch.Tensor]:
    """Orthonormal float64 factors whose Kronecker product is a Hadamard matrix of size ``n`` (each at most
    :data:`MAX_FACTOR` unless it is Brevitas's block)."""
    k, block = _brevitas_block(n)
    factors = [torch.tensor(block, dtype=torch.float64)] if block is not None else []
    rest = n // k
    while rest > 1:
        size = min(rest, MAX_FACTOR)
        factors.append(_sylvester(size))
        rest //= size
    return [f / math.sqrt(f.shape[0]) for f in factors] or [torch.ones(1, 1, dtype=torch.float64)]


def rotation_matrix(n: int, block: int | None = None, *, random: bool = False,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """The orthonormal float64 rotation of size ``n``: a Hadamard matrix (block-diagonal with blocks of ``block``
    when given), with random signs on its rows when ``random`` (Brevitas's and QuIP#'s randomised Hadamard,
    ``diag(+-1) @ H``)."""
    size = n if block is None else block
    if n % size:
        raise ValueError(f"rotation size {size} does not divide {n}")
    matrix = functools.reduce(torch.kron, hadamard_factors(size))
    if size != n:
        matrix = torch.kron(torch.eye(n // size, dtype=torch.float64), matrix)
    if random:
        signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
        matrix = signs[:, None] * matrix
    return matrix


class OnlineHadamard(nn.Module):
    """``x @ H`` over the last dimension, ``H`` a (block-diagonal) Hadamard rotation of size ``features``.

    The factors are non-persistent buffers rebuilt from ``features`` and ``block`` (deterministic), so a
    checkpoint holds no copy of them; they follow the module's device and dtype.
    """

    def __init__(self, features: int, block: int | None = None) -> None:
        super().__init__()
        size = features if block is None else block
        if features % size:
            raise ValueError(f"rotation size {size} does not divide {features}")
        self.features, self.block = features, block
        factors = hadamard_factors(size)
        self.sizes = [features // size, *(f.shape[0] for f in factors)] if size != features else \
            [f.shape[0] for f in factors]
        self.skip = 1 if size != features else 0  # the leading block index is left as it is (identity)
        for index, factor in enumerate(factors):
            self.register_buffer(f"factor{index}", factor.to(torch.float32), persistent=False)
        self.count = len(factors)

    def matrix(self) -> torch.Tensor:
        """The rotation as a float64 matrix (``x @ matrix()`` is what :meth:`forward` computes)."""
        return rotation_matrix(self.features, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = x.reshape(-1, *self.sizes)
        for index in range(self.count):
            axis = 1 + self.skip + index
            factor = getattr(self, f"factor{index}").to(x.dtype)
            y = torch.matmul(y.transpose(axis, -1), factor).transpose(axis, -1)
        return y.reshape(*lead, self.features)

    def extra_repr(self) -> str:
        return f"features={self.features}, block={self.block}"


class RotatedInput(nn.Module):
    """A layer behind an online rotation of its input: ``layer(rotation(x))``. The layer keeps its place under
    the wrapper's name for the config (``down_proj`` -> ``down_proj.layer``, like Brevitas's equalized wrapper),
    and its input quantizer sees the rotated input."""

    def __init__(self, rotation: OnlineHadamard, layer: nn.Module) -> None:
        super().__init__()
        self.rotation = rotation
        self.layer = layer

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self.layer(self.rotation(x), *args, **kwargs)
