"""Deployment formats from the command line: a saved checkpoint written as GGUF (llama.cpp, transformers'
``gguf_file=``) or as a compressed-tensors or AMD Quark folder (transformers, vLLM), and the ONNX / GGUF /
Hugging Face folder written next to a checkpoint by ``quantize --model DIR --export FORMAT``.

A checkpoint written block by block (``quantize --model`` on a decoder) is exported block by block too
(:mod:`quark_brevitas.hf.export_streamed`): the float model is never loaded. Any other checkpoint is rebuilt in
memory first. The tokenizer comes from the checkpoint's ``float_model/`` folder, where ``quantize --model``
saves it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.cli.options import CLIError
from quark_brevitas.export.registry import ExportFormat, format_names, get_format

__all__ = ["is_streamed", "write_deploy_format", "write_next_to_checkpoint"]

logger = logging.getLogger("quark_brevitas.cli")


def is_streamed(info: Any) -> bool:
    """Whether a checkpoint (its :func:`~quark_brevitas.checkpoint.read_checkpoint` description) was written
    block by block."""
    return isinstance(info.manifest.get("block_stack"), str)


def _tokenizer_folder(checkpoint: Path) -> Path | None:
    """The folder holding the tokenizer saved with a Hugging Face checkpoint (``float_model/`` or the checkpoint
    itself), or ``None``."""
    from quark_brevitas.hf.lm import TOKENIZER_FILES
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR

    for folder in (checkpoint / FLOAT_MODEL_DIR, checkpoint):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    return None


def write_deploy_format(fmt: str, checkpoint: Path, model: nn.Module | None, output: Path, *,
                        overwrite: bool = False) -> Path:
    """Write ``fmt`` (a format of :mod:`quark_brevitas.export.registry` that stores weights: GGUF,
    compressed-tensors, Quark's format, ...) to ``output`` from the checkpoint: block by block when ``model`` is
    ``None`` (a streamed checkpoint), else from the rebuilt quantized ``model``. Returns the path written."""
    row = get_format(fmt)
    if row.needs_example:
        raise CLIError(f"format {fmt!r} is traced with an example input, not written from the checkpoint's weights; "
                       f"these are: {', '.join(name for name in format_names() if not get_format(name).needs_example)}")
    tokenizer_dir = _tokenizer_folder(checkpoint)
    if model is None:
        return row.write_streamed(checkpoint, output, tokenizer_dir=tokenizer_dir, overwrite=overwrite)
    return row.write(model, output, tokenizer_dir=tokenizer_dir, overwrite=overwrite)


def write_next_to_checkpoint(fmt: str, checkpoint: Path) -> Path:
    """``quantize --model --export FORMAT``: write the format into ``checkpoint/FORMAT/`` (recorded as ours, so a
    rerun replaces it). Returns the file (ONNX, GGUF) or folder (compressed-tensors, Quark) written."""
    from quark_brevitas.checkpoint import read_checkpoint
    from quark_brevitas.outputs import add_folder

    row = get_format(fmt)
    info = read_checkpoint(checkpoint)
    model = None if is_streamed(info) and row.streamed_writer is not None else _rebuilt(checkpoint, info)
    written: list[Path] = []  # relative to the folder written

    def write(folder: Path) -> None:
        # A file format is written as FORMAT/model<suffix>, a folder format fills FORMAT/ itself.
        output = folder / f"model{row.suffix}" if row.layout == "file" else folder
        with _final_path_in_logs(folder, checkpoint / fmt):
            path = _write_traced(row, model, checkpoint, output) if row.needs_example else \
                write_deploy_format(fmt, checkpoint, model, output)
        written.append(Path(path).relative_to(folder))

    target = add_folder(checkpoint, fmt, write)
    return target / written[0]


@contextmanager
def _final_path_in_logs(temporary: Path, final: Path) -> Iterator[None]:
    """Log records emitted while a writer fills the temporary folder that :func:`~quark_brevitas.outputs.add_folder`
    renames into place name the final path instead: the user reads where the file *is*, not where it was built."""

    class Rename(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if str(temporary) in message:
                record.msg, record.args = message.replace(str(temporary), str(final)), ()
            return True

    rename = Rename()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(rename)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(rename)


def _rebuilt(checkpoint: Path, info: Any) -> nn.Module:
    """The quantized model of a Hugging Face checkpoint (streamed or in memory), rebuilt from what it records."""
    from quark_brevitas.checkpoint import load_quantized
    from quark_brevitas.export.hf.models import float_model_from_record
    from quark_brevitas.hf.streaming import load_pretrained_quantized

    if is_streamed(info):
        return load_pretrained_quantized(checkpoint)
    record = info.manifest.get("huggingface")
    if not record:
        raise CLIError(f"checkpoint {str(checkpoint)!r} records no Hugging Face model; GGUF, compressed-tensors and "
                       "Quark's format hold Hugging Face language models")
    return load_quantized(float_model_from_record(record), checkpoint)


def _write_traced(row: ExportFormat, model: nn.Module, checkpoint: Path, path: Path) -> Path:
    """The quantized model in a traced format at ``path`` (``model.onnx`` for ONNX QCDQ), verified, traced with a
    sentence through the checkpoint's tokenizer."""
    from quark_brevitas.api import ModelExporter
    from quark_brevitas.cli.options import DEFAULT_TOKEN_SHAPE, EXAMPLE_TEXT
    from quark_brevitas.hf.lm import load_tokenizer

    tokenizer_dir = _tokenizer_folder(checkpoint)
    if tokenizer_dir is None:
        raise CLIError(f"checkpoint {str(checkpoint)!r} holds no tokenizer for the ONNX example input")
    encoded = load_tokenizer(tokenizer_dir)(EXAMPLE_TEXT, return_tensors="pt", truncation=True,
                                            max_length=DEFAULT_TOKEN_SHAPE[1])
    example = {key: value for key, value in encoded.items() if key in ("input_ids", "attention_mask")}
    report = ModelExporter(path).export(row.name, model, example)
    if hasattr(report, "max_abs_diff"):
        logger.info("Wrote %s (max |%s - PyTorch| %.2e)", path, row.checked_with or row.label, report.max_abs_diff)
    return path
