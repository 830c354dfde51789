"""SmoothQuant-style activation equalization with scale modules (Brevitas's layerwise equalization)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import AlgorithmHandler, SavedStructure, register
from quark_brevitas.brevitas_adapter import activation_equalization_mode, wrap_equalized
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.algorithms import ActivationEqualization

#: Class name of the wrapper activation equalization puts around a layer (as a checkpoint records it).
_WRAPPER = "EqualizedModule"


def _runtime_shape(layer: nn.Module, features: int) -> list[int]:
    """How the per-channel scale broadcasts over the layer's input: channels on dim 1 for convolutions,
    on the last dim otherwise (Linear, MultiheadAttention)."""
    spatial = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2,
               nn.ConvTranspose3d: 3}.get(type(layer))
    return [1, features, *[1] * spatial] if spatial is not None else [features]


@register(ActivationEqualization)
class ActivationEqualizationHandler(AlgorithmHandler):
    """Collects per-channel activation ranges on the calibration data, moves them into the weights and
    puts a scale module in front of each equalized layer (structure a checkpoint must recreate)."""

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        model.eval()
        with torch.no_grad(), activation_equalization_mode(model, alpha=algo.alpha):
            data.forward(model, algo.name)
        return model

    def restore(self, algo: Any, model: nn.Module, saved: SavedStructure) -> nn.Module:
        """Wrap every layer the checkpoint shows as equalized, with unit scales of the saved size."""
        for name, kind in saved.modules.items():
            if kind != _WRAPPER or not name:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = getattr(parent, child)
            features = saved.tensors[f"{name}.scale.weight"][0]
            setattr(parent, child, wrap_equalized(layer, features, _runtime_shape(layer, features)))
        return model
