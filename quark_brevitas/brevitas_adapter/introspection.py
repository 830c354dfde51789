"""Finding and reading the quantizers Brevitas put into a model.

Brevitas hides each quantizer behind a proxy module whose class says what it quantizes (weight, bias,
activation, dynamic or not, integer or float) and keeps the quantized values in quant tensors with
private fields. The rest of the package asks these questions through the functions here (one walk,
:func:`iter_quantizers`, and small predicates), so a Brevitas release that renames a proxy class or a
field breaks one function and its canary (``tests/brevitas_adapter/test_adapter_introspection.py``), not every caller.

The Brevitas classes and quantizers the rest of the package uses by name are re-exported here too:
:data:`QuantLayer`, :class:`EqualizedModule`, :class:`StopFwdException` and ``generative_quantizers``
(the per-group / dynamic quantizers Brevitas ships in ``brevitas_examples`` rather than
``brevitas.quant``; the translation table takes them from here and from nowhere else).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from brevitas.nn.equalized_layer import EqualizedModule
from brevitas.nn.quant_layer import QuantNonLinearActLayer, QuantWeightBiasInputOutputLayer
from brevitas.proxy.float_parameter_quant import BiasFloatQuantProxyFromInjector, WeightFloatQuantProxyFromInjectorBase
from brevitas.proxy.float_runtime_quant import ActFloatQuantProxyFromInjectorBase, DynamicActFloatQuantProxyFromInjector
from brevitas.proxy.groupwise_float_runtime_quant import GroupwiseActFloatQuantProxyFromInjector
from brevitas.proxy.groupwise_int_runtime_quant import GroupwiseActQuantProxyFromInjector
from brevitas.proxy.parameter_quant import BiasQuantProxyFromInjectorBase, WeightQuantProxyFromInjectorBase
from brevitas.proxy.quant_proxy import QuantProxyFromInjector
from brevitas.proxy.runtime_quant import (
    ActQuantProxyFromInjectorBase,
    DynamicActQuantProxyFromInjector,
    TruncQuantProxyFromInjector,
)
from brevitas.utils.torch_utils import StopFwdException
from brevitas_examples.common.generative import quantizers as generative_quantizers
from torch import nn

from quark_brevitas.brevitas_adapter.rotation import RotatedInput

__all__ = [
    "FLOAT8_DTYPES",
    "EqualizedModule",
    "QuantActivation",
    "fused_activation",
    "QuantLayer",
    "QuantizerSite",
    "StopFwdException",
    "float8_dtype",
    "generative_quantizers",
    "groupwise_parts",
    "has_static_activation_quantizers",
    "injector_value",
    "input_quantizer",
    "is_dynamic_activation",
    "is_float_quantizer",
    "is_groupwise",
    "iter_quantizers",
    "plain_tensor",
    "quant_switched",
    "quantized_units",
    "quantizer_kind",
    "quantizer_names",
    "weight_quant_disabled",
    "weight_quantization_pairs",
]

#: Quantized layers with weight, bias, input and output quantizers (QuantLinear, QuantConv*, ...).
QuantLayer = QuantWeightBiasInputOutputLayer
#: Stand-alone activation quantizers (QuantReLU, QuantIdentity, ...): the graph backend's quantization points.
QuantActivation = QuantNonLinearActLayer



# ===================================================================== quantizers
class QuantizerSite(NamedTuple):
    """One quantizer proxy of a model and where it sits.

    ``layer_name``: the module holding it (``""`` for the model itself); ``attribute``: its attribute
    name on that module (``weight_quant``, ``input_quant``, ``q_scaled_quant``, ...); ``kind``:
    ``weight``, ``bias``, ``act``, ``trunc`` or ``other`` (:func:`quantizer_kind`); ``name``: the
    proxy's own qualified module name.
    """

    layer_name: str
    attribute: str
    kind: str
    proxy: QuantProxyFromInjector
    layer: nn.Module
    name: str

    @property
    def role(self) -> str:
        """``weight``, ``bias``, ``input``, ``output`` for the quantizers of weight/bias layers, else the
        attribute name without its ``_quant`` suffix."""
        return self.attribute.removesuffix("_quant")


def quantizer_kind(proxy: nn.Module) -> str:
    """``weight``, ``bias``, ``act`` (activations), ``trunc`` or ``other``."""
    if isinstance(proxy, WeightQuantProxyFromInjectorBase):
        return "weight"
    if isinstance(proxy, BiasQuantProxyFromInjectorBase | BiasFloatQuantProxyFromInjector):
        return "bias"
    if isinstance(proxy, TruncQuantProxyFromInjector):
        return "trunc"
    if isinstance(proxy, ActQuantProxyFromInjectorBase):
        return "act"
    return "other"


def iter_quantizers(model: nn.Module, *, enabled_only: bool = True) -> Iterator[QuantizerSite]:
    """Every quantizer proxy of ``model``, in module order (the one walk every module uses).

    With ``enabled_only`` (the default) proxies whose quantization is disabled are skipped. Proxies
    are not searched for nested proxies.
    """
    modules = dict(model.named_modules())
    for name, proxy in modules.items():
        if not isinstance(proxy, QuantProxyFromInjector):
            continue
        if enabled_only and not proxy.is_quant_enabled:
            continue
        layer_name, _, attribute = name.rpartition(".")
        yield QuantizerSite(layer_name, attribute, quantizer_kind(proxy), proxy, modules[layer_name], name)


def fused_activation(proxy: nn.Module) -> nn.Module:
    """The activation an activation proxy applies before quantizing (a QuantReLU's ReLU; ``Identity`` for a
    QuantIdentity): what the quantizer's range must cover is this function of the proxy's input."""
    fused = getattr(proxy, "fused_activation_quant_proxy", None)
    return getattr(fused, "activation_impl", None) or nn.Identity()


def quantizer_names(model: nn.Module) -> set[str]:
    """Qualified names of every quantizer proxy (enabled or not); their internals are Brevitas's."""
    return {site.name for site in iter_quantizers(model, enabled_only=False)}


def is_groupwise(proxy: nn.Module) -> bool:
    """Whether the proxy quantizes in groups (per-group or MX)."""
    return bool(getattr(proxy, "is_groupwise", False))


def is_dynamic_activation(proxy: nn.Module) -> bool:
    """Whether an activation quantizer computes its scale from each input at run time (dynamic per
    tensor / per token, per group, MX): it has nothing to calibrate and no ONNX QCDQ form."""
    dynamic = (DynamicActQuantProxyFromInjector, DynamicActFloatQuantProxyFromInjector,
               GroupwiseActQuantProxyFromInjector, GroupwiseActFloatQuantProxyFromInjector)
    return isinstance(proxy, dynamic)


def is_float_quantizer(proxy: nn.Module) -> bool:
    """Whether the proxy quantizes to a minifloat format (fp8, fp6, fp4, MXFP)."""
    return isinstance(proxy, WeightFloatQuantProxyFromInjectorBase | ActFloatQuantProxyFromInjectorBase
                      | BiasFloatQuantProxyFromInjector)


def injector_value(proxy: nn.Module, name: str, default: Any = None) -> Any:
    """A value of the proxy's quant injector (e.g. a bias's static ``bit_width``, the rounding
    ``float_to_int_impl``), or ``default`` if the injector does not define it."""
    injector = getattr(proxy, "quant_injector", None)
    if injector is None or name not in injector:
        return default
    return getattr(injector, name)


def groupwise_parts(quant_tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """``(value, scale, zero_point, group_dim, group_size)`` of a group-wise quant tensor, in its
    grouped layout (``[..., groups, group_size, ...]``): Brevitas keeps them in private fields."""
    zero_point = getattr(quant_tensor, "zero_point_", None)
    return (quant_tensor.value_, quant_tensor.scale_, zero_point, int(quant_tensor.group_dim),
            int(quant_tensor.group_size))


@contextlib.contextmanager
def quant_switched(proxy: nn.Module, disable: bool) -> Iterator[None]:
    """Set the proxy's ``disable_quant`` while the context lasts, then restore it: the weight grid reads a
    quantizer even inside :func:`~quark_brevitas.brevitas_adapter.modes.quantization_disabled`."""
    previous = proxy.disable_quant
    proxy.disable_quant = disable
    try:
        yield
    finally:
        proxy.disable_quant = previous


def weight_quant_disabled(proxy: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Pass the weight through ``proxy`` unquantized while the context lasts."""
    return quant_switched(proxy, True)


def has_static_activation_quantizers(model: nn.Module) -> bool:
    """Whether ``model`` has an enabled activation quantizer whose scale comes from calibration."""
    return any(site.kind == "act" and not is_dynamic_activation(site.proxy) for site in iter_quantizers(model))


# ===================================================================== float8
#: (exponent bits, mantissa bits, exponent bias) -> the torch dtype holding that fp8 format exactly
#: (OCP e4m3 / e5m2, and the FNUZ variants with their larger bias).
FLOAT8_DTYPES: dict[tuple[int, int, int], torch.dtype] = {
    (4, 3, 7): torch.float8_e4m3fn,
    (5, 2, 15): torch.float8_e5m2,
    (4, 3, 8): torch.float8_e4m3fnuz,
    (5, 2, 16): torch.float8_e5m2fnuz,
}


def float8_dtype(exponent_bits: int, mantissa_bits: int, *, fnuz: bool = False) -> torch.dtype | None:
    """The torch float8 dtype of an fp8 format (OCP unless ``fnuz``), or ``None`` if it has none."""
    bias = 2 ** (exponent_bits - 1) - 1 + int(fnuz)
    return FLOAT8_DTYPES.get((exponent_bits, mantissa_bits, bias))


# ===================================================================== analysis (quark_brevitas.analysis)
def quantized_units(model: nn.Module, quant_classes: Iterable[type]) -> dict[str, nn.Module]:
    """The layers the backend replaced, by the name the config hierarchy gives them: the outermost modules of
    one of ``quant_classes`` (the layer map's quantized classes), so the q/k/v projections of a quantized
    attention belong to the attention. A layer inside an ``EqualizedModule`` (activation equalization puts
    ``fc1`` behind a scale as ``fc1.layer``) is reported as the wrapper, under the wrapper's name: the name
    ``layer_quant_config``/``exclude`` use, and the module whose input is the model's own tensor.

    The analysis tools hook, toggle and re-run these units; the wrapper's ``layer`` attribute is Brevitas's.
    """
    classes = tuple(quant_classes)
    modules = dict(model.named_modules())
    units: dict[str, nn.Module] = {}
    for name, module in modules.items():
        if type(module) not in classes:
            continue
        if "" in units or any(name.startswith(unit + ".") for unit in units):
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = modules.get(parent_name) if name else None
        if isinstance(parent, EqualizedModule | RotatedInput) and attribute == "layer":
            name, module = parent_name, parent
        units[name] = module
    return units


def weight_quantization_pairs(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(float weight, quantized weight)`` of every enabled weight quantizer in ``module`` (one pair for a
    Linear or a convolution, one per projection for an attention), both in the weight's own layout.

    The quantized value is the dequantized quant tensor that the layer computes with (``quant_weight()``'s
    ``value``; group-wise quant tensors give it back in the weight's layout).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, QuantLayer) and layer.weight_quant.is_quant_enabled:
                pairs.append((layer.weight.detach(), plain_tensor(layer.quant_weight()).detach()))
    return pairs


def input_quantizer(module: nn.Module) -> nn.Module | None:
    """The quantizer of the input a quantized layer computes with: the ``input_quant`` proxy of the first
    weight layer inside ``module`` (the layer itself, or an attention's query projection). It is called
    whether enabled or not (disabled, it passes the tensor through), so a forward hook on it sees the input
    as the layer consumes it. ``None`` if ``module`` holds no such layer."""
    for layer in module.modules():
        if isinstance(layer, QuantLayer):
            return layer.input_quant
    return None


def plain_tensor(value: Any) -> Any:
    """The dequantized ``torch.Tensor`` of a Brevitas quant tensor; anything else unchanged."""
    from brevitas.quant_tensor import QuantTensor

    return value.value if isinstance(value, QuantTensor) else value
