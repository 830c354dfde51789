"""Canaries of the adapter: equalized wrappers and parameter identity (quark_brevitas/brevitas_adapter/structure.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import brevitas.nn as qnn
import torch
from helpers.adapter_layers import quant_linear
from torch import nn

from quark_brevitas import brevitas_adapter as adapter


def test_equalized_module_structure() -> None:
    """Activation equalization wraps a layer in EqualizedModule(scale=ScaleBias(...), layer=...)."""
    wrapped = adapter.wrap_equalized(nn.Linear(8, 4), 8, [8])
    assert adapter.equalized_scale_shape(wrapped) == (8, [8])
    assert isinstance(wrapped.layer, nn.Linear) and wrapped.scale.weight.shape == (8,)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(wrapped(x), wrapped.layer(x))  # unit scales


def test_registering_a_weight_reinitialises_the_quantizer_and_swap_parameter_does_not() -> None:
    layer = quant_linear()
    layer.quant_weight()
    scaling = layer.weight_quant.tensor_quant.scaling_impl
    assert scaling.init_done
    adapter.swap_parameter(layer, "weight", nn.Parameter(layer.weight.detach().clone()))
    assert layer.weight_quant.tensor_quant.scaling_impl is scaling and scaling.init_done
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    assert not layer.weight_quant.tensor_quant.scaling_impl.init_done, \
        "QuantWeightMixin.register_parameter no longer re-initialises the quantizer: swap_parameter may be setattr"


def test_adopt_parameters_keeps_the_float_layers_parameters() -> None:
    from brevitas.graph.base import ModuleToModuleByInstance

    old = nn.Linear(8, 4)
    new = ModuleToModuleByInstance(old, qnn.QuantLinear).init_new_module(old)
    assert new.weight is not old.weight, "Brevitas's replacement now keeps the Parameter objects itself"
    adapter.adopt_parameters(new, old)
    assert new.weight is old.weight and new.bias is old.bias
    assert new.weight_quant.tracked_parameter_list[0] is old.weight
