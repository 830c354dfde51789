"""Exception types raised by quark_brevitas.

All of them subclass ``ValueError`` (bad input) so callers can catch one family; each message
names the field, module or batch at fault and says what is allowed.
"""

from __future__ import annotations


class QuarkBrevitasError(ValueError):
    """Base class of every error raised for bad input."""


class ConfigError(QuarkBrevitasError):
    """A configuration cannot be honoured. Raised before the model is touched.

    ``path`` names the offending field, e.g. ``global_quant_config.weight.bit_width``.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class CalibrationDataError(QuarkBrevitasError):
    """A calibration batch is malformed, non-finite, or rejected by the model.

    ``batch_index`` is the index of the batch at fault when the model rejected one (else ``None``);
    ``module`` the qualified name of the innermost module whose forward raised, when known (``""``: the model
    itself), so that the layer a quantized model cannot run can be named.
    """

    def __init__(self, message: str, *, batch_index: int | None = None, module: str | None = None) -> None:
        super().__init__(message)
        self.batch_index = batch_index
        self.module = module


class ModelError(QuarkBrevitasError):
    """The model cannot be quantized as asked (e.g. it has no parameters)."""


class CheckpointError(QuarkBrevitasError):
    """A checkpoint cannot be written, read, or does not fit the model it is loaded into (defined here, below
    every room, so that the block sources reading folders raise it without importing the checkpoint package;
    :mod:`quark_brevitas.checkpoint` re-exports it)."""


class UnsupportedArgumentError(ConfigError, TypeError):
    """A Quark 0.13 argument value quark_brevitas cannot honour (a ``ValueError`` and a ``TypeError``, as a wrong
    argument to the function would be). ``path`` is ``function(argument)``; the message says why and what is
    allowed. Defined here, below every room, because ``ModelQuantizer.freeze`` (the api) raises it as well as the
    Quark-compatibility functions."""

    def __init__(self, function: str, argument: str, value: object, why: str, allowed: str) -> None:
        super().__init__(f"{function}({argument})", f"{value!r} {why}; allowed: {allowed}")


class UnsupportedAlgorithmError(QuarkBrevitasError):
    """The installed Brevitas cannot run the requested algorithm."""


class NotPicklableError(QuarkBrevitasError, TypeError):
    """A quantized model was given to ``pickle`` / ``torch.save``, which cannot store its quantizers."""
