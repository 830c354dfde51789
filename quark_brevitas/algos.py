"""Quark's Brevitas algorithm configs under Quark's module name (``quark.torch.extensions.brevitas.algos`` ->
``quark_brevitas.algos``), so code written for Quark runs after changing only its imports.

The classes are defined in :mod:`quark_brevitas.config.algorithms` (plain data, no torch); this module
re-exports the same objects. What running each algorithm does is in :mod:`quark_brevitas.algorithms`.
"""

from __future__ import annotations

from quark_brevitas.config.algorithms import (
    GPFA2Q,
    GPFQ,
    GPTQ,
    SCALING_LAYER_KEYS,
    ActivationEqualization,
    AlgoConfig,
    AlgorithmConfig,
    AWQConfig,
    BiasCorrection,
    CalibrateBatchNorm,
    GPTQConfig,
    Preprocess,
    PreQuantOptConfig,
    SmoothQuantConfig,
    registered,
)
from quark_brevitas.config.rotation import RotationConfig
from quark_brevitas.config.rounding import AutoRoundConfig, QronosConfig

__all__ = [
    "SCALING_LAYER_KEYS",
    "AWQConfig",
    "AutoRoundConfig",
    "ActivationEqualization",
    "AlgoConfig",
    "AlgorithmConfig",
    "BiasCorrection",
    "CalibrateBatchNorm",
    "GPFA2Q",
    "GPFQ",
    "GPTQ",
    "GPTQConfig",
    "PreQuantOptConfig",
    "QronosConfig",
    "Preprocess",
    "RotationConfig",
    "SmoothQuantConfig",
    "registered",
]
