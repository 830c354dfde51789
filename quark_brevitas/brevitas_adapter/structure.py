"""The structure Brevitas gives quantized layers: equalized wrappers and parameter identity.

Activation equalization puts a layer behind a per-channel scale module (``EqualizedModule``), which a
checkpoint must rebuild before loading its scales; Brevitas's layer replacement makes new ``Parameter``
objects (breaking ties such as ``lm_head.weight is embed.weight``) and re-initialises a quantizer
whenever a weight is registered. The functions here build and rewire that structure; their canaries are
in ``tests/brevitas_adapter/test_adapter_structure.py``.
"""

from __future__ import annotations

from brevitas.nn.equalized_layer import EqualizedModule
from brevitas.nn.quant_scale_bias import ScaleBias
from torch import nn

__all__ = ["adopt_parameters", "equalized_scale_shape", "swap_parameter", "wrap_equalized"]


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


def swap_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in place of ``module``'s parameter ``name`` (same shape) while keeping its quantizers'
    state: registering ``weight`` or ``bias`` on a Brevitas layer would re-initialise its quantizer and
    drop its scale, so the parameter table is written directly."""
    module._parameters[name] = param
