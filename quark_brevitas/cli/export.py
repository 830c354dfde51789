"""``quark-brevitas export``: a saved checkpoint rebuilt (digits CNN, a Hugging Face model from its manifest,
or a streamed checkpoint) and exported to a verified ONNX QCDQ or QONNX file, or written as GGUF,
compressed-tensors or Quark's format (:mod:`quark_brevitas.cli.deploy`).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.api import ModelExporter
from quark_brevitas.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_TOKEN_SHAPE,
    EXAMPLE_TEXT,
    CLIError,
    claimed,
    first_line,
)
from quark_brevitas.cli.quantize import kib
from quark_brevitas.export.registry import get_format

logger = logging.getLogger("quark_brevitas.cli")


def _float_model(spec: str) -> nn.Module:
    """Call ``MODULE:CALLABLE`` (e.g. ``quark_brevitas.cli.digits:DigitsCNN``) for the float architecture."""
    import importlib
    import sys

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CLIError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. {DEFAULT_MODEL}")
    if "" not in sys.path and "." not in sys.path:  # the console script lacks it; ``python -m`` has it
        sys.path.insert(0, "")  # so a module in the current folder imports, as with ``python -m``
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module (ImportError, SyntaxError, ...)
        raise CLIError(f"--model {spec!r}: cannot import it ({type(exc).__name__}: {first_line(exc)})") from exc
    if not callable(factory):
        raise CLIError(f"--model {spec!r} is a {type(factory).__name__}, not a callable returning the float model")
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failed; say so in one line
        raise CLIError(f"--model {spec!r}: calling it failed ({type(exc).__name__}: {first_line(exc)}); it must "
                       "build the float architecture without arguments") from exc
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _check_example(model: nn.Module, example: Any, source: str, where: str) -> None:
    """A one-line error for an example input the model rejects (a wrong --input-shape)."""
    if isinstance(example, dict):
        inputs: tuple = tuple(example.values())
        call = lambda: model(**example)  # noqa: E731
    else:
        inputs = tuple(example) if isinstance(example, tuple | list) else (example,)
        call = lambda: model(*inputs)  # noqa: E731
    try:
        with torch.no_grad():
            call()
    except Exception as exc:  # noqa: BLE001 - any failure means the input does not fit the model
        shapes = ", ".join(str(list(t.shape)) for t in inputs)
        described = source if "shape" in source else f"{source}, shape {shapes}"
        hint = "; pass the shape the model takes" if where == "--input-shape" else ""
        raise CLIError(f"{where}: the model rejects the example input ({described}): "
                       f"{type(exc).__name__}: {first_line(exc)}{hint}") from exc


def _checkpoint_model(args: argparse.Namespace, info: Any) -> tuple[nn.Module, str]:
    """The quantized model of the checkpoint and where its architecture came from: ``--model``, else a Hugging
    Face checkpoint's recorded architecture (the class and config in the manifest, or ``float_model/`` of one
    written block by block by ``quantize --model``), else the digits CNN."""
    from quark_brevitas.checkpoint import load_quantized
    from quark_brevitas.export.hf.models import float_model_from_record
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR, load_pretrained_quantized

    record = info.manifest.get("huggingface")
    if args.model is not None:
        return load_quantized(_float_model(args.model), args.checkpoint), args.model
    if isinstance(info.manifest.get("block_stack"), str):
        model = load_pretrained_quantized(info.directory)
        return model, f"{type(model).__name__} from the checkpoint's {FLOAT_MODEL_DIR}/config.json"
    if record:
        model = load_quantized(float_model_from_record(record), args.checkpoint)
        return model, f"{record['class'].rsplit('.', 1)[-1]} from the checkpoint's config"
    return load_quantized(_float_model(DEFAULT_MODEL), args.checkpoint), DEFAULT_MODEL


def _tokenizer_example(directory: Path) -> tuple[dict[str, torch.Tensor], str] | None:
    """:data:`EXAMPLE_TEXT` through the tokenizer saved with a Hugging Face checkpoint (``float_model/`` or the
    checkpoint folder itself), at most :data:`DEFAULT_TOKEN_SHAPE` tokens; ``None`` if it saved none."""
    from quark_brevitas.hf.lm import TOKENIZER_FILES, load_tokenizer
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR

    for folder in (directory / FLOAT_MODEL_DIR, directory):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            tokenizer = load_tokenizer(folder)
            encoded = tokenizer(EXAMPLE_TEXT, return_tensors="pt", truncation=True,
                                max_length=DEFAULT_TOKEN_SHAPE[1])
            example = {key: value for key, value in encoded.items() if isinstance(value, torch.Tensor)}
            shape = list(example["input_ids"].shape)
            return example, f"a sentence through the tokenizer in {folder}, shape {shape}"
    return None


def _export_example(args: argparse.Namespace, info: Any, model: nn.Module) -> tuple[Any, str]:
    """The example input the export is traced and verified with, and a label for it: ``--input-shape``
    (random values, or random token ids for a model with a vocabulary), else the checkpoint's stored one,
    else for a Hugging Face language model a tokenized sentence or random token ids of
    :data:`DEFAULT_TOKEN_SHAPE` with a full attention mask."""
    from quark_brevitas.export.hf.models import token_example

    if args.input_shape is not None:
        tokens = token_example(model, args.input_shape)
        if tokens is not None:
            return tokens, f"random token ids, shape {list(args.input_shape)}"
        return (torch.randn(args.input_shape, generator=torch.Generator().manual_seed(0)),
                f"random, shape {list(args.input_shape)}")
    if info.example_input is not None:
        return info.example_input, "stored in the checkpoint"
    tokens = token_example(model, DEFAULT_TOKEN_SHAPE)
    if tokens is not None:
        return _tokenizer_example(info.directory) or \
            (tokens, f"random token ids, shape {list(DEFAULT_TOKEN_SHAPE)}, full attention mask")
    raise CLIError(f"checkpoint {args.checkpoint!r} stores no example input; pass --input-shape")


def cmd_export(args: argparse.Namespace) -> int:
    from quark_brevitas.checkpoint import read_checkpoint

    info = read_checkpoint(args.checkpoint)
    row = get_format(args.format)
    with claimed(args.output, "--output"):  # before the model is rebuilt: a busy or unwritable output fails first
        if not row.needs_example:
            return _export_deploy(args, info)
        return _export_onnx(args, info, row)


def _export_onnx(args: argparse.Namespace, info: Any, row: Any) -> int:
    model, model_source = _checkpoint_model(args, info)
    example, example_source = _export_example(args, info, model)
    where = "--input-shape" if args.input_shape is not None else f"checkpoint {args.checkpoint!r}"
    _check_example(model, example, example_source, where)
    start = time.perf_counter()
    report = ModelExporter(args.output).export(row.name, model, example)
    label, checker = row.label, row.checked_with or row.label
    if not hasattr(report, "max_abs_diff"):  # a registered format whose writer returns the path it wrote
        return _print_rows([("checkpoint", str(args.checkpoint)), ("model", model_source), ("format", label),
                            ("example input", example_source), ("written", str(report)),
                            ("time", f"{time.perf_counter() - start:.1f} s")])
    rows = [
        ("checkpoint", str(args.checkpoint)),
        ("model", model_source),
        ("format", f"{label}, opset {report.opset}"),
        ("file", f"{report.path}, {kib(report.file_size)}"),
        ("example input", example_source),
        (f"max |{checker} - PyTorch|", f"{report.max_abs_diff:.2e} (tolerance {report.tolerance:.2e}"
                                        + ("" if getattr(report, "verified_by", "outputs") == "outputs" else
                                           "; rounding flips, every quantizer verified pinned") + ")"),
        ("time", f"{time.perf_counter() - start:.1f} s"),
    ]
    return _print_rows(rows)


def _print_rows(rows: list[tuple[str, str]]) -> int:
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


def _export_deploy(args: argparse.Namespace, info: Any) -> int:
    """``export --format FORMAT`` of a format that stores weights (GGUF, compressed-tensors, Quark's, ...): block by
    block from a streamed checkpoint when the format has a block-by-block writer, else from the rebuilt model."""
    from quark_brevitas.cli.deploy import is_streamed, write_deploy_format

    if args.input_shape is not None:
        raise CLIError(f"--input-shape does not apply to --format {args.format} (nothing is traced)")
    streamed = is_streamed(info) and args.model is None and get_format(args.format).streamed_writer is not None
    model, model_source = (None, "rebuilt block by block") if streamed else _checkpoint_model(args, info)
    start = time.perf_counter()
    written = write_deploy_format(args.format, info.directory, model, Path(args.output), overwrite=args.overwrite)
    size = sum(p.stat().st_size for p in ([written] if written.is_file() else written.rglob("*")) if p.is_file())
    rows = [("checkpoint", str(args.checkpoint)), ("model", model_source), ("format", args.format),
            ("written", f"{written}, {kib(size)}"), ("time", f"{time.perf_counter() - start:.1f} s")]
    return _print_rows(rows)
