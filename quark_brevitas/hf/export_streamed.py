"""compressed-tensors / Quark checkpoints and GGUF files written from a block-by-block (streamed) checkpoint, one block
at a time.

Lives on the Hugging Face side (it rebuilds quantized blocks through :mod:`quark_brevitas.hf.streaming`), so that
:mod:`quark_brevitas.export` does not depend on the streaming machinery (no import cycle). The tensors and the
``quantization_config`` are those of :func:`quark_brevitas.export.export_safetensors`; see
:mod:`quark_brevitas.export.hf.checkpoints`. The GGUF tensors are those of :func:`quark_brevitas.export.export_gguf`
(:mod:`quark_brevitas.export.gguf.writer`): each block is packed, proven and spilled to a temporary file, and the
file is
written from those memory-mapped arrays (GGUF's header names every tensor before any data), in the in-memory
export's tensor order, so the two files are the same bytes. Every written file is read back and compared with what
was proven before the folder is moved into place (:mod:`quark_brevitas.export.readback`).
"""

from __future__ import annotations

import itertools
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
from quark_brevitas.export.gguf.writer import (
    GGUFPlan,
    GGUFTensor,
    check_gguf_blocks,
    collect_checked,
    collect_gguf_tensors,
    plan_gguf,
    refuse_activation_quantizers,
    write_gguf,
)
from quark_brevitas.export.hf.checkpoints import (
    LayerCodes,
    check_export_args,
    checkpoint_names,
    collect_tensors,
    config_json,
    untie,
    write_tokenizer,
)
from quark_brevitas.export.hf.models import refuse_online_rotations
from quark_brevitas.export.readback import (
    TensorRecord,
    array_digest,
    records_of,
    verify_json_file,
    verify_safetensors_file,
    verify_text_file,
)
from quark_brevitas.export.writers import gguf_tokenizer, hf_tokenizer
from quark_brevitas.outputs import output_dir as _output_folder

__all__ = ["export_gguf_streamed", "export_safetensors_streamed", "write_compressed_tensors_streamed",
           "write_gguf_streamed", "write_quark_streamed"]

logger = logging.getLogger(__name__)
_INDEX_FILE = "model.safetensors.index.json"


def _streamed_units(checkpoint: Path, format_name: str) -> Iterator[tuple[str, nn.Module, str | None, Any]]:
    """``(prefix, module, skip, hf_config)`` for each block of a streamed checkpoint (loaded one at a time and
    dropped after), then the rest of the model without its block stack. A block behind online rotations, which
    ``format_name`` cannot hold, is an ExportError (as for the loaded model)."""
    from quark_brevitas.checkpoint.streamed_blocks import quantized_skeleton

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
    shards: dict[str, dict[str, TensorRecord]] = {}
    total = 0
    hf_config = None
    from safetensors.torch import save_file

    with _output_folder(directory, overwrite=overwrite, sources=[checkpoint]) as work:
        for count, (prefix, module, skip, unit_config) in enumerate(_streamed_units(Path(checkpoint), format)):
            hf_config = unit_config
            tensors: dict[str, torch.Tensor] = {}
            collect_tensors(module, prefix, tensors, entries, float_linears, skip=skip, pack_asymmetric=pack_asymmetric,
                            fmt=fmt)
            tensors = untie(checkpoint_names(unit_config, tensors, entries, float_linears))
            name = f"model-{count:05d}.safetensors" if prefix else "model-rest.safetensors"
            shards[name] = records_of(tensors)  # recorded from memory, checked against the files at the end
            save_file(tensors, str(work / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if not entries:
            raise ExportError(f"checkpoint {str(checkpoint)!r} has no quantized Linear layer to write")
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (work / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config_text = config_json(hf_config, fmt.quantization_config(entries, float_linears))
        (work / "config.json").write_text(config_text)
        write_tokenizer(tokenizer, work, directory)  # copied files are read back against their source
        for name, records in shards.items():  # every shard is complete: read each back before the folder moves
            verify_safetensors_file(work / name, directory / name, records)
        verify_json_file(work / _INDEX_FILE, directory / _INDEX_FILE, index)
        verify_text_file(work / "config.json", directory / "config.json", config_text)
    logger.info("Wrote %s (%s from the streamed checkpoint %s, %d quantized layers)", directory, format, checkpoint,
                len(entries))
    return directory


class _Spill:
    """Where a streamed GGUF export keeps its proven tensors until the file is written (GGUF's header names every
    tensor before any data, so the file is written after the last block): each tensor's data goes to a file of its
    own in ``folder`` and is memory-mapped back.

    Why the names cannot collide: they come from one counter of the spills themselves (not from the length of a
    list being extended), and each file is created exclusively (``"xb"``): a name used twice would be an error,
    never a file overwritten under a tensor that still maps it. The SHA-256 of the proven bytes is taken before
    the spill, so that the read-back of the written file (:func:`~quark_brevitas.export.readback.verify_gguf_file`)
    compares the file with what was proven, not with the spill."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._numbers = itertools.count()

    def __call__(self, tensor: GGUFTensor) -> GGUFTensor:
        """The tensor with its data moved to disk and memory-mapped back (the expected weight is dropped: its
        proof is done, and the digest stands for it)."""
        digest = array_digest(tensor.data)
        path = self.folder / f"{next(self._numbers):06d}.npy"
        with open(path, "xb") as handle:
            np.save(handle, tensor.data)
        return GGUFTensor(tensor.name, np.load(path, mmap_mode="r"), tensor.qtype, None, digest)


def _names_before(model: nn.Module, stack: str) -> set[str]:
    """The parameter names ``model`` lists before its block stack (the embeddings), so that a streamed file holds
    its tensors in the order the in-memory export writes them (``named_parameters``): the same bytes."""
    before: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if name == stack:
            break
        before.update(f"{name}.{key}" if name else key for key, _ in module.named_parameters(recurse=False))
    return before


def _in_model_order(rest: list[GGUFTensor], blocks: list[GGUFTensor], plan: GGUFPlan, model: nn.Module,
                    stack: str) -> list[GGUFTensor]:
    """``rest`` (the model without its stack) split around ``blocks`` as the model lists its parameters."""
    first = set()
    for hf_name in _names_before(model, stack):
        module, _, leaf = hf_name.rpartition(".")
        mapped = plan.name_map.get_name(module)
        if mapped is not None:
            first.add(f"{mapped}.{leaf}")
    return [t for t in rest if t.name in first] + blocks + [t for t in rest if t.name not in first]


def export_gguf_streamed(checkpoint: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                         model_type: str | None = None, tokenizer_path: str | os.PathLike[str] | None = None, *,
                         overwrite: bool = False) -> Path:
    """:func:`~quark_brevitas.export.export_gguf` for a checkpoint written block by block
    (:func:`~quark_brevitas.hf.streaming.quantize_pretrained`), without the float model: each quantized block is
    rebuilt, packed into GGUF blocks, proven against its quantized weights (``gguf``'s own dequantization, max
    difference 0), spilled to a temporary file next to ``output_dir`` and dropped. ``tokenizer_path``: default
    the checkpoint's ``float_model/`` when it holds a ``tokenizer.json``. Returns the ``.gguf`` path; the tensors
    equal those :func:`export_gguf` writes for the loaded model."""
    from quark_brevitas.checkpoint.manifest import FLOAT_MODEL_DIR

    checkpoint = Path(checkpoint)
    if tokenizer_path is None and (checkpoint / FLOAT_MODEL_DIR / "tokenizer.json").is_file():
        tokenizer_path = checkpoint / FLOAT_MODEL_DIR
    elif tokenizer_path is None:
        logger.warning("export_gguf_streamed: %s holds no tokenizer.json; the file has no tokenizer, which "
                       "llama.cpp needs to run it", checkpoint / FLOAT_MODEL_DIR)
    Path(output_dir).parent.mkdir(parents=True, exist_ok=True)
    plan: GGUFPlan | None = None
    config, blocks, tensors = None, [], []
    with tempfile.TemporaryDirectory(dir=Path(output_dir).parent, prefix=f".{Path(output_dir).name}.blocks-") as tmp:
        spill = _Spill(Path(tmp))
        for prefix, module, skip, unit_config in _streamed_units(checkpoint, "GGUF"):
            if plan is None:
                plan = plan_gguf(unit_config, model_type, None if tokenizer_path is None else Path(tokenizer_path))
            config = unit_config
            refuse_activation_quantizers(module)
            with torch.no_grad():
                unit = collect_checked(lambda m=module, p=prefix, k=skip, g=plan, c=config: collect_gguf_tensors(
                    m, g.family, g.name_map, c, prefix=p, skip=k))
            check_gguf_blocks(plan.gguf, unit)
            spilled = [spill(tensor) for tensor in unit]
            if skip is None:
                blocks.extend(spilled)
            else:
                tensors = _in_model_order(spilled, blocks, plan, module, skip)
        if plan is None:
            raise ExportError(f"checkpoint {str(checkpoint)!r} holds no model to write")
        path = write_gguf(plan, config, tensors, output_dir, overwrite=overwrite, sources=(checkpoint,))
        del tensors, blocks  # release the memory maps before the folder goes
    logger.info("Wrote %s from the streamed checkpoint %s", path, checkpoint)
    return path


# ===================================================================== the format registry's block-by-block writers
def write_gguf_streamed(checkpoint: Any, output: Any, *, overwrite: bool = False, tokenizer_dir: Any = None,
                        **options: Any) -> Path:
    """The ``gguf`` row's writer from a checkpoint written block by block (the contract of
    :mod:`quark_brevitas.export.registry`)."""
    options.setdefault("tokenizer_path", gguf_tokenizer(tokenizer_dir))
    return export_gguf_streamed(checkpoint, output, overwrite=overwrite, **options)


def write_compressed_tensors_streamed(checkpoint: Any, output: Any, *, overwrite: bool = False,
                                      tokenizer_dir: Any = None, **options: Any) -> Path:
    options.setdefault("tokenizer", hf_tokenizer(tokenizer_dir))
    return export_safetensors_streamed(checkpoint, output, "compressed-tensors", overwrite=overwrite, **options)


def write_quark_streamed(checkpoint: Any, output: Any, *, overwrite: bool = False, tokenizer_dir: Any = None,
                         **options: Any) -> Path:
    options.setdefault("tokenizer", hf_tokenizer(tokenizer_dir))
    return export_safetensors_streamed(checkpoint, output, "quark", overwrite=overwrite, **options)
