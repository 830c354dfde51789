"""Quark's quantization enums under Quark's module name (``quark.torch.quantization.config.type`` ->
``quark_brevitas.types``), so code written for Quark runs after changing only its imports.

The enums are defined in :mod:`quark_brevitas.config.enums`; this module re-exports the same objects.
"""

from __future__ import annotations

from quark_brevitas.config.enums import (
    Backend,
    DeviceType,
    Dtype,
    ParamType,
    QSchemeType,
    QuantizationMode,
    QuantType,
    RoundType,
    ScaleType,
    TQTThresholdInitMeth,
    ZeroPointType,
)

__all__ = [
    "Backend",
    "DeviceType",
    "Dtype",
    "ParamType",
    "QSchemeType",
    "QuantType",
    "QuantizationMode",
    "RoundType",
    "ScaleType",
    "TQTThresholdInitMeth",
    "ZeroPointType",
]
