"""compressed-tensors / Quark checkpoints and GGUF files written from a block-by-block (streamed) checkpoint, one block
at a time.

Lives on the Hugging Face side (it rebuilds quantized blocks through :mod:`quark_brevitas.hf.streaming`), so that
:mod:`quark_brevitas.export` does not depend on the streaming machinery (no import cycle). The tensors and the
``quantization_config`` are those of :func:`quark_brevitas.export.export_safetensors`; see
:mod:`quark_brevitas.export.safetensors_hf`. The GGUF tensors are those of :func:`quark_brevitas.export.export_gguf`
(:mod:`quark_brevitas.export.gguf`): each block is packed, proven and spilled to a temporary file, and the file is
written from those memory-mapped arrays (GGUF's header names every tensor before any data).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.gguf import (
    GGUFTensor,
    check_gguf_blocks,
    collect_checked,
    collect_gguf_tensors,
    plan_gguf,
    refuse_activation_quantizers,
    write_gguf,
)
from quark_brevitas.export.hf import refuse_online_rotations
from quark_brevitas.export.safetensors_hf import (
    LayerCodes,
    check_export_args,
    collect_tensors,
    config_json,
    untie,
    write_tokenizer,
)
from quark_brevitas.outputs import output_dir as _output_folder

__all__ = ["export_gguf_streamed", "export_safetensors_streamed"]

logger = logging.getLogger(__name__)
_INDEX_FILE = "model.safetensors.index.json"


def _streamed_units(checkpoint: Path, format_name: str) -> Iterator[tuple[str, nn.Module, str | None, Any]]:
    """``(prefix, module, skip, hf_config)`` for each block of a streamed checkpoint (loaded one at a time and
    dropped after), then the rest of the model without its block stack. A block behind online rotations, which
    ``format_name`` cannot hold, is an ExportError (as for the loaded model)."""
    from quark_brevitas.hf.streaming import quantized_skeleton

    model, stack, blocks, _ = quantized_skeleton(checkpoint, None, keep=False)
    modules = model.get_submodule(stack)
    for index in range(len(modules)):
        block = blocks.load(index, modules[index])
        refuse_online_rotations(block, format_name, prefix=f"{stack}.{index}.")
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
    is ever in memory. The folder holds one safetensors file per block, one for the rest and the index.
    ``format``: ``"compressed-tensors"`` or ``"quark"``, as for :func:`export_safetensors`."""
    fmt, directory = check_export_args(format, output_dir, pack_asymmetric)
    entries: list[LayerCodes] = []
    float_linears: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    hf_config = None
    from safetensors.torch import save_file

    with _output_folder(directory, overwrite=overwrite, sources=[checkpoint]) as work:
        for count, (prefix, module, skip, unit_config) in enumerate(_streamed_units(Path(checkpoint), format)):
            hf_config = unit_config
            tensors: dict[str, torch.Tensor] = {}
            collect_tensors(module, prefix, tensors, entries, float_linears, skip=skip, pack_asymmetric=pack_asymmetric,
                            fmt=fmt)
            tensors = untie(tensors)
            name = f"model-{count:05d}.safetensors" if prefix else "model-rest.safetensors"
            save_file(tensors, str(work / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if not entries:
            raise ExportError(f"checkpoint {str(checkpoint)!r} has no quantized Linear layer to write")
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (work / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (work / "config.json").write_text(config_json(hf_config, fmt.quantization_config(entries, float_linears)))
        write_tokenizer(tokenizer, work)
    logger.info("Wrote %s (%s from the streamed checkpoint %s, %d quantized layers)", directory, format, checkpoint,
                len(entries))
    return directory


def _spill(tensor: GGUFTensor, folder: Path, index: int) -> GGUFTensor:
    """The tensor with its data moved to ``folder`` and memory-mapped back (its proof is done, so the expected
    weight is dropped)."""
    path = folder / f"{index:06d}.npy"
    np.save(path, tensor.data)
    return GGUFTensor(tensor.name, np.load(path, mmap_mode="r"), tensor.qtype, None)


def export_gguf_streamed(checkpoint: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                         model_type: str | None = None, tokenizer_path: str | os.PathLike[str] | None = None, *,
                         overwrite: bool = False) -> Path:
    """:func:`~quark_brevitas.export.export_gguf` for a checkpoint written block by block
    (:func:`~quark_brevitas.hf.streaming.quantize_pretrained`), without the float model: each quantized block is
    rebuilt, packed into GGUF blocks, proven against its quantized weights (``gguf``'s own dequantization, max
    difference 0), spilled to a temporary file next to ``output_dir`` and dropped. ``tokenizer_path``: default
    the checkpoint's ``float_model/`` when it holds a ``tokenizer.json``. Returns the ``.gguf`` path; the tensors
    equal those :func:`export_gguf` writes for the loaded model."""
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR

    checkpoint = Path(checkpoint)
    if tokenizer_path is None and (checkpoint / FLOAT_MODEL_DIR / "tokenizer.json").is_file():
        tokenizer_path = checkpoint / FLOAT_MODEL_DIR
    elif tokenizer_path is None:
        logger.warning("export_gguf_streamed: %s holds no tokenizer.json; the file has no tokenizer, which "
                       "llama.cpp needs to run it", checkpoint / FLOAT_MODEL_DIR)
    Path(output_dir).parent.mkdir(parents=True, exist_ok=True)
    plan, config, tensors = None, None, []
    with tempfile.TemporaryDirectory(dir=Path(output_dir).parent, prefix=f".{Path(output_dir).name}.blocks-") as tmp:
        for prefix, module, skip, unit_config in _streamed_units(checkpoint, "GGUF"):
            if plan is None:
                plan = plan_gguf(unit_config, model_type, None if tokenizer_path is None else Path(tokenizer_path))
            config = unit_config
            refuse_activation_quantizers(module)
            with torch.no_grad():
                unit = collect_checked(lambda m=module, p=prefix, k=skip, g=plan, c=config: collect_gguf_tensors(
                    m, g.family, g.name_map, c, prefix=p, skip=k))
            check_gguf_blocks(plan.gguf, unit)
            tensors.extend(_spill(tensor, Path(tmp), len(tensors) + i) for i, tensor in enumerate(unit))
        path = write_gguf(plan, config, tensors, output_dir, overwrite=overwrite, sources=(checkpoint,))
        del tensors  # release the memory maps before the folder goes
    logger.info("Wrote %s from the streamed checkpoint %s", path, checkpoint)
    return path
