"""Quark's observer classes by name, for code written for Quark 0.13 (``QTensorConfig(observer_cls=...)``).

Quark chooses calibration with an observer class; this library chooses it with ``param_type`` and Brevitas's own
statistics. These classes are markers with Quark's names, so that ``from quark.torch.quantization.observer.observer
import PerGroupMinMaxObserver`` becomes ``from quark_brevitas.config.observers import PerGroupMinMaxObserver``;
a spec keeps the class's name and :func:`~quark_brevitas.config.specs.resolve_dtype` spells it out in the fields it
implies (:data:`~quark_brevitas.config.formats.OBSERVER_FIELDS`). Observers without an equivalent are not offered
here (a spec naming one is refused with the reason, :data:`~quark_brevitas.config.formats.REJECTED_OBSERVERS`).
Plain data: importing this module needs neither torch nor Brevitas.
"""

from __future__ import annotations

__all__ = [
    "ObserverBase",
    "PerBlockMXBufferReuseObserver",
    "PerBlockMXObserver",
    "PerChannelMinMaxObserver",
    "PerChannelPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerTensorMSEObserver",
    "PerTensorMinMaxObserver",
    "PerTensorPercentileObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
]


class ObserverBase:
    """Base of the markers; never instantiated by this library."""


class PerTensorMinMaxObserver(ObserverBase):
    """``param_type=stats``, per tensor (static activations: the maximum)."""


class PerChannelMinMaxObserver(ObserverBase):
    """``param_type=stats``, per channel."""


class PerGroupMinMaxObserver(ObserverBase):
    """``param_type=stats``, per group."""


class PerTensorPowOf2MinMaxObserver(ObserverBase):
    """``param_type=stats``, per tensor, power-of-two scales."""


class PerChannelPowOf2MinMaxObserver(ObserverBase):
    """``param_type=stats``, per channel, power-of-two scales."""


class PerTensorPowOf2MinMSEObserver(ObserverBase):
    """``param_type=mse``, per tensor, power-of-two scales."""


class PerChannelPowOf2MinMSEObserver(ObserverBase):
    """``param_type=mse``, per channel, power-of-two scales."""


class PerTensorMSEObserver(ObserverBase):
    """``param_type=mse``, per tensor."""


class PerTensorPercentileObserver(ObserverBase):
    """``param_type=stats``, per tensor (static activations: ``percentile``, 99.999 by default)."""


class PerBlockMXObserver(ObserverBase):
    """OCP MX blocks (per group, power-of-two scales)."""


class PerBlockMXBufferReuseObserver(PerBlockMXObserver):
    """As :class:`PerBlockMXObserver` (Quark's memory-saving variant)."""
