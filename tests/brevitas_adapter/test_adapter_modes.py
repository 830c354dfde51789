"""Canaries of the adapter: global flags, calibration / algorithm modes and export-mode clean-up
(quark_brevitas/brevitas_adapter/modes.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import pytest
import torch
from brevitas import config as brevitas_config
from brevitas.export import export_onnx_qcdq
from brevitas.export.onnx.qonnx.manager import QONNXManager
from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from brevitas.proxy import ActQuantProxyFromInjector, WeightQuantProxyFromInjector
from brevitas.quant.scaled_int import Int8ActPerTensorFloat, Int8WeightPerTensorFloat
from helpers.adapter_layers import export_linear, quant_linear
from torch import nn

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.brevitas_adapter import (
    export_handler_proxy_types,
    reset_export_mode,
)


@pytest.mark.parametrize("flag", ["IGNORE_MISSING_KEYS", "_FULL_STATE_DICT"])
def test_global_flags_exist(flag: str) -> None:
    assert hasattr(brevitas_config, flag), f"brevitas.config.{flag} is gone: checkpoint loading relies on it"
    context = adapter.ignore_missing_keys if flag == "IGNORE_MISSING_KEYS" else adapter.full_state_dict
    before = getattr(brevitas_config, flag)
    with context():
        assert getattr(brevitas_config, flag) is True
    assert getattr(brevitas_config, flag) == before


def test_full_state_dict_includes_uninitialised_activation_scales() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = quant_linear(act=QTensorConfig())
    plain = set(layer.state_dict())
    with adapter.full_state_dict():
        full = set(layer.state_dict())
    assert full > plain, "_FULL_STATE_DICT no longer adds uninitialised quantizer values to state_dict()"


def test_calibration_mode_keeps_dynamic_quantizers_quantizing() -> None:
    """Relies on the proxies' ``disable_quant`` and the observers' ``observer_only`` attributes."""
    from quark_brevitas.config import QTensorConfig

    layer = quant_linear(act=QTensorConfig(is_dynamic=True))
    flags = [m for m in layer.input_quant.modules() if hasattr(m, "observer_only")]
    assert hasattr(layer.input_quant, "disable_quant")
    x = torch.randn(3, 8)

    def value(t):
        return t.value if hasattr(t, "value") else t

    with torch.no_grad():
        quantized = value(layer.input_quant(x))
    assert not torch.equal(quantized, x)
    with torch.no_grad(), adapter.calibration_mode(layer):
        assert layer.input_quant.disable_quant is False
        assert all(m.observer_only is False for m in flags)
        inside = value(layer.input_quant(x))
    assert torch.equal(inside, quantized), "dynamic quantizers must quantize inside calibration mode"


def test_accumulator_aware_gpfq_ships_in_brevitas_examples() -> None:
    assert adapter.a2gpfq_available(), "brevitas_examples.common.axe.a2gpfq_mode is gone"


def test_gptq_mode_takes_create_weight_orig() -> None:
    layer = nn.Sequential(quant_linear())
    adapter.init_weight_scales(layer)
    with torch.no_grad(), adapter.gptq_mode(layer, act_order=False) as mode:
        for _ in range(mode.num_layers):
            layer(torch.randn(16, 8))
            mode.update()
    assert not hasattr(layer[0], "weight_orig"), "gptq_mode(create_weight_orig=False) kept a float copy"


def test_load_quant_model_mode_marks_loaded_scales_initialised() -> None:
    source = quant_linear()
    source(torch.randn(2, 8))
    target = quant_linear()
    with torch.no_grad():
        target.weight.mul_(3.0)
    with adapter.ignore_missing_keys(), adapter.load_quant_model_mode(target):
        target.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert torch.equal(target.quant_weight().value, source.quant_weight().value)


def test_quantization_disabled_on_a_layer_restores_each_quantizer_state() -> None:
    from quark_brevitas.config import QTensorConfig

    model = nn.Sequential(quant_linear(act=QTensorConfig()), quant_linear(act=QTensorConfig())).eval()
    model[0].input_quant.disable_quant = True  # a quantizer already off stays off afterwards
    with adapter.quantization_disabled(model[0]):
        assert not model[0].weight_quant.is_quant_enabled
        assert model[1].weight_quant.is_quant_enabled, "disabling one layer reached another"
    assert model[0].weight_quant.is_quant_enabled and model[0].input_quant.disable_quant is True


@pytest.mark.parametrize("manager", [StdQCDQONNXManager, QONNXManager], ids=lambda m: m.__name__)
def test_export_managers_list_the_proxies_they_handle(manager: type) -> None:
    handled = export_handler_proxy_types(manager)
    missing = {WeightQuantProxyFromInjector, ActQuantProxyFromInjector} - handled
    assert not missing, (
        f"Brevitas's {manager.__name__}.handlers no longer name {sorted(t.__name__ for t in missing)} in "
        "'handled_layer'; update brevitas_adapter.export_handler_proxy_types (the export's format checks use it)"
    )


def test_reset_export_mode_leaves_a_failed_export() -> None:
    class FailsWhenTraced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = export_linear(weight_quant=Int8WeightPerTensorFloat, input_quant=Int8ActPerTensorFloat)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.jit.is_tracing():
                raise RuntimeError("fails inside Brevitas's export")
            return self.layer(x)

    model = FailsWhenTraced().eval()
    model(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="fails inside"):
        export_onnx_qcdq(model, args=torch.randn(2, 32), export_path=None, dynamo=False, opset_version=13)
    leaked = [name for name, m in model.named_modules() if getattr(m, "export_mode", False)]
    assert leaked, "Brevitas no longer leaves 'export_mode' set after a failed export; is reset_export_mode needed?"
    reset_export_mode(model, StdQCDQONNXManager)
    still = [name for name, m in model.named_modules() if getattr(m, "export_mode", False)]
    assert not still, f"brevitas_adapter.reset_export_mode left export_mode set on {still}"
    assert not any(hasattr(m, "cache_inference_quant_act_backup") for m in model.modules())
    torch.testing.assert_close(model(torch.ones(1, 32)), model.layer(torch.ones(1, 32)))
