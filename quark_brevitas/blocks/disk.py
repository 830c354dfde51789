"""Block sources on disk, for models larger than memory: a Hugging Face folder's model without its weights
(:func:`load_skeleton`, everything on the ``meta`` device), its layers outside the blocks read in
(:func:`materialise_outside`), float blocks read from its safetensors files just before they run
(:class:`FolderBlocks`), the file names of a block-by-block checkpoint's blocks (:func:`block_file`) and
placeholder values for a skeleton's parameters (:func:`random_fill`). The quantized blocks of a block-by-block
checkpoint, which need the checkpoint reader and the pipeline's structure phase, are a block source one room up
(:class:`quark_brevitas.checkpoint.streamed_blocks.CheckpointBlocks`). The orchestrator
(:func:`quark_brevitas.orchestration.block_runs.run_blocks`) drives them through the block engine like any other
source.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.blocks.protocol import BlockStep
from quark_brevitas.blocks.sources import BlockPlaceholder, BlockSource
from quark_brevitas.errors import CheckpointError
from quark_brevitas.extras import require
from quark_brevitas.model_parts.moe import unfuse_experts

__all__ = ["SAFETENSORS_DTYPES", "FolderBlocks", "FolderWeights", "block_file", "load_skeleton", "materialise",
           "materialise_outside", "meta_parameters", "random_fill",
           "safetensors_header", "tie_embeddings"]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def block_file(index: int) -> str:
    return f"model-block-{index:05d}.safetensors"



def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """``(offset of the data, header)`` of a safetensors file: an 8-byte little-endian header length, then
    the JSON header naming each tensor's dtype, shape and byte range."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


#: Other spellings of a model's tensor names in checkpoints on disk, tried when a folder lacks the name itself:
#: transformers 5.x renames a checkpoint's tensors as it loads them, and a skeleton whose experts were unfused
#: (quark_brevitas.model_parts.moe) names them as the unfused layers do (``mlp.experts.3.gate_proj.weight``), which
#: is the spelling of Qwen2/3-MoE checkpoints; Mixtral's checkpoints (and ``save_pretrained``'s folders of a
#: Mixtral) say ``block_sparse_moe`` for the MLP and ``w1`` / ``w3`` / ``w2`` for an expert's gate / up / down
#: projections.
_CHECKPOINT_SPELLINGS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r"\.mlp\.(experts\.\d+)\.(gate_proj|up_proj|down_proj)\."),
     lambda m: f".block_sparse_moe.{m[1]}.{ {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'}[m[2]]}."),
    (re.compile(r"\.mlp\.gate\.weight$"), lambda m: ".block_sparse_moe.gate.weight"),
)


class FolderWeights:
    """The tensors of a Hugging Face model folder by name, read from its safetensors files on demand.

    Tensors are read with plain file reads into fresh tensors rather than through a memory map of the file
    (what ``safetensors.safe_open`` does): a map of a whole multi-gigabyte file counts toward the process's
    memory limits and, once touched, its resident size; only the asked tensors should. Names are the
    model's state-dict keys; a file saved from the base model (without ``base_model_prefix``) or with it
    is read either way.
    """

    def __init__(self, folder: str | os.PathLike[str], base_model_prefix: str = "") -> None:
        self.folder = Path(folder)
        self.prefix = base_model_prefix
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.folder / name for name in weight_map.values()})
        elif single.is_file():
            files = [single]
        else:
            raise CheckpointError(f"{self.folder} has no model.safetensors (or model.safetensors.index.json): "
                                  "save the model with save_pretrained (safetensors is its default)")
        self.entries: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for path in files:
            start, header = safetensors_header(path)
            for key, entry in header.items():
                if entry["dtype"] not in SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which cannot be read")
                self.entries[key] = (path, start, entry)

    def key(self, name: str) -> str | None:
        """The file's name for the model's tensor ``name`` (``None`` if the folder lacks it), also under the
        checkpoints' other spellings (:data:`_CHECKPOINT_SPELLINGS`)."""
        found = self._key(name)
        for pattern, spelling in _CHECKPOINT_SPELLINGS:
            if found is None and pattern.search(name):
                found = self._key(pattern.sub(spelling, name))
        return found

    def _key(self, name: str) -> str | None:
        if name in self.entries:
            return name
        if self.prefix:
            stripped = name[len(self.prefix) + 1:] if name.startswith(self.prefix + ".") else None
            if stripped in self.entries:
                return stripped
            if f"{self.prefix}.{name}" in self.entries:
                return f"{self.prefix}.{name}"
        return None

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (those the folder has), read into memory."""
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            key = self.key(name)
            if key is None:
                continue
            path, start, entry = self.entries[key]
            begin, end = entry["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            with open(path, "rb") as handle:
                handle.seek(start + begin)
                if handle.readinto(raw.numpy()) != end - begin:
                    raise CheckpointError(f"{path} is truncated (tensor {key!r})")
            tensors[name] = raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        return tensors


def materialise(module: nn.Module, prefix: str, weights: FolderWeights, skip: str | None = None) -> None:
    """Give ``module``'s tensors their values from the folder (``prefix``: the module's name + ``.``);
    parameters left on ``meta`` are reported by the caller. ``skip``: a submodule name left alone."""
    state = module.state_dict(keep_vars=True)
    wanted = [k for k in state if skip is None or not (k == skip or k.startswith(skip + "."))]
    found = weights.read(prefix + k for k in wanted)
    loaded = {}
    for key in wanted:
        tensor = found.get(prefix + key)
        if tensor is None:
            continue
        current = state[key]
        loaded[key] = tensor.to(current.dtype) if current.is_floating_point() else tensor
    module.load_state_dict(loaded, strict=False, assign=True)


def meta_parameters(module: nn.Module, skip: str | None = None) -> list[str]:
    return [name for name, tensor in (*module.named_parameters(), *module.named_buffers())
            if tensor.is_meta and (skip is None or not name.startswith(skip + "."))]



def load_skeleton(folder: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """The model of a Hugging Face folder without its weights (parameters on ``meta``) and its config.

    The class is the config's first ``architectures`` entry (``AutoModel`` if it names none); fused
    mixture-of-experts experts are unfused (:func:`quark_brevitas.model_parts.moe.unfuse_experts`), so that the model
    quantized from a folder, the float model evaluated from it and the model rebuilt from its block-by-block
    checkpoint have one structure, each expert a layer of its own as for a model given to the API.
    """
    transformers = require("transformers", "a Hugging Face model folder")
    init_empty_weights = require("accelerate", "a Hugging Face model folder").init_empty_weights

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (no config.json)")
    hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    architectures = getattr(hf_config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with init_empty_weights():
        model = transformers.AutoModel.from_config(hf_config) if model_class is None else model_class(hf_config)
    unfuse_experts(model)
    return model.eval(), hf_config


def tie_embeddings(model: nn.Module, hf_config: Any) -> None:
    """Tie the output embedding to the input embedding if the config says so (the folder stores one)."""
    if getattr(hf_config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()


def materialise_outside(model: nn.Module, stack: str, weights: FolderWeights, hf_config: Any) -> None:
    """Read a skeleton's tensors outside its block stack from the folder (the blocks load one at a time)."""
    materialise(model, "", weights, skip=stack)
    tie_embeddings(model, hf_config)
    missing = meta_parameters(model, skip=stack)
    if missing:
        raise CheckpointError(f"{weights.folder} lacks tensor {missing[0]!r} of {type(model).__name__}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


class FolderBlocks(BlockSource):
    """Blocks read from a float model folder just before they run, then given to ``prepare`` (the data-free steps'
    part in each block, :func:`~quark_brevitas.orchestration.block_runs.prepare_streamed`: a rotation); dropped
    once finished (the run's sink has written them, if it writes)."""

    releases = True

    def __init__(self, weights: FolderWeights, stack: str, prepare: BlockStep | None = None) -> None:
        self.weights, self.stack, self.prepare = weights, stack, prepare

    def load(self, index: int, current: nn.Module) -> nn.Module:
        name = f"{self.stack}.{index}"
        materialise(current, name + ".", self.weights)
        missing = meta_parameters(current)
        if missing:
            raise CheckpointError(f"{self.weights.folder} lacks tensor {name}.{missing[0]}")
        return current if self.prepare is None else self.prepare(current, name)

    def finish(self, index: int, block: nn.Module) -> nn.Module:
        return BlockPlaceholder()



def random_fill(module: nn.Module, seed: int, skip: str | None = None) -> None:
    """Finite placeholder values for a skeleton's parameters still on ``meta`` (the structure phase
    initialises weight scales from them), overwritten by the checkpoint's values afterwards."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, parameter in list(module.named_parameters()):
        if not parameter.is_meta or (skip is not None and name.startswith(skip + ".")):
            continue
        owner_name, _, attribute = name.rpartition(".")
        value = torch.randn(parameter.shape, generator=generator) * 0.02
        setattr(module.get_submodule(owner_name), attribute,
                nn.Parameter(value.to(parameter.dtype), requires_grad=parameter.requires_grad))
