"""Brevitas door (issue 20): each layer's quantized weight computed once per calibration pass, not once per call.

Brevitas quantizes a layer's weight on every forward call (statistics, scale, rounding, clamping): in a
calibration pass over 64 batches a weight that does not change is quantized 64 times, which was the largest
single cost of block-by-block GPTQ. :func:`weights_quantized_once` memoises
``QuantWeightBiasInputOutputLayer.quant_weight`` for the duration of one pass, and recomputes it whenever
anything it depends on may have changed:

- the weight tensor (a different object, or its in-place version counter moved: ``copy_``, ``div_``, ...),
- any parameter or buffer of the weight quantizer (learned scales, initialised statistics),
- whether weight quantization is on, and the layer's ``training`` flag.

It does not cache when gradients are on (QAT needs the graph), for a weight quantizer that reads the quantized
input (``requires_quant_input``), or for sub-tensor calls. Writes through ``weight.data`` bypass the version
counter, which is why the cache lives only as long as one pass (the caller's context): algorithms change
weights between passes, never inside one.

Part of the one door to Brevitas internals; re-exported by :mod:`quark_brevitas.brevitas_adapter`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from brevitas.graph.gpxq import LayerHandler
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer
from brevitas.utils.torch_utils import StopFwdException
from torch import nn

from quark_brevitas.brevitas_adapter.grids import fixed_weight_grid

__all__ = ["PassWeights", "gptq_class_checking_once", "quant_layers", "shared_input_gptq_mode", "weight_cache_budget",
           "weights_quantized_once"]

#: The instance attribute that shadows the class's ``quant_weight`` while a cache is active.
_ATTRIBUTE = "quant_weight"


#: Bytes of quantized weights a :func:`weights_quantized_once` context keeps at most (``None``: no limit).
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("weight_cache_budget", default=None)


@contextlib.contextmanager
def weight_cache_budget(budget_bytes: int | None) -> Iterator[None]:
    """:func:`weights_quantized_once` contexts opened while this one lasts keep at most ``budget_bytes`` of
    quantized weights (``None``: every layer's). The layers called first are kept; the others quantize their
    weight at each call, as without the cache: the cache trades memory for time, never values. The block engine
    sets one block's weights without its experts but one, so that a pass over a mixture-of-experts block does not
    hold a second copy of every expert."""
    token = _BUDGET.set(budget_bytes)
    try:
        yield
    finally:
        _BUDGET.reset(token)


class _Budget:
    """What the layers of one :func:`weights_quantized_once` context keep, against its budget."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0


def _nbytes(value: Any) -> int:
    """The bytes of a quantized weight's values (its scales and zero points are a small fraction of them)."""
    tensor = getattr(value, "value", value)
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


class _CachedQuantWeight:
    """A layer's ``quant_weight``, remembered until its inputs change (see the module docstring)."""

    def __init__(self, layer: QuantWeightBiasInputOutputLayer, budget: _Budget) -> None:
        self.layer = layer
        self.budget = budget
        self.nbytes = 0
        self.called = False
        self.state = [*layer.weight_quant.parameters(), *layer.weight_quant.buffers()]
        self.weight: torch.Tensor | None = None
        self.versions: list[int] = []
        self.training = False
        self.value: Any = None

    def drop(self) -> None:
        self.budget.used -= self.nbytes
        self.value, self.nbytes = None, 0

    def _valid(self, weight: torch.Tensor) -> bool:
        return (weight is self.weight and self.training == self.layer.training
                and self.versions == [weight._version, *(tensor._version for tensor in self.state)])

    def __call__(self, quant_input: Any = None, subtensor_slice_list: Any = None) -> Any:
        layer = self.layer
        original = QuantWeightBiasInputOutputLayer.quant_weight
        proxy = layer.weight_quant
        if (subtensor_slice_list is not None or not proxy.is_quant_enabled or torch.is_grad_enabled()
                or proxy.requires_quant_input):  # nothing to save (float weight), or not cacheable
            return original(layer, quant_input, subtensor_slice_list)
        weight = layer.weight
        self.called = True
        if self.value is not None and self._valid(weight):
            return self.value
        self.drop()
        value = original(layer, quant_input)
        size = _nbytes(value)
        if self.budget.limit is None or self.budget.used + size <= self.budget.limit:
            self.value, self.nbytes = value, size
            self.budget.used += size
            self.weight, self.training = weight, layer.training
            self.versions = [weight._version, *(tensor._version for tensor in self.state)]
        return value


def quant_layers(model: nn.Module) -> Iterator[QuantWeightBiasInputOutputLayer]:
    """The quantized layers of ``model``, without walking into them (a Brevitas layer's quantizers are deep
    module trees, and the walk happens once per pass)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if isinstance(module, QuantWeightBiasInputOutputLayer):
            yield module
        else:
            stack.extend(child for child in module._modules.values() if child is not None)


class PassWeights:
    """The quantized weights one :func:`weights_quantized_once` context keeps."""

    def __init__(self, caches: list[_CachedQuantWeight]) -> None:
        self.caches = caches

    def batch_done(self) -> None:
        """Drop the weights of the layers the batch just done did not call: a pass that stops early (GPTQ's,
        from its second batch on) calls the layers after its stop only in its first batch, and a mixture-of-experts
        block leaves an expert out of a batch that routes no token to it."""
        for cache in self.caches:
            if not cache.called and cache.value is not None:
                cache.drop()
            cache.called = False


@contextlib.contextmanager
def weights_quantized_once(model: nn.Module) -> Iterator[PassWeights]:
    """While the context lasts (one calibration pass), each quantized layer of ``model`` quantizes its weight
    once and reuses it until the weight or its quantizer changes (or a batch does not call it:
    :meth:`PassWeights.batch_done`). Nested contexts share the outer cache."""
    installed = []
    caches = []
    budget = _Budget(_BUDGET.get())
    for module in quant_layers(model):
        if _ATTRIBUTE not in module.__dict__:
            cache = _CachedQuantWeight(module, budget)
            object.__setattr__(module, _ATTRIBUTE, cache)
            installed.append(module)
            caches.append(cache)
    try:
        yield PassWeights(caches)
    finally:
        for module in installed:
            module.__dict__.pop(_ATTRIBUTE, None)


# ===================================================================== Brevitas's GPTQ: the initialisation check once
def gptq_class_checking_once() -> type:
    """Brevitas's ``GPTQ`` made cheaper per column, with Brevitas's values.

    Brevitas walks every submodule of the weight quantizer for ``init_done`` before quantizing each column (a
    sixth of GPTQ's time on MiniLM); the flags cannot change while one layer is being updated, because the
    columns are quantized with quantization on and the scales already initialised. The check runs on the first
    column exactly as Brevitas runs it (same error), then the walk is skipped for the layer's other columns.
    For a Linear layer whose grid cannot change (:func:`fixed_weight_grid`), the whole update is
    :func:`columns_in_order`: Brevitas's operations on the same values, without a quantizer call and a gather /
    scatter of the permuted columns per column (most of the rest of its time); other layers get Brevitas's own.
    """
    from brevitas.graph.gptq import GPTQ

    class CheckedOnceGPTQ(GPTQ):
        def get_quant_weights(self, i: int, i1: int, permutation_list: Any, with_quant_history: bool = False
                              ) -> Any:
            proxy = self.layer.weight_quant
            if not getattr(self, "_quant_init_checked", False):
                result = super().get_quant_weights(i, i1, permutation_list, with_quant_history)
                self._quant_init_checked = True
                self._fixed_grid = _column_grid(self.layer, self.groups, with_quant_history)
                return result
            grid = getattr(self, "_fixed_grid", None)
            if grid is not None and not with_quant_history:
                index = permutation_list[0][i1 + i]  # the column Brevitas would quantize, on the same grid
                return grid.quantize(self.layer.weight.detach()[:, index], index).unsqueeze(0)
            object.__setattr__(proxy, "modules", _no_modules)  # the walk Brevitas repeats per column
            try:
                return super().get_quant_weights(i, i1, permutation_list, with_quant_history)
            finally:
                proxy.__dict__.pop("modules", None)

        def update_batch(self, module: nn.Module, inputs: Any, current_layer: Any) -> Any:
            if self.disable_pre_forward_hook or not isinstance(current_layer, SharedInputPass):
                return super().update_batch(module, inputs, current_layer)
            if not current_layer.admits(self.name, inputs):
                raise StopFwdException
            self.compute_iterative_covariance(module, inputs, current_layer)
            if current_layer.ends_after(self.name):
                raise StopFwdException
            return None

        def compute_iterative_covariance(self, module: nn.Module, inputs: Any, current_layer: Any) -> None:
            """Brevitas's running Hessian, with the outer product of a batch shared by the layers of a
            :class:`SharedInputPass` that read the same raw input unquantized (their processed inputs, and so
            their products, are equal): Brevitas's operations on the same values otherwise."""
            if not isinstance(current_layer, SharedInputPass) or not _shares_products(self.layer):
                return super().compute_iterative_covariance(module, inputs, current_layer)
            current_layer.layer_names.add(self.name)
            key = (self.nsamples, self.dtype, int(self.columns))  # the product is of this call's anchor
            if current_layer.product is not None and current_layer.product[0] == key:
                batch_size, product = current_layer.product[1:]
            else:
                processed = self.process_input(inputs)
                batch_size = processed.shape[-1]
                processed = math.sqrt(2 / (self.nsamples + batch_size)) * processed.to(self.dtype)
                product = processed.bmm(processed.transpose(2, 1))
                current_layer.product = (key, batch_size, product)
            self.H *= self.nsamples / (self.nsamples + batch_size)
            self.nsamples += batch_size
            if self.use_intermediate_buffer:
                self.B.copy_(product)
                self.H += self.B
            else:
                self.H += product
            return None

        def single_layer_update(self, percdamp: float = .01, c: float = 1e4) -> None:
            grid = _column_grid(self.layer, self.groups, False)
            if grid is None or hasattr(self.layer, "allocate_params") or any(
                    getattr(m, "init_done", True) is not True for m in self.layer.weight_quant.modules()):
                return super().single_layer_update(percdamp, c)  # Brevitas's own (and its errors)
            columns_in_order(self, grid, percdamp, c)
            return None

    return CheckedOnceGPTQ


def columns_in_order(gptq: Any, grid: Any, percdamp: float, c: float) -> None:
    """Brevitas's ``GPTQ.single_layer_update`` for a Linear layer on a fixed grid, operation for operation on the
    same values (same dampening, factorisation, per-column rank-1 updates inside blocks of ``blocksize`` columns
    and one product between blocks), so the result is Brevitas's bit for bit; but the weight is worked on as one
    copy in processing order instead of gathering and scattering the permuted remaining columns for every
    column, and columns are rounded on ``grid`` (:func:`fixed_weight_grid`) instead of through the quantizer:
    the column loop was two thirds of block-by-block GPTQ on MiniLM."""
    import math
    import warnings

    from torch.linalg import LinAlgError

    if gptq.use_intermediate_buffer:
        del gptq.B  # free memory, as Brevitas does
    weight = gptq.layer.weight.data
    hessian = gptq.H[0].to(weight.device)  # Brevitas may keep the Hessian elsewhere (its ``device``)
    dead = torch.diag(hessian) == 0
    hessian[dead, dead] = 1
    weight[:, dead] = 0
    columns = int(gptq.columns)
    perm = torch.argsort(torch.diag(hessian), descending=True) if gptq.act_order else \
        torch.tensor(range(columns), device=weight.device)
    hessian = hessian[perm, :][:, perm]
    try:
        damp = percdamp * torch.mean(torch.diag(hessian))
        diag = torch.arange(columns, device=hessian.device)
        hessian[diag, diag] += damp
        hessian = torch.linalg.cholesky(hessian)
        hessian = torch.cholesky_inverse(hessian)
        h_inv = torch.linalg.cholesky(hessian * c, upper=True) / math.sqrt(c)
    except LinAlgError:
        warnings.warn(f"Failed to compute the inverse of the Hessian for layer {gptq.name} GPTQ will not be applied. "
                      "Increasing the number of samples might fix this issue", stacklevel=2)
        return
    finally:
        del gptq.H
    dtype = weight.dtype
    work = weight[:, perm]  # a copy, in the weight's dtype as Brevitas keeps it
    scale, zero_point = grid.scale[:, perm], grid.zero_point[:, perm]
    same_dtype = dtype == gptq.dtype
    for i1 in range(0, columns, gptq.blocksize):
        i2 = min(i1 + gptq.blocksize, columns)
        block = work[:, i1:i2]
        error_block = torch.zeros_like(block, dtype=gptq.dtype)
        h_inv_block = h_inv[i1:i2, i1:i2]
        # Views of every column made once per block (one call each instead of one per column): the loop is
        # Python-bound, a few microseconds per tensor operation. The outer product error x row is computed by
        # broadcasting: each element is one product, as in Brevitas's (rows x 1) @ (1 x k) matmul.
        weights, errors = block.unbind(1), error_block.unbind(1)
        scales, zero_points = scale[:, i1:i2].unbind(1), zero_point[:, i1:i2].unbind(1)
        diagonal = h_inv_block.diagonal().unbind(0)
        for i in range(i2 - i1):
            w = weights[i]
            q = grid.quantize_values(w, scales[i], zero_points[i])
            error = (w - q if same_dtype else w.to(gptq.dtype) - q.to(gptq.dtype)) / diagonal[i]
            errors[i].copy_(error)
            update = error.unsqueeze(1) * h_inv_block[i, i:]
            block[:, i:].sub_(update if same_dtype else update.to(dtype))
        work[:, i2:] -= error_block.matmul(h_inv[i1:i2, i2:]).to(dtype)
    weight[:, perm] = work.to(dtype)


def _column_grid(layer: nn.Module, groups: int, with_quant_history: bool) -> Any:
    """The fixed grid of a Linear layer's weight quantizer (:func:`fixed_weight_grid`), or ``None`` where GPTQ
    must ask Brevitas per column (convolutions, grids that follow the weight, quantization history)."""
    from brevitas.nn import QuantLinear

    if not isinstance(layer, QuantLinear) or groups != 1 or with_quant_history:
        return None
    return fixed_weight_grid(layer)


def _no_modules() -> Iterator[nn.Module]:
    return iter(())


# ===================================================================== GPTQ: layers reading one input share a pass
@dataclass
class SharedInputPass(LayerHandler):
    """Brevitas's record of the layers a GPTQ pass reaches, extended so that one pass serves every layer that
    reads the same input tensor (attention's q/k/v, an MLP's gate/up): Brevitas stops each pass at the first
    layer not yet optimised, so a block of six Linear layers took six passes (and the passes for k and v
    recomputed q and q, k). Their Hessians are what separate passes would collect, bit for bit: a layer
    whose input tensor already existed when the pass's first layer ran (the same object, not modified in
    place since) cannot depend on any weight optimised in this pass.

    The first layer a call reaches sets ``anchor`` (its input); later layers join while their input is that
    tensor. In the pass's first call the group is found (``members``, in call order) and the call stops at
    the first layer with another input; later calls stop after the last member (``ends_after``).
    """

    anchor: Any = None
    members: list[str] = field(default_factory=list)
    decided: bool = False
    #: ``(key, batch size, product)`` of the last outer product of the anchor's input (the key: the Hessian's
    #: state); dropped whenever the anchor changes.
    product: Any = None

    def admits(self, name: str, inputs: Any) -> bool:
        """Whether layer ``name``'s call with ``inputs`` belongs to this pass's group (then its Hessian grows)."""
        value = inputs[0] if isinstance(inputs, tuple) and inputs else None
        if self.anchor is None:  # the first layer this call reaches: Brevitas's layer of the pass
            self.anchor = (value, getattr(value, "_version", None))
            self.product = None  # a product belongs to one anchor (ids of freed tensors are reused)
        elif not (isinstance(value, torch.Tensor) and value is self.anchor[0]
                  and value._version == self.anchor[1]) or (self.decided and name not in self.members):
            self.decided = self.decided or bool(self.members)
            self.anchor = self.product = None  # this call ends here
            return False
        if not self.decided and name not in self.members:
            self.members.append(name)
        return True

    def ends_after(self, name: str) -> bool:
        """Whether the call ends after layer ``name`` (the group's last member, once the group is known)."""
        if self.decided and name == self.members[-1]:
            self.anchor = self.product = None
            return True
        return False

    def call_started(self) -> None:
        self.anchor = self.product = None

    def call_ended(self) -> None:
        """A call that ran to its end (no layer after the group) also fixes the group."""
        self.anchor = self.product = None
        self.decided = self.decided or bool(self.members)

    def pass_ended(self) -> None:
        self.anchor, self.product, self.decided = None, None, False
        self.members.clear()


def _shares_products(layer: nn.Module) -> bool:
    """Whether a layer's processed GPTQ input is a function of its raw input alone: a Linear whose input
    quantizer is off (GPTQ's passes run with activation quantization off)."""
    input_quant = getattr(layer, "input_quant", None)
    return isinstance(layer, nn.Linear) and not getattr(input_quant, "is_quant_enabled", False)


def shared_input_gptq_mode() -> type:
    """Brevitas's ``gptq_mode`` whose passes each optimise every not yet optimised layer that reads the pass's
    first input (:class:`SharedInputPass`), with Brevitas's per-layer arithmetic: fewer passes, same weights
    (the caller counts the optimised layers with :func:`~quark_brevitas.brevitas_adapter.gpxq_update` and stops
    when none is left)."""
    from brevitas.graph.gptq import gptq_mode

    class SharedInputGPTQMode(gptq_mode):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.current_layer = SharedInputPass()

        def catch_stopfwd(self, *args: Any, **kwargs: Any) -> Any:
            self.current_layer.call_started()
            try:
                return super().catch_stopfwd(*args, **kwargs)
            finally:
                self.current_layer.call_ended()

        def update(self) -> None:
            super().update()
            self.current_layer.pass_ended()

    return SharedInputGPTQMode
