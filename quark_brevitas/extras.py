"""The one guard for optional dependencies: which pip extra installs which package, and the error that says so.

The base install (``pip install quark_brevitas``) has no transformers, accelerate, matplotlib or qonnx; each comes
with an extra (``[hf]``, ``[plot]``, ``[qonnx]``, ``[deploy]``, see ``pyproject.toml``). Code that needs one calls
:func:`require` instead of importing it directly, so that a user who lacks it reads which extra to install
instead of a bare ``ModuleNotFoundError`` (the command line reports it as ``error: ...`` with exit status 2).
:func:`available` answers the question without raising, for features that are skipped rather than refused
(the plots of ``quark-brevitas analyze``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from quark_brevitas.errors import QuarkBrevitasError

__all__ = ["EXTRAS", "MissingExtraError", "available", "install_hint", "require"]

#: Top-level package name -> the extra of ``pyproject.toml`` that installs it.
EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "accelerate": "hf",
    "tokenizers": "hf",
    "matplotlib": "plot",
    "qonnx": "qonnx",
    "gguf": "gguf",
    "compressed_tensors": "deploy",
}


class MissingExtraError(QuarkBrevitasError, ModuleNotFoundError):
    """An optional package is not installed. Also a ``ModuleNotFoundError``, so ``except ImportError`` written
    for the bare import still catches it; ``extra`` names the pip extra that installs it."""

    def __init__(self, message: str, *, name: str, extra: str | None) -> None:
        super().__init__(message)
        self.name = name
        self.extra = extra


def install_hint(name: str) -> str:
    """``pip install "quark_brevitas[EXTRA]"`` for a package an extra installs, else ``pip install NAME``."""
    top = name.partition(".")[0]
    extra = EXTRAS.get(top)
    return f'pip install "quark_brevitas[{extra}]"' if extra else f"pip install {top}"


def require(name: str, purpose: str) -> ModuleType:
    """Import ``name`` (a module of an optional package) or raise :class:`MissingExtraError` saying that
    ``purpose`` (e.g. ``"--model (a Hugging Face folder)"``) needs it and which extra installs it.

    Only a missing package is translated: an installed package that fails while importing is a broken
    install, and its own error propagates unchanged.
    """
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise  # the package is there but one of *its* dependencies is missing: show that error as it is
        raise MissingExtraError(f"{purpose} needs the {top!r} package, which is not installed; install it with "
                                f"{install_hint(name)}", name=top, extra=EXTRAS.get(top)) from exc


def available(name: str) -> bool:
    """Whether ``name`` can be imported (a missing or blocked package: False; a broken one raises)."""
    try:
        require(name, name)
    except MissingExtraError:
        return False
    return True
