"""Activation calibration: statistics for every static activation quantizer, on the pipeline's data."""

from __future__ import annotations

from torch import nn

from quark_brevitas.brevitas_adapter import calibration_mode, sampled_activation_mse
from quark_brevitas.calibration.data import CalibrationData

__all__ = ["calibrate"]


def calibrate(model: nn.Module, data: CalibrationData) -> nn.Module:
    """Run the calibration data through ``model`` in Brevitas's calibration mode (activation quantizers
    observe, scales are set on exit; dynamic quantizers keep quantizing) and return it in eval mode.

    MSE activation quantizers score their candidate scales on a random sample of 65,536 values of each
    batch (plus its minimum and maximum), see :func:`~quark_brevitas.brevitas_adapter.sampled_activation_mse`.
    """
    if not isinstance(data, CalibrationData):
        data = CalibrationData(data)
    model.eval()
    with calibration_mode(model), sampled_activation_mse(model):
        data.forward(model, "Calibration")
    return model
