"""The built-in formats' writers behind the one contract of :mod:`quark_brevitas.export.registry`.

Each function here only adapts arguments (the example input, the tokenizer folder, ``overwrite``) to the writer
that does the work (:func:`~quark_brevitas.export.onnx.qcdq.export_onnx_qcdq`,
:func:`~quark_brevitas.export.gguf.writer.
export_gguf`, ...); nothing is written differently from calling those directly. Why a contract: the command line
and :meth:`~quark_brevitas.api.ModelExporter.export` call every format the same way, so a new format needs no
branch in either. The writers from a checkpoint written block by block are in
:mod:`quark_brevitas.hf.export_streamed` (they rebuild its blocks, which takes the checkpoint room above this one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quark_brevitas.export.errors import ExportArgumentError

__all__ = ["gguf_tokenizer", "hf_tokenizer", "write_compressed_tensors", "write_gguf", "write_qcdq", "write_qonnx",
           "write_quark"]


def _example(example: Any, fmt: str) -> Any:
    if example is None:
        raise ExportArgumentError(f"format {fmt!r} is traced: pass the example input (example=, or ModelExporter's "
                                  "args)")
    return example


def _no_tokenizer(tokenizer_dir: Any, fmt: str) -> None:
    """ONNX files hold no tokenizer: one given is refused rather than silently dropped."""
    if tokenizer_dir is not None:
        raise ExportArgumentError(f"format {fmt!r} holds no tokenizer; tokenizer_dir does not apply")


def write_qcdq(model: Any, output: Any, *, example: Any = None, overwrite: bool = False, tokenizer_dir: Any = None,
               **options: Any) -> Any:
    """ONNX QCDQ verified in onnxruntime; returns the :class:`~quark_brevitas.export.ExportReport`. The file is
    replaced if it exists (``overwrite`` concerns folders)."""
    from quark_brevitas.export.onnx.qcdq import export_onnx_qcdq

    _no_tokenizer(tokenizer_dir, "qcdq")
    return export_onnx_qcdq(model, _example(example, "qcdq"), output, **options)


def write_qonnx(model: Any, output: Any, *, example: Any = None, overwrite: bool = False, tokenizer_dir: Any = None,
                **options: Any) -> Any:
    """QONNX verified with qonnx; returns the :class:`~quark_brevitas.export.QONNXExportReport`."""
    from quark_brevitas.export.onnx.qonnx import export_qonnx

    _no_tokenizer(tokenizer_dir, "qonnx")
    return export_qonnx(model, _example(example, "qonnx"), output, **options)


def gguf_tokenizer(tokenizer_dir: Any) -> Path | None:
    """GGUF reads the byte-level BPE of a ``tokenizer.json``; a folder without one gives no tokenizer."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None
    return Path(tokenizer_dir)


def _no_example(example: Any, fmt: str) -> None:
    if example is not None:
        raise ExportArgumentError(f"format {fmt!r} stores the weights; nothing is traced, so example does not apply")


def write_gguf(model: Any, output: Any, *, example: Any = None, overwrite: bool = False, tokenizer_dir: Any = None,
               **options: Any) -> Path:
    """``output/model.gguf``; returns its path."""
    from quark_brevitas.export.gguf.writer import export_gguf

    _no_example(example, "gguf")
    options.setdefault("tokenizer_path", gguf_tokenizer(tokenizer_dir))
    return export_gguf(model, output, overwrite=overwrite, **options)


def hf_tokenizer(tokenizer_dir: Any) -> Path | None:
    """The tokenizer folder, whose files the folder formats copy as they are and read back (not a loaded tokenizer:
    transformers would re-serialise it, and for some classes that is another tokenizer)."""
    return None if tokenizer_dir is None else Path(tokenizer_dir)


def _safetensors(fmt: str, model: Any, output: Any, example: Any, overwrite: bool, tokenizer_dir: Any,
                 options: dict[str, Any]) -> Path:
    from quark_brevitas.export.hf.checkpoints import export_safetensors

    _no_example(example, fmt)
    options.setdefault("tokenizer", hf_tokenizer(tokenizer_dir))
    return export_safetensors(model, output, fmt, overwrite=overwrite, **options)


def write_compressed_tensors(model: Any, output: Any, *, example: Any = None, overwrite: bool = False,
                             tokenizer_dir: Any = None, **options: Any) -> Path:
    return _safetensors("compressed-tensors", model, output, example, overwrite, tokenizer_dir, options)


def write_quark(model: Any, output: Any, *, example: Any = None, overwrite: bool = False, tokenizer_dir: Any = None,
                **options: Any) -> Path:
    return _safetensors("quark", model, output, example, overwrite, tokenizer_dir, options)
