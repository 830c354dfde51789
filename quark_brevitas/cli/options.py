"""What every subcommand shares: its error type, option parsers, defaults, reading the config a command is
given (``--config`` / ``--preset``) and checking an output folder before any work.

The argument parser (:mod:`quark_brevitas.cli.parser`) imports this module for ``--help``, so the config package
and :mod:`quark_brevitas.outputs` are imported by the functions that use them, not here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from quark_brevitas.errors import ConfigError, QuarkBrevitasError
from quark_brevitas.outputs import OutputError, reserve

if TYPE_CHECKING:
    from quark_brevitas.config import Config

logger = logging.getLogger("quark_brevitas.cli")


DEFAULT_OUTPUT = "quark_brevitas_output"


DEFAULT_MODEL = "quark_brevitas.cli.digits:DigitsCNN"


DEFAULT_ANALYSIS_OUTPUT = "quark_brevitas_analysis"


DEFAULT_AUTOCONFIG_OUTPUT = "quark_brevitas_autoconfig.yaml"


#: (batch, sequence) of the example input made for a Hugging Face checkpoint that stores none.
DEFAULT_TOKEN_SHAPE = (1, 16)


#: What a Hugging Face checkpoint's saved tokenizer turns into that example input.
EXAMPLE_TEXT = "The quick brown fox jumps over the lazy dog while seven small cats sleep near the warm red house."


ONNX_NAME = "digits_quant.onnx"


class CLIError(QuarkBrevitasError):
    """A command-line argument cannot be honoured (reported like any other user error)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def shape_option(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,1,8,8, got {text!r}")\
            from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,1,8,8, got {text!r}")
    return dims


def resolve_config(args: argparse.Namespace) -> tuple[Config, str]:
    """The Config asked for (file, preset or the default preset) and a label for it."""
    from quark_brevitas.config import Config
    from quark_brevitas.config.presets import DEFAULT_PRESET, MODEL_PRESETS, get_preset

    if args.config is not None:
        try:
            return Config.from_file(args.config), f"file {args.config}"
        except ConfigError as exc:
            if str(args.config) in str(exc):
                raise
            raise CLIError(f"{args.config}: {exc}") from exc
    name = args.preset if args.preset is not None else DEFAULT_PRESET
    model_config = None
    if name in MODEL_PRESETS and getattr(args, "model", None) is not None:
        import types

        config_file = Path(args.model) / "config.json"
        if config_file.is_file():  # the GGUF mixes' per-layer rules need the layer count
            import json

            model_config = types.SimpleNamespace(**json.loads(config_file.read_text(encoding="utf-8")))
    return get_preset(name, model_config), f"preset {name}"


def read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"{option} {path!r}: cannot read it as UTF-8 text ({exc})") from exc


def checked_output(path: str, option: str, overwrite: bool, sources: Sequence[str] = ()) -> Path:
    """``path`` if the run may write there (see :func:`quark_brevitas.outputs.check_output_dir`), checked before
    any work; the error names the command-line option."""
    from quark_brevitas.outputs import check_output_dir

    try:
        return check_output_dir(path, overwrite=overwrite, sources=sources)
    except OutputError as exc:
        raise CLIError(f"{option}: {exc}") from exc


@contextlib.contextmanager
def claimed(path: str | Path, option: str) -> Iterator[Path]:
    """Claim the output ``path`` for the whole command, before any work (:func:`quark_brevitas.outputs.reserve`:
    a second run on it is refused at once, an unwritable or full destination fails here); the error names the
    command-line option and the path as given."""
    with contextlib.ExitStack() as claim:
        try:
            claim.enter_context(reserve(path))
        except OutputError as exc:
            raise CLIError(f"{option}: {exc}") from exc
        yield Path(path)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
