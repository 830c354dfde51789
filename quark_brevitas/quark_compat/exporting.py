"""Quark 0.13's export functions: ``export_safetensors``, ``export_onnx`` and ``export_gguf`` (``from quark.torch
import ...``), with Quark's arguments, on quark_brevitas's exporters (each proves the file it writes).

- ``export_safetensors(model, output_dir, custom_mode="quark", weight_format=None, pack_method="reorder")`` writes
  Quark's own Hugging Face format (:mod:`quark_brevitas.export.hf.quark`: ``real_quantized``, ``reorder``), which
  transformers with amd-quark and vLLM load, and beside it, in ``quark_brevitas_checkpoint/``, the quark_brevitas
  checkpoint (:func:`~quark_brevitas.checkpoint.save_quantized`) from which
  :func:`~quark_brevitas.quark_compat.importing.import_model_from_safetensors` rebuilds the quantized model exactly.
- ``export_onnx(model, output_dir, input_args, ...)`` writes ``output_dir/quark_model.onnx`` as ONNX QCDQ for
  onnxruntime (:func:`~quark_brevitas.export.export_onnx_qcdq`), verified against the model.
- ``export_gguf(model, output_dir, model_type, tokenizer_path)`` writes ``output_dir/model.gguf``
  (:func:`~quark_brevitas.export.export_gguf`; Quark names it ``<model_type>.gguf``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.checkpoint import save_quantized
from quark_brevitas.outputs import add_folder
from quark_brevitas.quark_compat.arguments import UnsupportedArgumentError, check_choice, require_quantized

__all__ = ["CHECKPOINT_FOLDER", "ONNX_FILE", "export_gguf", "export_onnx", "export_safetensors"]

logger = logging.getLogger(__name__)

#: The folder, inside an ``export_safetensors`` folder, holding the quark_brevitas checkpoint of the same model.
CHECKPOINT_FOLDER = "quark_brevitas_checkpoint"
#: The file ``export_onnx`` writes in its ``output_dir`` (Quark's name).
ONNX_FILE = "quark_model.onnx"
_OTHER_FORMATS = ("its other custom modes (AutoAWQ's layout, the fp8 layout for vLLM) are not written; Quark's "
                  "format is read by transformers with amd-quark and vLLM, and compressed-tensors by transformers "
                  "and vLLM (quark_brevitas.export.export_safetensors(model, dir, format='compressed-tensors'))")


def export_safetensors(model: nn.Module, output_dir: str | os.PathLike[str], custom_mode: str = "quark",
                       weight_format: str | None = None, pack_method: str = "reorder", *, tokenizer: Any = None,
                       overwrite: bool = False, checkpoint: bool = True) -> Path:
    """Write the quantized Hugging Face ``model`` in Quark 0.13's format to ``output_dir`` (Quark's signature);
    returns the folder.

    Quark's arguments: ``custom_mode`` ``"quark"`` (the format Quark recommends; ``"awq"`` / ``"fp8"`` are refused),
    ``weight_format`` ``None`` or ``"real_quantized"`` (packed integer codes; ``"fake_quantized"`` is refused) and
    ``pack_method`` ``"reorder"`` (``"order"`` is refused). quark_brevitas's additions, keyword-only: ``tokenizer``
    (saved beside the model), ``overwrite`` (see :mod:`quark_brevitas.outputs`) and ``checkpoint`` (``True``: also
    write the checkpoint ``import_model_from_safetensors`` rebuilds the model from, in ``quark_brevitas_checkpoint/``;
    it holds the float weights and quantizer state, about the size of the float model).
    """
    from quark_brevitas.export.hf.checkpoints import export_safetensors as write_hf_folder

    function = "export_safetensors"
    check_choice(function, "custom_mode", custom_mode, ["quark"], f"is one of Quark's modes that is not written here: "
                 f"{_OTHER_FORMATS}")
    check_choice(function, "weight_format", weight_format, [None, "real_quantized"],
                 "(Quark's QDQ layout: float weights that are already rounded) is not written; Quark's real_quantized "
                 "layout holds the integer codes, scales and zero points")
    check_choice(function, "pack_method", pack_method, ["reorder"], "is not written; 4-bit codes are packed in Quark's "
                 "default 'reorder' nibble order, which Quark's importer, transformers and vLLM read")
    check_choice(function, "checkpoint", checkpoint, [True, False], "is not a bool")
    model = require_quantized(model, function)
    directory = write_hf_folder(model, output_dir, format="quark", tokenizer=tokenizer, overwrite=overwrite)
    if checkpoint:
        add_folder(directory, CHECKPOINT_FOLDER, lambda work: save_quantized(model, work))
    return directory


@contextlib.contextmanager
def _verbose(verbose: bool) -> Iterator[None]:
    """``verbose=True``: the export's steps logged at DEBUG level are shown while it runs."""
    exporter = logging.getLogger("quark_brevitas.export")
    level = exporter.level
    if verbose:
        exporter.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        exporter.setLevel(level)


def export_onnx(model: nn.Module, output_dir: str | os.PathLike[str], input_args: Any,
                opset_version: int | None = None, input_names: Sequence[str] | None = None,
                output_names: Sequence[str] | None = None, verbose: bool = False, do_constant_folding: bool = True,
                operator_export_type: Any = None, uint4_int4_flag: bool = False, dynamo: bool = False) -> Any:
    """Write ``output_dir/quark_model.onnx`` (Quark's signature and file name) as verified ONNX QCDQ; returns the
    :class:`~quark_brevitas.export.ExportReport`.

    ``input_args``: a tensor, a tuple of tensors or a dict of keyword tensors. ``opset_version``: as
    :func:`~quark_brevitas.export.export_onnx_qcdq`'s ``opset`` (``None``: the lowest that holds the model).
    ``verbose``: show the export's debug log. ``uint4_int4_flag``: either value; 4-bit weights are stored in 4-bit
    types (``INT4``/``UINT4`` or onnxruntime's ``MatMulNBits``) in every case. Refused: ``input_names`` /
    ``output_names`` (the graph's inputs are named after a dict's keys, else ``input``, ``input_0``, ...),
    ``do_constant_folding=False``, an ``operator_export_type`` other than ``ONNX`` and ``dynamo=True``.
    """
    from quark_brevitas.export.onnx.qcdq import export_onnx_qcdq

    function = "export_onnx"
    if input_names or output_names:
        argument = "input_names" if input_names else "output_names"
        raise UnsupportedArgumentError(function, argument, list(input_names or output_names or []),
                                       "cannot be chosen: graph inputs are named after the keys of a dict input_args "
                                       "(e.g. {'input_ids': ...}), else input / input_0, input_1, ...; outputs after "
                                       "the model's", "[] or None")
    check_choice(function, "verbose", verbose, [False, True], "is not a bool")
    check_choice(function, "do_constant_folding", do_constant_folding, [True], "is not offered: the exported graph "
                 "is always folded (constant weights are stored as integer initializers)")
    if operator_export_type is not None and getattr(operator_export_type, "name", None) != "ONNX":
        raise UnsupportedArgumentError(function, "operator_export_type", str(operator_export_type),
                                       "is not offered: the file holds standard ONNX operators (and onnxruntime's "
                                       "com.microsoft ones)", "torch.onnx.OperatorExportTypes.ONNX or None")
    check_choice(function, "uint4_int4_flag", uint4_int4_flag, [False, True], "is not a bool")
    check_choice(function, "dynamo", dynamo, [False], "is not offered: Brevitas exports through TorchScript "
                 "(torch.onnx.export with dynamo=False)")
    if not uint4_int4_flag:
        logger.info("export_onnx: uint4_int4_flag=False; 4-bit weights are stored in 4-bit types all the same")
    args = tuple(input_args) if isinstance(input_args, list) else input_args
    with _verbose(verbose):
        return export_onnx_qcdq(model, args, Path(output_dir) / ONNX_FILE, opset=opset_version)


def export_gguf(model: nn.Module, output_dir: str | os.PathLike[str], model_type: str,
                tokenizer_path: str | os.PathLike[str]) -> Path:
    """Write ``output_dir/model.gguf`` for llama.cpp (Quark's signature; Quark's file is ``<model_type>.gguf``);
    returns its path. ``model_type`` (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"gpt2"``) and ``tokenizer_path`` (a
    folder with ``tokenizer.json``) as :func:`quark_brevitas.export.export_gguf` takes them; what GGUF cannot hold is
    an ExportError naming the layer."""
    from quark_brevitas.export.gguf.writer import export_gguf as write_gguf

    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedArgumentError("export_gguf", "model_type", model_type, "is not a model type",
                                       "'llama', 'mistral', 'qwen2' or 'gpt2'")
    return write_gguf(model, output_dir, model_type=model_type, tokenizer_path=tokenizer_path)
