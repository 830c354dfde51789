"""Corrections measured on the quantized model: bias correction and BatchNorm re-estimation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import AlgorithmHandler, SavedStructure, register
from quark_brevitas.brevitas_adapter import QuantLayer, bias_correction_mode, norm_correction_mode
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.algorithms import BiasCorrection, CalibrateBatchNorm


def _forward_in_mode(model: nn.Module, data: CalibrationData, name: str, mode: Any) -> nn.Module:
    model.eval()
    with torch.no_grad(), mode(model):
        data.forward(model, name)
    return model


@register(BiasCorrection)
class BiasCorrectionHandler(AlgorithmHandler):
    """Shifts each layer's bias by the mean output error; gives bias-free layers a bias."""

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        return _forward_in_mode(model, data, algo.name, bias_correction_mode)

    def restore(self, algo: Any, model: nn.Module, saved: SavedStructure) -> nn.Module:
        """Give each quantized layer that has no bias but a saved one a (zero) bias of the saved size."""
        for name, module in model.named_modules():
            shape = saved.tensors.get(f"{name}.bias" if name else "bias")
            if isinstance(module, QuantLayer) and module.bias is None and shape is not None:
                module.bias = nn.Parameter(torch.zeros(shape, dtype=module.weight.dtype, device=module.weight.device))
        return model


@register(CalibrateBatchNorm)
class CalibrateBatchNormHandler(AlgorithmHandler):
    """Re-estimates the running statistics of BatchNorm layers on the quantized model."""

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        return _forward_in_mode(model, data, algo.name, norm_correction_mode)
