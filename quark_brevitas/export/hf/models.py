"""Hugging Face transformers on the export side: rebuilding a checkpoint's architecture and example token inputs.

``save_quantized`` records the class and config of a ``PreTrainedModel`` in the checkpoint's manifest
(:func:`quark_brevitas.checkpoint.huggingface_architecture`); :func:`float_model_from_record` turns that record
back into the float architecture (random weights: the checkpoint's state replaces them), so that
``quark-brevitas export CHECKPOINT`` needs no ``--model``. :func:`token_example` makes an example input of
token ids for a given shape (``--input-shape``), since a language model's first input is an index into its
vocabulary, not a float tensor. transformers is imported only when a record asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from quark_brevitas.brevitas_adapter import RotatedInput
from quark_brevitas.export.errors import ExportError
from quark_brevitas.extras import require


def _import(qualified: str) -> Any:
    module_name, _, name = qualified.rpartition(".")
    module = require(module_name, f"the checkpoint's model class {qualified!r}")
    try:
        return getattr(module, name)
    except AttributeError as exc:
        raise ExportError(f"cannot import {qualified!r} recorded in the checkpoint ({exc}); the installed "
                          f"{module_name.partition('.')[0]} lacks it (the checkpoint was written with another "
                          "version?)") from exc


def float_model_from_record(record: Mapping[str, Any]) -> nn.Module:
    """The float architecture of a manifest's ``huggingface`` record: ``Class(ConfigClass.from_dict(config))`` in
    eval mode, with the recorded attention implementation."""
    try:
        model_class, config_class = _import(record["class"]), _import(record["config_class"])
        config = config_class.from_dict(dict(record["config"]))
    except KeyError as exc:
        raise ExportError(f"the checkpoint's huggingface record lacks {exc}") from exc
    attention = record.get("attn_implementation")
    if attention:
        config._attn_implementation = attention
    return model_class(config).eval()


def token_example(model: nn.Module, shape: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
    """Random token ids of ``shape`` (batch, sequence) and a full attention mask for a model with a vocabulary
    (``config.vocab_size``); ``None`` for other models."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or len(shape) != 2:
        return None
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def refuse_online_rotations(model: nn.Module, format_name: str, prefix: str = "") -> None:
    """Formats whose loader rebuilds the model from its architecture (GGUF, compressed-tensors) cannot hold the
    online Hadamards RotationConfig puts in front of layers (R4, online R1): the loaded model would skip them and
    compute something else. Folded rotations (R1, R2) change only weights and are fine. ``prefix``: the name of
    ``model`` in the whole model (one block of a streamed checkpoint, with its trailing dot)."""
    online = [prefix + name for name, module in model.named_modules() if isinstance(module, RotatedInput)]
    if online:
        shown = ", ".join(online[:3]) + (f" and {len(online) - 3} more" if len(online) > 3 else "")
        raise ExportError(f"{format_name} cannot hold online Hadamard rotations (RotationConfig r4 / "
                          f"online_r1_rotation) at {shown}: its loader runs the model's own architecture without "
                          "them. Export to ONNX (export_onnx_qcdq), or quantize with folded rotations only "
                          "(RotationConfig(r1=True, r2=True, r4=False))")
