"""GPTQ's statistics pass: the Hessians ``X^T X`` of a group of layers reading one input, over a block's batches.

Split from :mod:`quark_brevitas.algorithms.gptq` (which re-exports :class:`HessianPass`); Qronos extends it with
its cross products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quark_brevitas.brevitas_adapter import StopFwdException
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.calibration.stacking import split_rows

__all__ = ["HessianPass"]


@dataclass
class HessianPass:
    """What one pass over a block's inputs collects: per-layer Hessian sums and sample counts. On the first batch
    it records the order in which layers are first called and the object each is called with, which decides the
    group of layers this pass is for (``sequential``: the layers sharing the first layer's input; otherwise all);
    from the second batch on only that group's Hessians are accumulated, and the batch stops (StopFwdException)
    as soon as every layer of the group has had as many calls as in the first batch: the rest of the block
    would compute nothing this pass uses (in a transformer block, the passes for q/k/v, o and the MLP's first
    layer skip the MLP).

    Layers called with the same object (q/k/v, gate/up) share one product ``X^T X``: it is computed once per
    call and added to each layer's sum, the very same values as one product per layer. When the whole group
    reads one input once per batch (``shortcut``, the sequential case of a transformer block), the batch stops
    at the group's first call, crediting every layer of the group with that input: the other layers' calls would
    only repeat the product, and their outputs are never used (the pass stops before anything reads them)."""

    sequential: bool
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    #: On the first batch, for each layer in the order of their first calls: whether that call read the object
    #: the first layer was called with (``first_object``, the one input kept alive until the group is known: in a
    #: mixture-of-experts block, keeping every layer's first input would hold every expert's routed rows).
    first_calls: dict[str, bool] = field(default_factory=dict)
    first_object: Any = None
    group: list[str] | None = None
    calls_per_batch: dict[str, int] = field(default_factory=dict)
    this_batch: dict[str, int] = field(default_factory=dict)
    #: Whether a batch may stop at the group's first call (see the class docstring; subclasses that need every
    #: layer's own call, as Qronos's cross products do, turn it off).
    shortcut: bool = True
    one_input: bool = False
    last_product: tuple[Any, int, torch.Tensor] | None = None
    #: Called with the group once it is known (after the first batch that called a layer of it).
    on_group: Any = None
    #: In ``one_input`` mode: the layer whose sum stands for each other layer of the group (the sums would be the
    #: same additions of the same products), and the averages already worked out per such layer.
    aliases: dict[str, str] = field(default_factory=dict)
    averages: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    #: Stacked data (:func:`~quark_brevitas.calibration.stacking.stacked_batches`): the rows of the original
    #: batches in each call, the hidden state's number of dimensions, which call this is, and whether a layer of
    #: the group was called with rows that are not the call's (the pass must then run unstacked).
    parts: list[list[int]] | None = None
    stacked_dims: int = 0
    batch_index: int = 0
    unstackable: bool = False

    def _product(self, rows: torch.Tensor, raw: Any) -> list[torch.Tensor]:
        """``rows^T rows`` (one per original batch of a stacked call, see ``parts``), computed once for
        consecutive calls with the same object (not modified in between)."""
        version = getattr(raw, "_version", None)
        if self.last_product is not None and self.last_product[0] is raw and self.last_product[1] == version:
            return self.last_product[2]
        parts = self.parts[self.batch_index] if self.parts is not None else [0]
        chunks = split_rows(rows, raw, parts, self.stacked_dims)
        if chunks is None:
            self.unstackable = True  # this layer's rows are not the batch's rows (routed tokens, ...)
            raise StopFwdException
        products = [chunk.t() @ chunk for chunk in chunks]
        self.last_product = (raw, version, products)
        return products

    def _accumulate(self, name: str, products: list[torch.Tensor], samples: int) -> None:
        # One sum per original batch, in order: a stacked call sums exactly what its batches would have.
        for product in products:
            if name in self.hessians:
                self.hessians[name] += product
            else:
                self.hessians[name] = product.clone()
        self.counts[name] = self.counts.get(name, 0) + samples
        self.this_batch[name] = self.this_batch.get(name, 0) + 1

    def add(self, name: str, rows: torch.Tensor, raw: Any) -> None:
        if self.unstackable:
            raise StopFwdException  # the pass runs again, unstacked: nothing more to do in this one
        if self.group is None:
            if not self.first_calls:
                self.first_object = raw
            shares = self.first_calls.setdefault(name, raw is self.first_object)
            # Sequential: the group is the layers first called with the first layer's input object, known at once;
            # the other layers' Hessians (every expert's, in a mixture-of-experts block) are not computed only to
            # be dropped after the batch, which held about one block's worth of Hessians at a time.
            if self.sequential and not shares:
                self.this_batch[name] = self.this_batch.get(name, 0) + 1
                return
        elif name not in self.group:
            return
        product = self._product(rows, raw)
        if self.one_input:
            self._accumulate(self.group[0], product, rows.shape[0])
            self.last_product = None
            raise StopFwdException
        self._accumulate(name, product, rows.shape[0])
        if self.group is not None and all(self.this_batch.get(n, 0) >= c for n, c in self.calls_per_batch.items()):
            self.last_product = None
            raise StopFwdException

    def averaged(self, data: CalibrationData, name: str, *sums: dict[str, torch.Tensor]
                 ) -> tuple[int, list[torch.Tensor]]:
        """``(samples, [Hessian, *sums])`` of layer ``name`` over every process (summed, then divided by the samples
        of all processes): ``sums`` are further per-layer sums collected alongside (Qronos's cross products).
        Layers sharing one sum (``aliases``) get the very same tensors."""
        owner = self.aliases.get(name, name)
        if not sums and owner in self.averages:
            return self.averages[owner]
        count = torch.tensor(float(self.counts[owner]))
        data.all_reduce(count, "sum")
        averaged = int(count), [data.all_reduce(tensors[owner], "sum") / count for tensors in (self.hessians, *sums)]
        if not sums:
            self.averages[owner] = averaged
        return averaged

    def taken(self, data: CalibrationData, name: str) -> tuple[int, torch.Tensor]:
        """:meth:`averaged`'s ``(samples, Hessian)`` for a caller that takes each layer of the group once, in the
        group's order (GPTQ): the sum is dropped once averaged, and the average once the last layer sharing it
        (``aliases``) has it, so that neither is held while the columns of the layers after are rounded (a group
        of independent inputs, all of a block's layers without ``true_sequential``, would hold one Hessian per
        layer). Layers sharing one sum still get the very same tensor."""
        samples, (hessian,) = self.averaged(data, name)
        owner = self.aliases.get(name, name)
        self.hessians.pop(owner, None)
        later = self.group[self.group.index(name) + 1:] if self.group is not None and name in self.group else []
        if all(self.aliases.get(other, other) != owner for other in later):
            self.averages.pop(owner, None)
        return samples, hessian

    def batch_done(self, _index: int, _output: Any) -> None:
        if self.group is None and self.first_calls:
            self.group = [name for name, shares in self.first_calls.items() if shares or not self.sequential]
            self.first_calls.clear()
            self.first_object = None  # the first batch's input need not be kept alive any longer
            for name in [n for n in self.hessians if n not in self.group]:
                del self.hessians[name], self.counts[name]
            self.calls_per_batch = {name: self.this_batch[name] for name in self.group}
            self.one_input = self.shortcut and self.sequential and set(self.calls_per_batch.values()) == {1}
            if self.one_input:  # the first batch added one product of one input to each: one sum stands for all
                for name in self.group[1:]:
                    self.aliases[name] = self.group[0]
                    del self.hessians[name], self.counts[name]
            if self.on_group is not None:
                self.on_group(self.group)
        self.this_batch = {}
        self.last_product = None
        self.batch_index += 1
