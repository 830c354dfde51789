"""What a checkpoint records besides its tensors: file names, the manifest's parts (versions, dtypes, module
structure, FX code, the example input's description, the Hugging Face architecture) and the errors of reading one.
Read by the one checkpoint writer (:mod:`quark_brevitas.checkpoint.writer`), whichever sink it serves (a model in
memory, a block-by-block run), and by the loaders."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.brevitas_adapter import brevitas_version, is_graph_module, quantizer_names
from quark_brevitas.config import Config
from quark_brevitas.errors import CheckpointError
from quark_brevitas.version import __version__

__all__ = ["CHECKSUMS_KEY", "CONFIG_FILE", "EXAMPLE_FILE", "FLOAT_MODEL_DIR", "FORMAT", "FORMAT_VERSION",
           "MANIFEST_FILE", "REST_FILE", "WEIGHTS_FILE", "WEIGHTS_INDEX_FILE", "CheckpointError", "CheckpointInfo",
           "ExampleInput", "dtype_name", "example_tensors", "graph_code", "huggingface_architecture",
           "library_versions", "model_dtype_name", "module_structure", "state_tensors"]

FORMAT = "quark_brevitas.checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
EXAMPLE_FILE = "example_input.safetensors"
#: Manifest key: weight file name -> its SHA-256 when written (checkpoints before it have none and load unchecked).
CHECKSUMS_KEY = "checksums"
#: Subdirectory of a block-by-block checkpoint holding the float model's Hugging Face config (and the tokenizer).
FLOAT_MODEL_DIR = "float_model"
#: The file of a block-by-block checkpoint holding every tensor outside the block stack.
REST_FILE = "model-rest.safetensors"

#: A model's example input: a tensor, a tuple/list of positional tensors or a dict of keyword tensors.
ExampleInput = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]



@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`read_checkpoint` found in a checkpoint directory (the weights are not read)."""

    directory: Path
    config: Config
    manifest: dict[str, Any]
    example_input: ExampleInput | None



def huggingface_architecture(model: nn.Module) -> dict[str, Any] | None:
    """The class and config of a Hugging Face ``PreTrainedModel`` (``None`` for other models), recorded in the
    manifest so that ``quark-brevitas export`` can rebuild the float architecture with ``Class(config)`` and no
    ``--model`` argument; the attention implementation is kept (``sdpa`` / ``eager``)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)) or not hasattr(type(model), "config_class"):
        return None
    values = config.to_dict()
    attention = getattr(config, "_attn_implementation", None)
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
            "config": json.loads(json.dumps(values, default=str)),
            "attn_implementation": attention if isinstance(attention, str) else None}


def library_versions() -> dict[str, str]:
    return {"quark_brevitas": __version__, "brevitas": brevitas_version(), "torch": torch.__version__}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_dtype_name(model: nn.Module) -> str | None:
    """The dtype of the model's weights (its first floating parameter): a float16/bfloat16 model keeps its
    weights and activations in that dtype and its quantizers' scales and zero points in float32."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return dtype_name(dtype) if dtype is not None else None


def state_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict as detached, contiguous CPU tensors; tensors sharing memory are copied
    (safetensors refuses shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state_dict entry {key!r} is a {type(value).__name__}, not a tensor; "
                                  "only tensors can be stored in safetensors")
        tensor = value.detach().cpu().contiguous()
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if ident in seen and tensor.numel() > 0:
            tensor = tensor.clone()
        seen.add(ident)
        tensors[key] = tensor
    return tensors


def example_tensors(example: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest description, tensors to store) of an example input."""
    if isinstance(example, torch.Tensor):
        kind, named = "tensor", {"input": example}
    elif isinstance(example, tuple | list) and example and all(isinstance(t, torch.Tensor) for t in example):
        kind, named = "tuple", {f"input_{i}": t for i, t in enumerate(example)}
    elif (isinstance(example, Mapping) and example and all(isinstance(k, str) for k in example)
          and all(isinstance(t, torch.Tensor) for t in example.values())):
        kind, named = "dict", dict(example)
    else:
        raise CheckpointError(
            f"example_input must be a tensor, a non-empty tuple/list of tensors or a dict of tensors; "
            f"got {type(example).__name__}"
        )
    description = {
        "kind": kind,
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in named.items()],
    }
    return description, {n: t.detach().cpu().contiguous() for n, t in named.items()}


def module_structure(model: nn.Module) -> dict[str, str]:
    """Module name -> class name, in model order, not descending into Brevitas quantizers (their
    internals are covered by the state-dict keys)."""
    rows: dict[str, str] = {}
    proxies = quantizer_names(model)
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(".".join(parts[:i]) in proxies for i in range(1, len(parts))):
            continue
        rows[name] = type(module).__name__
    return rows


def graph_code(model: nn.Module) -> dict[str, str]:
    """The generated Python code of every FX graph module (torch's or Brevitas's backport)."""
    return {name: module.code for name, module in model.named_modules() if is_graph_module(module)}

