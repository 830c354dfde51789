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
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.cli.options import DEPLOY_FORMATS, CLIError

__all__ = ["DEPLOY_SUBFOLDERS", "is_streamed", "write_deploy_format", "write_next_to_checkpoint"]

logger = logging.getLogger("quark_brevitas.cli")

#: ``quantize --model OUT --export FORMAT``: the folder inside OUT the format is written to.
DEPLOY_SUBFOLDERS = {"onnx": "onnx", "gguf": "gguf", "compressed-tensors": "compressed-tensors", "quark": "quark"}


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
    """Write ``fmt`` (``gguf``, ``compressed-tensors`` or ``quark``) to the folder ``output`` from the checkpoint:
    block by block when ``model`` is ``None`` (a streamed checkpoint), else from the rebuilt quantized ``model``.
    Returns the file (GGUF) or folder written."""
    from quark_brevitas.export import export_gguf, export_safetensors
    from quark_brevitas.hf.export_streamed import export_gguf_streamed, export_safetensors_streamed
    from quark_brevitas.hf.lm import load_tokenizer

    if fmt not in DEPLOY_FORMATS:
        raise CLIError(f"format {fmt!r} is not a deployment format; choose one of {', '.join(DEPLOY_FORMATS)}")
    tokenizer_dir = _tokenizer_folder(checkpoint)
    if fmt == "gguf":
        gguf_tokenizer = tokenizer_dir if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file() \
            else None
        if model is None:
            return export_gguf_streamed(checkpoint, output, tokenizer_path=gguf_tokenizer, overwrite=overwrite)
        return export_gguf(model, output, tokenizer_path=gguf_tokenizer, overwrite=overwrite)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if model is None:
        return export_safetensors_streamed(checkpoint, output, fmt, tokenizer=tokenizer, overwrite=overwrite)
    return export_safetensors(model, output, fmt, tokenizer=tokenizer, overwrite=overwrite)


def write_next_to_checkpoint(fmt: str, checkpoint: Path) -> Path:
    """``quantize --model --export FORMAT``: write the format into ``checkpoint/<subfolder>`` (recorded as ours,
    so a rerun replaces it). Returns the file (ONNX, GGUF) or folder (compressed-tensors, Quark) written."""
    from quark_brevitas.checkpoint import read_checkpoint
    from quark_brevitas.outputs import add_folder

    info = read_checkpoint(checkpoint)
    model = None if is_streamed(info) and fmt != "onnx" else _rebuilt(checkpoint, info)
    written: list[Path] = []  # relative to the folder written

    def write(folder: Path) -> None:
        path = _write_onnx(model, checkpoint, folder) if fmt == "onnx" else \
            write_deploy_format(fmt, checkpoint, model, folder)
        written.append(path.relative_to(folder))

    target = add_folder(checkpoint, DEPLOY_SUBFOLDERS[fmt], write)
    return target / written[0]


def _rebuilt(checkpoint: Path, info: Any) -> nn.Module:
    """The quantized model of a Hugging Face checkpoint (streamed or in memory), rebuilt from what it records."""
    from quark_brevitas.checkpoint import load_quantized
    from quark_brevitas.export.hf import float_model_from_record
    from quark_brevitas.hf.streaming import load_pretrained_quantized

    if is_streamed(info):
        return load_pretrained_quantized(checkpoint)
    record = info.manifest.get("huggingface")
    if not record:
        raise CLIError(f"checkpoint {str(checkpoint)!r} records no Hugging Face model; GGUF, compressed-tensors and "
                       "Quark's format hold Hugging Face language models")
    return load_quantized(float_model_from_record(record), checkpoint)


def _write_onnx(model: nn.Module, checkpoint: Path, folder: Path) -> Path:
    """The quantized model as verified ONNX QCDQ (``folder/model.onnx``), traced with a sentence through the
    checkpoint's tokenizer."""
    from quark_brevitas.api import ModelExporter
    from quark_brevitas.cli.options import DEFAULT_TOKEN_SHAPE, EXAMPLE_TEXT
    from quark_brevitas.hf.lm import load_tokenizer

    tokenizer_dir = _tokenizer_folder(checkpoint)
    if tokenizer_dir is None:
        raise CLIError(f"checkpoint {str(checkpoint)!r} holds no tokenizer for the ONNX example input")
    encoded = load_tokenizer(tokenizer_dir)(EXAMPLE_TEXT, return_tensors="pt", truncation=True,
                                            max_length=DEFAULT_TOKEN_SHAPE[1])
    example = {key: value for key, value in encoded.items() if key in ("input_ids", "attention_mask")}
    path = folder / "model.onnx"
    report = ModelExporter(path).export_onnx_model(model, example)
    logger.info("Wrote %s (max |onnxruntime - PyTorch| %.2e)", path, report.max_abs_diff)
    return path
