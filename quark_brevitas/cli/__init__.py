"""The ``quark-brevitas`` command line: quantize, export and check the built-in digits CNN.

Subcommands:

- ``quantize``: train the digits CNN (seconds), quantize it with a preset or a config file, export
  it to ONNX QCDQ, run the file in onnxruntime on the test set and print a results table; the
  numbers also go to ``OUTPUT/report.json`` and the config used to ``OUTPUT/config.json``;
  ``--save-checkpoint DIR`` also saves the quantized model (see :mod:`quark_brevitas.checkpoint`).
  With ``--model DIR --calib-text FILE``: quantize a Hugging Face folder (a causal LM or an encoder)
  into the checkpoint ``OUTPUT`` instead, block by block when it is made of blocks, and report
  perplexity (or embedding cosine) before and after on held-out text (:mod:`quark_brevitas.hf.lm`);
  ``--export FORMAT`` also writes a format of the registry into ``OUTPUT/FORMAT/``.
- ``export``: rebuild a saved checkpoint and export it in any format of :mod:`quark_brevitas.export.registry`:
  traced formats (ONNX QCDQ, QONNX) verified against the rebuilt PyTorch model, formats that store weights
  (GGUF, compressed-tensors, Quark's) through :mod:`quark_brevitas.cli.deploy`, block by block for a checkpoint
  written block by block.
- ``plan``: which layers of the digits CNN a config quantizes, and how.
- ``presets``: the named configs ``--preset`` accepts.
- ``analyze``: where accuracy goes: the layer-by-layer comparison and the sensitivity ranking of a config,
  printed and written as JSON, CSV and PNG (see :mod:`quark_brevitas.analysis`).
- ``autoconfig``: a mixed-precision config (one candidate format per layer) under an average-weight-bits or
  bytes budget or a metric target, written as YAML for ``quantize --config`` and ``plan --config``.
- ``list formats|layers|families|algorithms|presets|candidates``: what this install can do, from the tables the
  code uses (:mod:`quark_brevitas.cli.listing`).

The parser (:mod:`quark_brevitas.cli.parser`) imports no torch: ``--help`` answers at once, and each command's
module is imported when it runs. Export formats and their help come from :mod:`quark_brevitas.export.registry`.

Bad user input (any :class:`~quark_brevitas.errors.QuarkBrevitasError` or export error) is
reported as ``error: <message>`` on stderr with exit status 2, without a traceback; anything else
is a bug and propagates. Ctrl-C (SIGINT) and SIGTERM stop a command with one line on stderr saying what was
kept and how to resume (rerun the same command) and exit status 130, without a traceback. Progress goes
through :mod:`logging` (``-v`` for debug, ``-q`` for warnings only); only the final table or listing is
printed to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from quark_brevitas.cli.parser import build_parser
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.outputs import final_paths

__all__ = ["main", "run_order_lines"]

logger = logging.getLogger("quark_brevitas.cli")


def __getattr__(name: str) -> Any:
    """``run_order_lines`` (of :mod:`~quark_brevitas.cli.plan`, which imports torch) on first use, so that
    importing this package, as ``quark-brevitas --help`` does, stays light."""
    if name == "run_order_lines":
        from quark_brevitas.cli.plan import run_order_lines

        return run_order_lines
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _command(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    """The subcommand's function: ``"module:function"`` imported now (the command runs), or a callable."""
    func = args.func
    if callable(func):
        return func
    module_name, _, attribute = func.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


class _FinalPaths(logging.Filter):
    """Every record names the output folder the user asked for, not the temporary sibling a run is written in
    (the ONNX exporter logs the file it wrote there): :func:`quark_brevitas.outputs.final_paths`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        rewritten = final_paths(message)
        if rewritten != message:
            record.msg, record.args = rewritten, None
        return True


#: Loggers of libraries that log routine progress at INFO.
_CHATTY_LIBRARIES = ("gguf", "gguf.gguf_writer")


@contextmanager
def _logging_setup(level: int) -> Iterator[None]:
    """Compact logging to stderr (and Python warnings through it) for the duration of one command."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(asctime)s %(levelname)-7s %(name)s: %(message)s" if level <= logging.DEBUG else \
        "%(asctime)s %(levelname)-7s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    handler.addFilter(_FinalPaths())  # a path inside a temporary output folder is logged as its final place
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    # Libraries' own progress chatter ("gguf: This GGUF file is for Little Endian only") is not the user's
    # business unless debugging; their warnings still come through.
    chatty = {name: logging.getLogger(name).level for name in _CHATTY_LIBRARIES}
    for name in chatty:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))
    # Python warnings (Brevitas's UserWarnings included) become log records on the same handler; the heavy
    # libraries are imported by the command, inside this block, so their import-time warnings are routed too.
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            if level > logging.DEBUG:
                # Deprecation notices from inside Brevitas/PyTorch are not actionable for the user.
                for category in (DeprecationWarning, FutureWarning):
                    warnings.filterwarnings("ignore", category=category, module=r"(brevitas|torch)(\.|$)")
            yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(previous_level)
        for name, previous in chatty.items():
            logging.getLogger(name).setLevel(previous)


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, then restore the previous setting.

    The digits CNN is far too small to profit from intra-op parallelism; on a busy 2-core machine two
    threads made evaluation and calibration 5-20x slower (OpenMP spin-waiting), see
    :func:`quark_brevitas.cli.digits.train_digits_cnn`.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    level = logging.INFO
    if getattr(args, "quiet", False):
        level = logging.WARNING
    elif getattr(args, "verbose", False):
        level = logging.DEBUG

    from quark_brevitas.export import ExportError

    threads = _torch_threads(1) if getattr(args, "uses_torch", True) else nullcontext()
    with _logging_setup(level), threads, _terminate_as_interrupt():
        try:
            return int(_command(args)(args))
        except (QuarkBrevitasError, ExportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"interrupted: {_resume_hint(args)}", file=sys.stderr)
            return INTERRUPTED


#: The exit status of a command stopped by SIGINT or SIGTERM (128 + SIGINT, as shells report Ctrl-C).
INTERRUPTED = 130


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a job scheduler, ``kill``, a container stopping) unwinds like Ctrl-C: the ``finally`` blocks of
    the outputs run (an unfinished run's ``.partial`` folder stays consistent, the output lock goes), instead
    of the process vanishing mid-write. Only the main thread may set handlers; elsewhere nothing changes."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resume_hint(args: argparse.Namespace) -> str:
    """What the interrupted command kept and how to go on: a streamed run keeps its finished blocks in
    ``OUTPUT.partial`` (the same command resumes there); every other command wrote nothing into its output."""
    output = getattr(args, "output", None)
    if output is None:
        return "nothing was written; rerun the same command to start again"
    partial = Path(output).with_name(Path(output).name + ".partial")
    if partial.is_dir():
        return (f"the finished work is kept in {str(partial)!r}; rerun the same command to resume "
                "(--no-resume starts over)")
    return f"{str(output)!r} is as it was before this run; rerun the same command to start again"


if __name__ == "__main__":
    sys.exit(main())
