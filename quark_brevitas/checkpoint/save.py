"""Writing a quantized model as a checkpoint folder (see :mod:`quark_brevitas.checkpoint`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from quark_brevitas.checkpoint.manifest import (
    EXAMPLE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    ExampleInput,
    example_tensors,
)
from quark_brevitas.checkpoint.writer import CheckpointWriter
from quark_brevitas.config import Config, verify_config
from quark_brevitas.outputs import check_output_dir, output_dir
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE

__all__ = ["save_quantized"]

logger = logging.getLogger(__name__)


def save_quantized(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    example_input: ExampleInput | None = None,
    config: Config | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (returned by ``ModelQuantizer.quantize_model``) as a checkpoint directory.

    - ``example_input``: optional model input (a tensor, a tuple of positional tensors or a dict of
      keyword tensors), stored so that ``quark-brevitas export`` can export the checkpoint without
      being given an input.
    - ``config``: only for models not produced by ``quantize_model`` (which carry their Config).

    - ``overwrite``: also write into a folder that holds files quark_brevitas did not write (a Hugging Face
      model folder, other work); without it such a folder is refused (:class:`~quark_brevitas.outputs.OutputError`).
      Only the checkpoint's own files are replaced; the others stay.

    Works in train and eval mode (the mode is restored on load, so QAT can be resumed). The checkpoint is
    written into a temporary sibling folder and moved into place once complete (:mod:`quark_brevitas.outputs`),
    so an interrupted save leaves the folder as it was; a checkpoint saved there before is replaced as a whole.
    The manifest records each weight file's SHA-256, checked on load. Returns the directory.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = getattr(model, CONFIG_ATTRIBUTE, None)
        if config is None:
            raise CheckpointError(
                f"{type(model).__name__} carries no quark_brevitas Config (it was not returned by "
                "ModelQuantizer.quantize_model or load_quantized); pass config= to save_quantized"
            )
    verify_config(config)
    if config.kv_cache_quant_config:
        # The KV-cache scales live outside the state dict and load_quantized does not rebuild the quantizers yet:
        # a checkpoint would come back with a float cache, so it is refused rather than written.
        raise CheckpointError("checkpoints do not carry KV-cache quantization (kv_cache_quant_config) yet: the "
                              "reloaded model would run a float cache. Export the model instead "
                              "(export_safetensors, format 'quark' or 'compressed-tensors'), or save it without "
                              "kv_cache_quant_config")
    if config.softmax_quant_spec is not None:
        raise CheckpointError("checkpoints do not carry attention quantization (softmax_quant_spec) yet: the reloaded "
                              "model would run float attention. Export the model instead (export_safetensors, format "
                              "'quark' or 'compressed-tensors'), or save it without softmax_quant_spec")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} exists and is not a directory")
    path = check_output_dir(directory, overwrite=overwrite)
    example = example_tensors(example_input) if example_input is not None else None
    # The index of a sharded checkpoint would take precedence over model.safetensors, and a stale example
    # input would be misleading: both go when the folder is replaced.
    with output_dir(path, overwrite=overwrite, stale=(WEIGHTS_INDEX_FILE, EXAMPLE_FILE)) as work:
        writer = CheckpointWriter(work)  # the one writer: the model in memory is one part
        weights = writer.write_part(WEIGHTS_FILE, model)
        checksums = {EXAMPLE_FILE: writer.write_tensors(EXAMPLE_FILE, example[1])} if example is not None else {}
        writer.finish(model, config, [weights], example=example[0] if example is not None else None,
                      checksums=checksums)
        size = (work / WEIGHTS_FILE).stat().st_size
    logger.info("Saved checkpoint %s (%d tensors, %.1f KiB)", path, len(weights["tensors"]), size / 1024)
    return path
