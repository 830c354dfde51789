"""How the Quark 0.13 functions refuse an argument value quark_brevitas cannot honour: one error naming the function,
the argument, the value given, why, and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from quark_brevitas.errors import ConfigError, ModelError
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE

__all__ = ["UnsupportedArgumentError", "check_choice", "require_quantized"]


class UnsupportedArgumentError(ConfigError, TypeError):
    """A Quark 0.13 argument value quark_brevitas cannot honour (a ``ValueError`` and a ``TypeError``, as a wrong
    argument to the function would be). ``path`` is ``function(argument)``."""

    def __init__(self, function: str, argument: str, value: Any, why: str, allowed: str) -> None:
        super().__init__(f"{function}({argument})", f"{value!r} {why}; allowed: {allowed}")


def check_choice(function: str, argument: str, value: Any, allowed: Iterable[Any], why: str) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (compared with ``==``; ``True`` is not ``1`` here)."""
    choices = list(allowed)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise UnsupportedArgumentError(function, argument, value, why, " or ".join(repr(c) for c in choices))


def require_quantized(model: Any, function: str) -> nn.Module:
    """``model`` if it is a model ``ModelQuantizer.quantize_model`` (or a loader of ours) returned."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{function}: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, CONFIG_ATTRIBUTE, None) is None:
        raise ModelError(f"{function}: {type(model).__name__} was not quantized by quark_brevitas (it carries no "
                         "quark_brevitas config); pass the model ModelQuantizer(config).quantize_model returned")
    return model
