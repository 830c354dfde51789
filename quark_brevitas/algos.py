"""Pre-quantization optimisations and post-quantization algorithms (Quark's Brevitas ``algos``), as data.

Each algorithm is a small dataclass (plain, serialisable data) with ``verify`` (its parameter rules,
called by config verification before any model is touched) and ``needs_data`` (whether it runs on
calibration data). Names and parameters follow ``quark.torch.extensions.brevitas.algos``. What running
an algorithm does lives in its handler (:mod:`quark_brevitas.algorithms`), which the pipeline finds
through a registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quark_brevitas.errors import ConfigError


@dataclass
class AlgorithmConfig:
    """Common base: the parameter checks and the registry of subclasses.

    ``config`` in :meth:`verify` is the :class:`~quark_brevitas.config.Config` being verified (typed
    ``Any`` here: this module sits below the config in the import graph).
    """

    name: ClassVar[str] = ""
    #: Whether the algorithm runs on calibration data (the pipeline then requires a calib_loader).
    needs_data: ClassVar[bool] = True

    def verify(self, config: Any, path: str) -> None:
        """Semantic checks of the parameters (their types are checked generically before this runs, by
        :mod:`quark_brevitas.verification`); subclasses add theirs."""


@dataclass
class PreQuantOptConfig(AlgorithmConfig):
    """An algorithm applied to the float model before quantization."""


@dataclass
class AlgoConfig(AlgorithmConfig):
    """An algorithm applied to the quantized, calibrated model."""


def _any_level_sets(config: Any, role: str) -> bool:
    """Whether some level of the hierarchy (global, layer type or layer name) quantizes ``role``."""
    levels = [config.global_quant_config, *config.layer_type_quant_config.values(),
              *config.layer_quant_config.values()]
    return any(getattr(level, role) is not None for level in levels)


def _uses_inputs(config: Any, path: str, what: str) -> None:
    if not _any_level_sets(config, "input_tensors"):
        raise ConfigError(path, f"{what} needs input_tensors quantization (at the global, layer-type or layer level)")


def _uses_weights(config: Any, path: str, what: str) -> None:
    if not _any_level_sets(config, "weight"):
        raise ConfigError(path, f"{what} needs weight quantization (at the global, layer-type or layer level)")


@dataclass
class Preprocess(PreQuantOptConfig):
    """Make the float model easier to quantize: FX trace, merge BatchNorm into the preceding
    convolution/linear, graph (weight) equalization and channel splitting.

    These steps need a graph. A model that cannot be FX-traced (most Hugging Face transformers) is
    passed through unchanged with one warning that says which steps were skipped and why, so the
    default pipeline still runs.
    """

    name: ClassVar[str] = "Pre-Processing"
    needs_data: ClassVar[bool] = False
    trace_model: bool = True
    equalize_iterations: int = 20
    equalize_merge_bias: bool = True
    merge_batch_norm: bool = True
    channel_splitting_ratio: float = 0.0
    channel_splitting_split_input: bool = False

    def verify(self, config: Any, path: str) -> None:
        super().verify(config, path)
        if self.equalize_iterations < 0:
            raise ConfigError(f"{path}.equalize_iterations", "must be >= 0")
        if not 0.0 <= self.channel_splitting_ratio < 1.0:
            raise ConfigError(f"{path}.channel_splitting_ratio", "must be in [0, 1)")


@dataclass
class ActivationEqualization(PreQuantOptConfig):
    """SmoothQuant-style activation equalization: migrate activation outliers into the weights
    (``alpha`` sets how much). ``is_layerwise`` must match the layerwise backend."""

    name: ClassVar[str] = "Activation Equalization"
    is_layerwise: bool = True
    alpha: float = 0.5

    def verify(self, config: Any, path: str) -> None:
        super().verify(config, path)
        if not self.is_layerwise:
            raise ConfigError(f"{path}.is_layerwise", "must be True with Backend.layerwise")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{path}.alpha", f"must be in [0, 1], got {self.alpha}")


@dataclass
class GPTQ(AlgoConfig):
    """GPTQ (Frantar et al.): per-layer weight rounding that compensates the error with the inverse
    Hessian of the layer inputs. ``act_order`` processes columns by decreasing activation energy."""

    name: ClassVar[str] = "GPTQ"
    act_order: bool = False

    def verify(self, config: Any, path: str) -> None:
        super().verify(config, path)
        _uses_weights(config, path, "GPTQ")


@dataclass
class GPFQ(AlgoConfig):
    """GPFQ (Lybrand & Saab; Zhang et al.): greedy path-following weight quantization that matches
    the float layer's output given the quantized inputs."""

    name: ClassVar[str] = "GPFQ"
    act_order: bool = False
    percentage_of_processed_inputs: float = 1.0

    def verify(self, config: Any, path: str) -> None:
        super().verify(config, path)
        _uses_weights(config, path, self.name)
        _uses_inputs(config, path, self.name)
        if self.percentage_of_processed_inputs != 1.0:
            raise ConfigError(
                f"{path}.percentage_of_processed_inputs",
                "the installed Brevitas (>= 0.12) always processes all inputs; only 1.0 is allowed",
            )


@dataclass
class GPFA2Q(GPFQ):
    """Accumulator-aware GPFQ (A2Q / AXE, Colbert et al.): GPFQ whose weights are constrained so
    that dot products never overflow an ``accumulator_bit_width``-bit accumulator."""

    name: ClassVar[str] = "GPFA2Q"
    accumulator_bit_width: int = 16

    def verify(self, config: Any, path: str) -> None:
        super().verify(config, path)
        if not 8 <= self.accumulator_bit_width <= 32:
            raise ConfigError(f"{path}.accumulator_bit_width", "must be in 8..32")


@dataclass
class BiasCorrection(AlgoConfig):
    """Bias correction (Nagel et al.): shift each layer's bias by the mean output error that
    quantization introduced, measured on the calibration data."""

    name: ClassVar[str] = "Bias Correction"


@dataclass
class CalibrateBatchNorm(AlgoConfig):
    """Re-estimate BatchNorm running statistics on the quantized model (for BatchNorm layers that
    were not merged, e.g. with ``Preprocess(merge_batch_norm=False)``)."""

    name: ClassVar[str] = "Calibrate Batch Norm"


def registered(base: type) -> list[type]:
    """All concrete algorithm classes deriving from ``base`` (for messages and deserialisation)."""
    found: list[type] = []
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls not in (PreQuantOptConfig, AlgoConfig):
            found.append(cls)
    return found


__all__ = [
    "ActivationEqualization",
    "AlgoConfig",
    "BiasCorrection",
    "CalibrateBatchNorm",
    "GPFA2Q",
    "GPFQ",
    "GPTQ",
    "PreQuantOptConfig",
    "Preprocess",
    "registered",
]
