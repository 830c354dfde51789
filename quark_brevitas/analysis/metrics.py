"""The measurements every analysis tool shares: SQNR, the model output a metric reads, and the result list.

SQNR (signal-to-quantization-noise ratio) of an approximation ``q`` of a reference ``x`` is
``10 log10(sum x^2 / sum (x - q)^2)`` in dB, summed over every element of every batch (so a batch with
large values weighs more, as it does for the error a downstream layer sees). ``math.inf`` means exact
(no error); each 6 dB is about one bit of precision.

A model output may be a tensor, a tuple/list (the first tensor counts), or a mapping such as a Hugging
Face ``ModelOutput`` (its ``logits`` if it has them, else its first tensor): :func:`output_tensor`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from quark_brevitas.errors import ModelError

__all__ = ["OutputAgreement", "Rows", "SQNR", "output_tensor", "sqnr_db"]


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; ``inf`` for zero noise (exact), ``nan`` if there was no signal either."""
    if noise == 0.0:
        return math.inf if signal > 0.0 else math.nan
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


class SQNR:
    """Accumulates signal and noise power over tensors (batches, calls), then reports :attr:`db`."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.count = 0

    def add(self, reference: torch.Tensor, approximation: torch.Tensor, what: str = "tensor") -> None:
        """Add one reference tensor and its approximation (same shape; computed in float64)."""
        if reference.shape != approximation.shape:
            raise ModelError(f"{what}: the quantized model's tensor has shape {tuple(approximation.shape)}, the float "
                             f"reference {tuple(reference.shape)}; the two models must compute the same thing")
        ref = reference.detach().to(torch.float64)
        self.signal += float(ref.square().sum())
        self.noise += float((ref - approximation.detach().to(torch.float64)).square().sum())
        self.count += 1

    @property
    def db(self) -> float | None:
        """The SQNR in dB over everything added (``None`` if nothing was added)."""
        return sqnr_db(self.signal, self.noise) if self.count else None


class OutputAgreement:
    """Share of positions (rows of a classifier's logits, tokens of a language model) whose arg-max over the
    last dimension is the same in both outputs, in percent; ``None`` for outputs without a class axis."""

    def __init__(self) -> None:
        self.same = 0
        self.total = 0

    def add(self, reference: torch.Tensor, approximation: torch.Tensor) -> None:
        if reference.dim() < 2 or reference.shape[-1] < 2:
            return
        self.same += int((reference.argmax(-1) == approximation.argmax(-1)).sum())
        self.total += reference.argmax(-1).numel()

    @property
    def percent(self) -> float | None:
        return 100.0 * self.same / self.total if self.total else None


def output_tensor(output: Any, what: str = "model output") -> torch.Tensor:
    """The tensor a metric reads from a model (or layer) output; see the module docstring."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        values = list(output.values())
    elif isinstance(output, tuple | list):
        values = list(output)
    else:
        values = []
    for value in values:
        if isinstance(value, torch.Tensor | Mapping | tuple | list):
            try:
                return output_tensor(value, what)
            except ModelError:
                continue
    raise ModelError(f"{what} is a {type(output).__name__} without a tensor in it; the analysis compares tensors "
                     "(a tensor, a tuple whose first tensor is the output, or a mapping with 'logits')")


class Rows(list):
    """The rows an analysis returns (a plain ``list``), with the whole-model values in :attr:`summary`."""

    def __init__(self, rows: Any = (), summary: Mapping[str, Any] | None = None) -> None:
        super().__init__(rows)
        self.summary: dict[str, Any] = dict(summary or {})
