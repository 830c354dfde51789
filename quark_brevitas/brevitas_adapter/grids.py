"""Scales and weight grids: where a quantizer's scale lives, when it counts as initialised, and the exact
integer grid a weight quantizer puts its weight on.

Brevitas initialises scales (and zero points) from statistics lazily, keeps "already initialised" in
per-module flags (``init_done``, ``counter``) and computes integer weights inside ``IntQuant``. The
algorithms that choose weights themselves (GPTQ, AWQ's scaling and clipping), QAT's learnable scales and
re-calibration after an algorithm changed a layer's inputs need to read or reset that state; every such
touch is here, with its canary in ``tests/brevitas_adapter/test_adapter_grids.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from brevitas.proxy.parameter_quant import WeightQuantProxyFromInjectorBase
from torch import nn

from quark_brevitas.brevitas_adapter.introspection import (
    QuantLayer,
    injector_value,
    is_dynamic_activation,
    is_groupwise,
    iter_quantizers,
    quant_switched,
)
from quark_brevitas.brevitas_adapter.kquant_minimum import KQuantOffsetIntQuant, offset_dequantize
from quark_brevitas.errors import QuarkBrevitasError

__all__ = [
    "IntWeightFormat",
    "WeightGrid",
    "fixed_weight_grid",
    "init_weight_scales",
    "int_weight_format",
    "int_weight_formats_remembered",
    "mark_scale_initialised",
    "restart_activation_statistics",
    "scale_impl",
    "scale_parameters",
    "weight_grid",
]


# ===================================================================== scales
def scale_impl(proxy: nn.Module) -> nn.Module | None:
    """The module holding the proxy's learnable scale (a ``value`` parameter), if it has one."""
    for module in proxy.modules():
        if isinstance(getattr(module, "value", None), nn.Parameter):
            return module
    return None


def scale_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every learnable scale / threshold parameter of the model, by qualified parameter name.

    Brevitas keeps them inside each proxy's ``scaling_impl`` (zero points live elsewhere).
    """
    found: dict[str, nn.Parameter] = {}
    for site in iter_quantizers(model, enabled_only=False):
        for name, param in site.proxy.named_parameters():
            if "scaling_impl" in name.split("."):
                found[f"{site.name}.{name}"] = param
    return found


def mark_scale_initialised(impl: nn.Module) -> None:
    """Tell a scale module that its value is final: parameter-from-stats scalings stop initialising
    from statistics (``init_done``), runtime-stats scalings stop collecting (``counter``)."""
    if hasattr(impl, "init_done"):
        impl.init_done = True
    if hasattr(impl, "counter"):
        impl.counter = getattr(impl, "collect_stats_steps", impl.counter) + 1


def init_weight_scales(model: nn.Module) -> None:
    """Compute every weight scale (and zero point) from its float weight now.

    Parameter-from-stats weight scales are otherwise initialised lazily on the first quantized
    forward pass; doing it at replacement makes weight-only quantization data-free and gives
    GPTQ/GPFQ the initialised grid they require (calibration mode does not touch weight quantizers).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantLayer) and module.weight_quant.is_quant_enabled:
                module.quant_weight()


# ===================================================================== weight grids and statistics (LLM algorithms)
class WeightGrid(NamedTuple):
    """The integer grid a layer's weight quantizer puts its weight on, per weight element.

    ``scale`` and ``zero_point`` are broadcast to the weight's shape (``[out, in]`` for Linear layers), so column
    ``j`` of the weight uses ``scale[:, j]`` whatever the granularity (per tensor, per channel, per group).
    :meth:`quantize` repeats Brevitas's integer quantization (``IntQuant``) operation for operation, so values it
    returns are exactly what Brevitas's quantized weight holds for them.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    min_int: torch.Tensor
    max_int: torch.Tensor
    to_int: Callable[[torch.Tensor], torch.Tensor]
    clamp: Callable[..., torch.Tensor]
    bit_width: int
    #: An asymmetric K grid: values are ``codes * scale - offset_of(zero_point, scale)``
    #: (:mod:`quark_brevitas.brevitas_adapter.kquant_minimum`), not ``(codes - zero_point) * scale``.
    offset_dequantization: bool = False

    def quantize(self, weight: torch.Tensor, columns: Any = slice(None)) -> torch.Tensor:
        """``weight`` (the weight, or its ``columns``) quantized and dequantized on this grid."""
        return self.quantize_values(weight, self.scale[:, columns], self.zero_point[:, columns])

    def plain_rounding(self) -> bool:
        """Whether this grid rounds half to even and clamps as Brevitas's plain ``RoundSte`` / ``TensorClamp`` do
        (:func:`plain_round_and_clamp`): then :meth:`quantize_values` is a fixed sequence of element-wise operations
        that code outside torch (GPTQ's NumPy column loop) can repeat exactly (not for an offset grid)."""
        return not self.offset_dequantization and plain_round_and_clamp(self.to_int, self.clamp)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        """The values of ``codes`` on this grid (``scale`` / ``zero_point``: slices of its own), as the quantizer
        computes them."""
        if self.offset_dequantization:
            return offset_dequantize(codes, scale, zero_point)
        return (codes - zero_point) * scale

    def column_quantizer(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """:meth:`quantize_values` as a function whose rounding path is chosen once, for a loop over columns."""
        return _column_quantizer(self)

    def quantize_values(self, values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        """``values`` quantized and dequantized with ``scale`` / ``zero_point`` (slices of this grid's, of the
        same shape): :meth:`quantize` without the slicing, for GPTQ's column loop.

        Brevitas's usual ``RoundSte`` / ``TensorClamp`` modules are ``torch.round`` and a clamp written with two
        ``torch.where``: for them the same values come from ``torch.round`` and ``torch.clamp`` directly, without a
        module call and an autograd function per column (a third of GPTQ's column loop)."""
        if plain_round_and_clamp(self.to_int, self.clamp):
            codes = torch.clamp(torch.round(values / scale + zero_point), self.min_int, self.max_int)
        else:
            codes = self.clamp(self.to_int(values / scale + zero_point), min_val=self.min_int, max_val=self.max_int)
        return self.dequantize(codes, scale, zero_point)


def _column_quantizer(grid: WeightGrid) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """:meth:`WeightGrid.quantize_values` with the choice of path made once (GPTQ's column loop calls it per
    column): the same operations, so the same values."""
    if not grid.plain_rounding():
        return grid.quantize_values
    min_int, max_int = grid.min_int, grid.max_int

    def quantize(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        codes = torch.clamp(torch.round(values / scale + zero_point), min_int, max_int)
        return (codes - zero_point) * scale

    return quantize


def plain_round_and_clamp(to_int: Any, clamp: Any) -> bool:
    """Whether ``to_int`` / ``clamp`` are exactly Brevitas's round-half-to-even ``RoundSte`` and ``TensorClamp``
    (subclasses may round or clamp differently)."""
    from brevitas.core.function_wrapper.clamp import TensorClamp
    from brevitas.core.function_wrapper.ops_ste import RoundSte

    return type(to_int) is RoundSte and type(clamp) is TensorClamp


def int_weight_quant(layer: nn.Module) -> Any:
    """The layer's integer weight quantizer proxy and its ``IntQuant`` (whether or not quantization is switched off
    for the moment, e.g. by :func:`quantization_disabled`)."""
    proxy = getattr(layer, "weight_quant", None)
    int_quant = getattr(getattr(proxy, "tensor_quant", None), "int_quant", None)
    if not isinstance(proxy, WeightQuantProxyFromInjectorBase) or int_quant is None:
        raise QuarkBrevitasError(f"{type(layer).__name__} has no integer weight quantizer")
    return proxy, int_quant


def _restore_initial_values(modules: Iterable[nn.Module], initial: dict[type, float]) -> int:
    """Put statistics-initialised scale / zero-point modules back in their state before initialisation: ``value``
    (and the runtime statistics' ``buffer``) to their initial value (1 for scales, 0 for zero points, which the
    first statistic multiplies or is added to), ``init_done`` / ``counter`` back to the start; returns how many."""
    count = 0
    with torch.no_grad():
        for module in modules:
            value = initial.get(type(module))
            if value is None:
                continue
            module.value.fill_(value)
            if hasattr(module, "buffer"):
                module.buffer.fill_(value)
            if hasattr(module, "init_done"):
                module.init_done = False
            if hasattr(module, "counter"):
                module.counter = 0
            count += 1
    return count


def weight_grid(layer: nn.Module, weight: torch.Tensor | None = None) -> WeightGrid:
    """(Re-)initialise ``layer``'s integer weight quantizer from ``weight`` (default: the layer's own weight) and
    return its grid.

    The library's weight quantizers compute their scale (and zero point) once from the float weight and keep it
    as a parameter (``init_done``); algorithms that change the weight (AWQ's scaling and clipping) or choose the
    grid for a weight they are still building (GPTQ) re-initialise it from the tensor they mean. Passing a tensor
    other than the layer's weight works because a weight quantizer tracking one parameter takes its statistics
    from the tensor it is called with.
    """
    from brevitas.core.scaling.standalone import ParameterFromStatsFromParameterScaling
    from brevitas.core.zero_point import ParameterFromStatsFromParameterZeroPoint

    proxy, int_quant = int_weight_quant(layer)
    target = layer.weight if weight is None else weight
    _restore_initial_values(proxy.modules(), {ParameterFromStatsFromParameterScaling: 1.0,
                                              ParameterFromStatsFromParameterZeroPoint: 0.0})
    with torch.no_grad(), quant_switched(proxy, False):  # also inside quantization_disabled
        quant = proxy(target)
    bit_width = quant.bit_width
    scale = quant.scale.expand_as(target).detach()
    zero_point = torch.as_tensor(quant.zero_point, dtype=scale.dtype, device=scale.device).expand_as(target).detach()
    return WeightGrid(scale, zero_point, int_quant.min_int(bit_width), int_quant.max_int(bit_width),
                      int_quant.float_to_int_impl, int_quant.tensor_clamp_impl, int(bit_width),
                      isinstance(int_quant, KQuantOffsetIntQuant))


def fixed_weight_grid(layer: nn.Module) -> WeightGrid | None:
    """The grid of ``layer``'s already initialised integer weight quantizer, read without re-initialising it, when
    that grid cannot change while the weight does: every statistics-based scale / zero point is a parameter that
    is initialised (``init_done``; a quantizer whose scale follows the weight's statistics on every call gives
    ``None``) and rounding and clamping are Brevitas's plain ones (:func:`plain_round_and_clamp`), so that
    :meth:`WeightGrid.quantize` gives exactly what the quantizer gives for any weight values. ``None`` otherwise.
    Brevitas's GPTQ quantizes one column at a time through the whole quantizer; with this grid it need not.
    A layer without an integer weight quantizer (minifloat, MX float weights) gives ``None`` too."""
    proxy = getattr(layer, "weight_quant", None)
    if getattr(getattr(proxy, "tensor_quant", None), "int_quant", None) is None:
        return None
    proxy, int_quant = int_weight_quant(layer)
    if not plain_round_and_clamp(int_quant.float_to_int_impl, int_quant.tensor_clamp_impl):
        return None
    for module in proxy.modules():
        if hasattr(module, "parameter_list_stats") and getattr(module, "init_done", None) is not True:
            return None
    with torch.no_grad(), quant_switched(proxy, False):
        quant = proxy(layer.weight)
    bit_width = quant.bit_width
    scale = quant.scale.expand_as(layer.weight).detach()
    zero_point = torch.as_tensor(quant.zero_point, dtype=scale.dtype, device=scale.device).expand_as(layer.weight)
    return WeightGrid(scale, zero_point.detach(), int_quant.min_int(bit_width), int_quant.max_int(bit_width),
                      int_quant.float_to_int_impl, int_quant.tensor_clamp_impl, int(bit_width),
                      isinstance(int_quant, KQuantOffsetIntQuant))


class IntWeightFormat(NamedTuple):
    """The format of an integer weight quantizer: bits, elements per group (-1: no groups) and whether one scale
    covers the whole tensor."""

    bit_width: int
    group_size: int
    per_tensor: bool


#: Formats read inside :func:`int_weight_formats_remembered` (``None``: outside, every call reads the quantizer).
_FORMATS: contextvars.ContextVar[dict[nn.Module, IntWeightFormat | None] | None] = contextvars.ContextVar(
    "int_weight_formats", default=None)


@contextlib.contextmanager
def int_weight_formats_remembered() -> Iterator[None]:
    """While the context lasts, :func:`int_weight_format` reads each layer's format once. Reading it runs the
    quantizer twice on the whole weight (its bit width, its scale): an algorithm working on a block asks for each
    layer's format several times (which layers it quantizes, their group size), and no quantizer is replaced or
    reconfigured while it runs (weights and scales change; bits and groups do not)."""
    token = _FORMATS.set({})
    try:
        yield
    finally:
        _FORMATS.reset(token)


def int_weight_format(layer: nn.Module) -> IntWeightFormat | None:
    """The format of ``layer``'s integer weight quantizer, or ``None`` if the layer has none (float formats, or no
    weight quantization)."""
    remembered = _FORMATS.get()
    if remembered is not None and layer in remembered:
        return remembered[layer]
    try:
        proxy, _ = int_weight_quant(layer)
    except QuarkBrevitasError:
        found = None
    else:
        with torch.no_grad(), quant_switched(proxy, False):
            # What proxy.bit_width() and proxy.scale() each read (Brevitas's retrieve_attribute), one run of the
            # quantizer on the whole weight instead of two.
            cached = proxy._cached_weight
            quant = cached if cached is not None else proxy(proxy.tracked_parameter_list[0])
            bit_width = int(quant.bit_width)
            scale = quant.scale
        group_size = int(injector_value(proxy, "group_size")) if is_groupwise(proxy) else -1
        found = IntWeightFormat(bit_width, group_size, group_size == -1 and scale.numel() == 1)
    if remembered is not None:
        remembered[layer] = found
    return found


def restart_activation_statistics(model: nn.Module) -> int:
    """Make the static activation quantizers of ``model`` forget their calibration, so that the next calibration
    starts afresh; returns how many were reset.

    Brevitas's runtime-statistics scales and zero points keep a step counter, fold the first statistic into their
    buffer and the final average into their value, both starting from 1 (a scale) or 0 (a zero point);
    recalibrating after an algorithm has changed a layer's inputs (AWQ's folded scales) needs all three restored.
    """
    from brevitas.core.scaling.standalone import ParameterFromRuntimeStatsScaling
    from brevitas.core.zero_point import ParameterFromRuntimeZeroPoint

    initial = {ParameterFromRuntimeStatsScaling: 1.0, ParameterFromRuntimeZeroPoint: 0.0}
    return sum(_restore_initial_values(site.proxy.modules(), initial) for site in iter_quantizers(model)
               if site.kind == "act" and not is_dynamic_activation(site.proxy))
