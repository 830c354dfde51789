"""Named, ready-made quantization configs for the command line and quick experiments.

``get_preset("w8a8")`` returns a fresh :class:`~quark_brevitas.config.Config`; ``PRESETS`` maps each
name to the function that builds it and ``DESCRIPTIONS`` gives one line per preset. ``w8a8`` is the
command line's default. Every preset keeps the default pre-quantization step (``Preprocess``).
"""

from __future__ import annotations

from collections.abc import Callable

from quark_brevitas import algos
from quark_brevitas.config import Config, ParamType, QLayerConfig, QTensorConfig, QuantType
from quark_brevitas.errors import ConfigError
from quark_brevitas.types import QSchemeType

__all__ = ["DEFAULT_PRESET", "DESCRIPTIONS", "PRESETS", "get_preset"]

DEFAULT_PRESET = "w8a8"

_INT8 = QTensorConfig()  # int8 per-tensor symmetric, float scale from statistics
_INT32_BIAS = QTensorConfig(bit_width=32)
_FP8_E4M3 = QTensorConfig(quant_type=QuantType.float_quant, bit_width=8, exponent_bit_width=4, mantissa_bit_width=3)


def _w8a8() -> Config:
    return Config(QLayerConfig(weight=_INT8, input_tensors=_INT8, bias=_INT32_BIAS))


def _w8a8_per_channel() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel)
    return Config(QLayerConfig(weight=weight, input_tensors=_INT8, bias=_INT32_BIAS))


def _w4a8_gptq() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)
    return Config(QLayerConfig(weight=weight, input_tensors=_INT8, bias=_INT32_BIAS), algo_config=[algos.GPTQ()])


def _w4_weight_only() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4, param_type=ParamType.mse)
    return Config(QLayerConfig(weight=weight))


def _fp8() -> Config:
    # No bias quantization: an integer bias needs integer input and weight scales.
    return Config(QLayerConfig(weight=_FP8_E4M3, input_tensors=_FP8_E4M3))


PRESETS: dict[str, Callable[[], Config]] = {
    "w8a8": _w8a8,
    "w8a8_per_channel": _w8a8_per_channel,
    "w4a8_gptq": _w4a8_gptq,
    "w4_weight_only": _w4_weight_only,
    "fp8": _fp8,
}

DESCRIPTIONS: dict[str, str] = {
    "w8a8": "int8 per-tensor weights, int8 per-tensor inputs, int32 bias (default)",
    "w8a8_per_channel": "int8 per-channel weights, int8 per-tensor inputs, int32 bias",
    "w4a8_gptq": "int4 per-channel weights rounded by GPTQ, int8 inputs, int32 bias",
    "w4_weight_only": "int4 per-channel weights with MSE scales; activations stay float",
    "fp8": "fp8 e4m3 per-tensor weights and inputs; bias stays float",
}


def get_preset(name: str) -> Config:
    """A fresh Config for preset ``name``; :class:`ConfigError` listing the presets if unknown."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ConfigError("", f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}") from None
    return build()
