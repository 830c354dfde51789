"""The structure Brevitas gives quantized layers: equalized wrappers and parameter identity.

Activation equalization puts a layer behind a per-channel scale module (``EqualizedModule``), which a
checkpoint must rebuild before loading its scales; Brevitas's layer replacement makes new ``Parameter``
objects (breaking ties such as ``lm_head.weight is embed.weight``) and re-initialises a quantizer
whenever a weight is registered. The functions here build and rewire that structure; their canaries are
in ``tests/brevitas_adapter/test_adapter_structure.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from brevitas.graph.base import ModuleToModuleByInstance, load_old_module_state_dict
from brevitas.graph.utils import signature_keys
from brevitas.nn.equalized_layer import EqualizedModule
from brevitas.nn.quant_scale_bias import ScaleBias
from brevitas.proxy.parameter_quant import ParameterQuantProxyFromInjector
from brevitas.proxy.quant_proxy import QuantProxyFromInjector
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

__all__ = ["adopt_parameters", "attach_bias_quant", "equalized_scale_shape", "quant_layer_for", "swap_parameter",
           "wrap_equalized"]


# ===================================================================== equalized layers
def wrap_equalized(layer: nn.Module, num_features: int, runtime_shape: list[int]) -> nn.Module:
    """``layer`` behind a per-channel input scale module (what activation equalization inserts),
    with unit scales: the structure of an equalized layer, whose scales a state dict then fills."""
    return EqualizedModule(ScaleBias(num_features, bias=False, runtime_shape=tuple(runtime_shape)), layer)


def equalized_scale_shape(module: nn.Module) -> tuple[int, list[int]] | None:
    """``(num_features, runtime_shape)`` of an equalized layer's scale module; ``None`` otherwise."""
    if not isinstance(module, EqualizedModule):
        return None
    scale = module.scale
    return int(scale.num_features), [int(d) for d in scale.runtime_shape]


# ===================================================================== tied parameters
def adopt_parameters(new: nn.Module, old: nn.Module) -> None:
    """Give a freshly built quantized layer the float layer's own ``Parameter`` objects (same name,
    shape and dtype); its weight and bias quantizers are rebuilt around them.

    Brevitas's replacement loads the float layer's state into new ``Parameter`` objects that share its
    storage: a tie (``lm_head.weight is embed.weight``) silently becomes two parameters over one
    storage, which a weight-changing algorithm then edits together and an optimizer updates twice.
    Registering ``weight``/``bias`` on a Brevitas layer re-initialises its quantizer for the new
    tensor (``QuantWeightMixin.register_parameter``); nothing is initialised yet at this point, so
    nothing is lost.
    """
    kept_apart = getattr(new, "float_layout_differs", ())  # e.g. QuantConv1D holds Conv1D's weight transposed
    for name, param in old._parameters.items():
        current = new._parameters.get(name)
        if param is None or current is None or current is param or name in kept_apart:
            continue
        if current.shape == param.shape and current.dtype == param.dtype:
            setattr(new, name, param)


def quant_layer_for(old: nn.Module, quant_class: type[nn.Module], kwargs: dict[str, Any], name: str) -> nn.Module:
    """Brevitas's replacement of the float layer ``old`` by ``quant_class`` (quantizer keyword arguments
    ``kwargs``), holding ``old``'s own ``Parameter`` objects (:func:`adopt_parameters`).

    Brevitas builds the layer on the ``meta`` device, loads ``old``'s state dict into it (registering each
    parameter re-initialises its quantizer, and so does loading each quantizer's empty state) and then the
    parameters are adopted (a third initialisation): each weight quantizer is built four times, the last one
    being the one kept, which was a third of a 4-block Llama's layer replacement. For a plain layer (its state
    is its own parameters: no buffers, submodules, parametrizations or state-dict hooks, a layout shared with
    the quantized class), registering ``old``'s parameters on the built layer is what that load and adoption
    leave, with one initialisation of the weight and bias quantizers instead of three; the activation
    quantizers are then initialised again, as loading re-initialises them (with the weight in place). Other
    layers go through Brevitas's load."""
    plain = "device" in signature_keys(quant_class) and _plain_state(old) \
        and not getattr(quant_class, "float_layout_differs", ())
    if not plain:
        new = ModuleToModuleByInstance(old, quant_class, **kwargs).init_new_module(old, name=name)
        adopt_parameters(new, old)
        return new
    # What init_new_module builds before loading the state dict (with load_state_dict=True it picks meta too).
    new = ModuleToModuleByInstance(old, quant_class, **kwargs, device=torch.device("meta")).init_new_module(
        old, name=name, load_state_dict=False)
    if not _takes_parameters_of(new, old):
        load_old_module_state_dict(old, new, True)
        adopt_parameters(new, old)
        return new
    for param_name, param in old._parameters.items():
        if param is not None:
            setattr(new, param_name, param)  # the weight and bias quantizers are (re-)initialised for it
    for proxy in new.children():
        if isinstance(proxy, QuantProxyFromInjector) and not isinstance(proxy, ParameterQuantProxyFromInjector):
            training = proxy.training
            proxy.init_tensor_quant()
            proxy.train(training)
    return new


def _plain_state(module: nn.Module) -> bool:
    """Whether ``module``'s state dict is its own parameters and nothing else, read as they are."""
    return not module._modules and not module._buffers and not is_parametrized(module) \
        and not hasattr(module, "weight_orig") and not module._state_dict_hooks \
        and not getattr(module, "_state_dict_pre_hooks", None)


def _takes_parameters_of(new: nn.Module, old: nn.Module) -> bool:
    """Whether loading ``old``'s state into ``new`` only sets ``new``'s own parameters (the same names, shapes and
    dtypes; no load hooks in ``new`` that would do more)."""
    params = {name for name, param in old._parameters.items() if param is not None}
    if params != {name for name, param in new._parameters.items() if param is not None}:
        return False
    if any(new._parameters[name].shape != old._parameters[name].shape
           or new._parameters[name].dtype != old._parameters[name].dtype for name in params):
        return False
    return not any(module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
                   for module in new.modules())


def swap_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in place of ``module``'s parameter ``name`` (same shape) while keeping its quantizers'
    state: registering ``weight`` or ``bias`` on a Brevitas layer would re-initialise its quantizer and
    drop its scale, so the parameter table is written directly."""
    module._parameters[name] = param


def attach_bias_quant(layer: nn.Module, quant: Any, input_quant: nn.Module) -> None:
    """Give a Brevitas layer built without bias quantization the bias quantizer ``quant`` (an injector whose scale
    is input scale x weight scale) and ``input_quant`` (an existing activation quantizer proxy, shared, whose
    scale is that input scale): Brevitas's bias quantizer reads the input's scale from the layer's own input
    quantizer. Used by the graph backend, where a layer's input is quantized by a quantizer upstream."""
    training = layer.training
    layer.bias_quant = quant.proxy_class(layer, quant)
    layer.bias_quant.train(training)
    layer.input_quant = input_quant
