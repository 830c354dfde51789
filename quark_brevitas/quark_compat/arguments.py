"""How the Quark 0.13 functions refuse an argument value quark_brevitas cannot honour: one error naming the function,
the argument, the value given, why, and what is allowed (:class:`~quark_brevitas.errors.UnsupportedArgumentError`,
defined below every room because ``ModelQuantizer.freeze`` raises it too), and which models they accept
(:func:`~quark_brevitas.pipeline.require_quantized`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quark_brevitas.errors import UnsupportedArgumentError
from quark_brevitas.pipeline import require_quantized

__all__ = ["UnsupportedArgumentError", "check_choice", "require_quantized"]


def check_choice(function: str, argument: str, value: Any, allowed: Iterable[Any], why: str) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (compared with ``==``; ``True`` is not ``1`` here)."""
    choices = list(allowed)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise UnsupportedArgumentError(function, argument, value, why, " or ".join(repr(c) for c in choices))
