"""plain_linear_forwards: switched-off quantized Linear layers give bit for bit Brevitas's switched-off output,
layers with a quantizer on are left alone, and the layers get their own forward back."""

from __future__ import annotations

import torch

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.brevitas_adapter import plain_linear_forwards, quantization_disabled
from quark_brevitas.types import QSchemeType


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False))
    spec = QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_group, group_size=32, bit_width=4),
                        input_tensors=QTensorConfig())
    calibration = [torch.randn(4, 64) for _ in range(2)]
    return ModelQuantizer(Config(spec)).quantize_model(model, calibration).eval()


def test_switched_off_layers_run_as_linear_with_the_same_bits() -> None:
    model = _model()
    inputs = torch.randn(5, 7, 64) * 3
    with torch.no_grad(), quantization_disabled(model):
        expected = model(inputs)
        with plain_linear_forwards(model.modules()) as changed:
            got = model(inputs)
        assert len(changed) == 2
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert not any("forward" in vars(module) for module in model.modules())
    with torch.no_grad():
        assert not torch.equal(model(inputs), expected)  # quantization is back on, through Brevitas's forward


def test_layers_with_a_quantizer_on_keep_brevitas_forward() -> None:
    model = _model()
    with plain_linear_forwards(model.modules()) as changed:
        assert changed == []
    with quantization_disabled(model, weight=False), plain_linear_forwards(model.modules()) as changed:
        assert changed == []
