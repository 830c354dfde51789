"""Exceptions raised by the ONNX export.

:class:`ExportError` is the base of every export failure (a model, argument or quantization format that
cannot be exported as asked); :class:`ExportArgumentError` is also a ``TypeError`` for arguments of the
wrong type, and :class:`ExportMismatchError` reports an exported file that disagrees with PyTorch by more
than the tolerance, carrying the numbers of its message.
"""

from __future__ import annotations

import pathlib

from quark_brevitas.errors import QuarkBrevitasError

# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


class ExportError(QuarkBrevitasError):
    """The model, the arguments or a quantization format cannot be exported as asked."""


class ExportArgumentError(ExportError, TypeError):
    """An argument has the wrong type (also a ``TypeError``)."""


class ExportMismatchError(ExportError):
    """The exported file disagrees with PyTorch by more than the tolerance.

    ``max_abs_diff``, ``tolerance`` and ``path`` carry the numbers of the message.
    """

    def __init__(self, message: str, *, max_abs_diff: float, tolerance: float, path: pathlib.Path) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff
        self.tolerance = tolerance
        self.path = path
