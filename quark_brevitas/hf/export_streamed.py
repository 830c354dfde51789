"""compressed-tensors checkpoints written from a block-by-block (streamed) checkpoint, one block at a time.

Lives on the Hugging Face side (it rebuilds quantized blocks through :mod:`quark_brevitas.hf.streaming`), so that
:mod:`quark_brevitas.export` does not depend on the streaming machinery (no import cycle). The tensors and the
``quantization_config`` are those of :func:`quark_brevitas.export.export_safetensors`; see
:mod:`quark_brevitas.export.safetensors_hf`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.safetensors_hf import (
    LayerCodes,
    check_export_args,
    collect_tensors,
    config_json,
    quantization_config_dict,
    untie,
    write_tokenizer,
)
from quark_brevitas.outputs import output_dir as _output_folder

__all__ = ["export_safetensors_streamed"]

logger = logging.getLogger(__name__)
_INDEX_FILE = "model.safetensors.index.json"


def _streamed_units(checkpoint: Path) -> Iterator[tuple[str, nn.Module, str | None, Any]]:
    """``(prefix, module, skip, hf_config)`` for each block of a streamed checkpoint (loaded one at a time and
    dropped after), then the rest of the model without its block stack."""
    from quark_brevitas.hf.streaming import quantized_skeleton

    model, stack, blocks, _ = quantized_skeleton(checkpoint, None, keep=False)
    modules = model.get_submodule(stack)
    for index in range(len(modules)):
        block = blocks.load(index, modules[index])
        yield f"{stack}.{index}.", block, None, model.config
        modules[index] = blocks.finish(index, block)
        del block
    yield "", model, stack, model.config


def export_safetensors_streamed(checkpoint: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                                format: str = "compressed-tensors", tokenizer: Any = None, *,
                                overwrite: bool = False, pack_asymmetric: bool = False) -> Path:
    """:func:`export_safetensors` for a checkpoint written block by block
    (:func:`~quark_brevitas.hf.streaming.quantize_pretrained`): each quantized block is rebuilt from the
    checkpoint, written to its own shard and dropped, so neither the float model nor the whole quantized model
    is ever in memory. The folder holds one safetensors file per block, one for the rest and the index."""
    directory = check_export_args(format, output_dir)
    entries: list[LayerCodes] = []
    float_linears: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    hf_config = None
    from safetensors.torch import save_file

    with _output_folder(directory, overwrite=overwrite, sources=[checkpoint]) as work:
        for count, (prefix, module, skip, unit_config) in enumerate(_streamed_units(Path(checkpoint))):
            hf_config = unit_config
            tensors: dict[str, torch.Tensor] = {}
            collect_tensors(module, prefix, tensors, entries, float_linears, skip=skip, pack_asymmetric=pack_asymmetric)
            tensors = untie(tensors)
            name = f"model-{count:05d}.safetensors" if prefix else "model-rest.safetensors"
            save_file(tensors, str(work / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if not entries:
            raise ExportError(f"checkpoint {str(checkpoint)!r} has no quantized Linear layer to write")
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (work / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (work / "config.json").write_text(config_json(hf_config, quantization_config_dict(entries, float_linears)))
        write_tokenizer(tokenizer, work)
    logger.info("Wrote %s (%s from the streamed checkpoint %s, %d quantized layers)", directory, format, checkpoint,
                len(entries))
    return directory
