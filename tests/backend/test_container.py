"""The replaceable parts are wired with dependency-injector and can be overridden by users."""

from __future__ import annotations

import brevitas.nn as qnn
import pytest
import torch
from torch import nn

from quark_brevitas import (
    DEFAULT_LAYER_MAP,
    Config,
    Container,
    LayerMapping,
    ModelQuantizer,
    QLayerConfig,
    QTensorConfig,
)
from quark_brevitas.backend import LayerwiseBackend

CONFIG = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()),
                pre_quant_opt_config=[])


class MyLinear(nn.Linear):
    """A user layer: a subclass, so the exact-type default map leaves it in float."""


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MyLinear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_default_map_leaves_unknown_subclasses_in_float() -> None:
    quant = ModelQuantizer(CONFIG).quantize_model(model(), [torch.randn(4, 8)])
    assert type(quant[0]) is MyLinear and type(quant[2]) is qnn.QuantLinear


def test_layer_map_override_quantizes_a_user_layer() -> None:
    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, MyLinear: LayerMapping(qnn.QuantLinear)})
    float_model = model()
    quant = ModelQuantizer(CONFIG, container=container).quantize_model(float_model, [torch.randn(4, 8)])
    assert type(quant[0]) is qnn.QuantLinear
    assert quant[0].input_quant.is_quant_enabled
    assert torch.equal(quant[0].weight, float_model[0].weight)
    # A fresh container is unaffected by the override.
    assert MyLinear not in Container().layer_map()


def test_calibrator_override_is_used() -> None:
    calls = []

    def calibrator(model: nn.Module, loader) -> nn.Module:
        calls.append(len(loader))
        from quark_brevitas.calibration import calibrate

        return calibrate(model, loader)

    container = Container()
    container.calibrator.override(calibrator)
    ModelQuantizer(CONFIG, container=container).quantize_model(model(), [torch.randn(4, 8)] * 3)
    assert calls == [3]


def test_bad_layer_map_entries_are_rejected() -> None:
    with pytest.raises(TypeError, match="LayerMapping"):
        LayerwiseBackend({nn.Linear: qnn.QuantLinear})  # type: ignore[dict-item]


def test_user_layer_survives_the_default_preprocess() -> None:
    """Preprocess FX-traces the model; a user layer must stay a module so its mapping applies."""
    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, MyLinear: LayerMapping(qnn.QuantLinear)})
    default_pipeline = Config(global_quant_config=CONFIG.global_quant_config)
    float_model = model()
    quant = ModelQuantizer(default_pipeline, container=container).quantize_model(float_model, [torch.randn(4, 8)])
    assert [type(m) for m in quant.children()] == [qnn.QuantLinear, nn.ReLU, qnn.QuantLinear]
