"""Canary tests of the Brevitas internals the ONNX export relies on, through quark_brevitas.brevitas_adapter.

Each test exercises one adapter function against the installed Brevitas and fails with a message naming the
internal that changed, so that a Brevitas upgrade breaks here, in one obvious place, rather than deep inside
an export.
"""

from __future__ import annotations

import brevitas.nn as qnn
import pytest
import torch
from brevitas.export import export_onnx_qcdq
from brevitas.export.onnx.qonnx.manager import QONNXManager
from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from brevitas.proxy import ActQuantProxyFromInjector, WeightQuantProxyFromInjector
from brevitas.quant.scaled_int import Int8ActPerTensorFloat, Int8WeightPerTensorFloat
from torch import nn

from quark_brevitas.brevitas_adapter import (
    export_handler_proxy_types,
    generative_quantizers,
    groupwise_parts,
    reset_export_mode,
    weight_quant_disabled,
)


def _quant_linear(**kwargs: object) -> qnn.QuantLinear:
    torch.manual_seed(0)
    return qnn.QuantLinear(32, 4, bias=False, **kwargs).eval()


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
            self.layer = _quant_linear(weight_quant=Int8WeightPerTensorFloat, input_quant=Int8ActPerTensorFloat)

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


def test_groupwise_parts_rebuild_the_quantized_weight() -> None:
    layer = _quant_linear(weight_quant=generative_quantizers.IntWeightSymmetricGroupQuant.let(group_size=8))
    with torch.no_grad():
        qt = layer.quant_weight()
    value, scale, zero_point, group_dim, group_size = groupwise_parts(qt)
    assert (group_dim, group_size) == (1, 8), "Brevitas's group-wise quant tensor changed its group_dim/group_size"
    assert tuple(value.shape) == (4, 4, 8), (
        f"Brevitas's group-wise quant tensor keeps value_ as {tuple(value.shape)}, not [out, groups, group_size]; "
        "update brevitas_adapter.groupwise_parts (the blocked weight export reads it)"
    )
    codes = value / scale
    torch.testing.assert_close(codes, codes.round())
    assert zero_point is None or not bool(zero_point.any())
    torch.testing.assert_close(value.flatten(1, 2), qt.value)


def test_weight_quant_disabled_passes_the_float_weight() -> None:
    layer = _quant_linear(weight_quant=Int8WeightPerTensorFloat)
    with torch.no_grad(), weight_quant_disabled(layer.weight_quant):
        out = layer.weight_quant(layer.weight)
    value = getattr(out, "value", out)
    assert torch.equal(value, layer.weight), "Brevitas's proxy 'disable_quant' flag no longer bypasses quantization"
    with torch.no_grad():
        assert not torch.equal(layer.quant_weight().value, layer.weight), "weight_quant_disabled did not restore"
