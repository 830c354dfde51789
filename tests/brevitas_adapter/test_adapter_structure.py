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


def _brevitas_replacement(old: nn.Module, quant_class: type, kwargs: dict, name: str) -> nn.Module:
    """The replacement quant_layer_for shortens: Brevitas's init_new_module (build on meta, load the state
    dict), then the float layer's parameters adopted."""
    from brevitas.graph.base import ModuleToModuleByInstance

    new = ModuleToModuleByInstance(old, quant_class, **kwargs).init_new_module(old, name=name)
    adapter.adopt_parameters(new, old)
    return new


def _weight_inits(monkeypatch, build, *args) -> tuple[nn.Module, int]:  # type: ignore[no-untyped-def]
    from brevitas.proxy.parameter_quant import WeightQuantProxyFromInjectorBase

    calls = []
    init = WeightQuantProxyFromInjectorBase.init_tensor_quant
    monkeypatch.setattr(WeightQuantProxyFromInjectorBase, "init_tensor_quant",
                        lambda self, *a, **k: (calls.append(self), init(self, *a, **k))[1])
    with adapter.ignore_missing_keys():  # as the backend builds (the float state has no quantizer state)
        layer = build(*args)
    monkeypatch.undo()
    return layer, len(calls)


def test_quant_layer_for_is_brevitas_replacement_with_fewer_weight_quantizer_inits(monkeypatch) -> None:
    """quant_layer_for builds a plain layer with the weight quantizer initialised twice (on meta, then for the
    float layer's weight) instead of Brevitas's four times (build, parameter loaded, quantizer state loaded,
    parameter adopted), and the layer is the same: parameters, quantizer state, outputs, with a calibrated
    input quantizer and a bias; ties kept (the float layer's own Parameter objects)."""
    from brevitas.quant import Int8ActPerTensorFloat, Int8WeightPerChannelFloat

    kwargs = {"weight_quant": Int8WeightPerChannelFloat, "input_quant": Int8ActPerTensorFloat,
              "return_quant_tensor": False}
    for make, quant_class in ((lambda: nn.Linear(16, 8), qnn.QuantLinear),
                              (lambda: nn.Linear(16, 8, bias=False), qnn.QuantLinear),
                              (lambda: nn.Conv2d(4, 6, 3), qnn.QuantConv2d)):
        torch.manual_seed(0)
        float_layer = make()
        float_layer.weight.requires_grad_(False)  # kept as the user had it
        args = (float_layer, quant_class, kwargs, "layer")
        reference, reference_inits = _weight_inits(monkeypatch, _brevitas_replacement, *args)
        built, inits = _weight_inits(monkeypatch, adapter.quant_layer_for, *args)
        assert reference_inits == 4 and inits == 2
        assert built.weight is float_layer.weight and not built.weight.requires_grad
        assert (built.bias is float_layer.bias) if float_layer.bias is not None else built.bias is None
        x = torch.randn(3, 16) if isinstance(float_layer, nn.Linear) else torch.randn(2, 4, 7, 7)
        outputs = []
        for layer in (reference, built):
            layer.train()
            with torch.no_grad():
                layer(x)  # the input quantizer's statistics
                layer.eval()
                outputs.append(layer(x))
        assert torch.equal(outputs[0], outputs[1])
        expected, got = reference.state_dict(), built.state_dict()
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_quant_layer_for_goes_through_brevitas_load_for_a_layer_with_more_state() -> None:
    """A layer whose state is more than its own parameters (a buffer here) is loaded by Brevitas, buffer
    included."""
    from brevitas.quant import Int8WeightPerTensorFloat

    float_layer = nn.Linear(8, 4)
    float_layer.register_buffer("weight_orig", float_layer.weight.detach().clone())
    with adapter.ignore_missing_keys():
        built = adapter.quant_layer_for(float_layer, qnn.QuantLinear, {"weight_quant": Int8WeightPerTensorFloat},
                                        "l")
    assert built.weight is float_layer.weight
    assert torch.equal(built.weight_orig, float_layer.weight_orig)
