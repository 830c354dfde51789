"""``import_model_from_safetensors(model, model_dir)`` (Quark 0.13): a folder
:func:`~quark_brevitas.quark_compat.exporting.export_safetensors` wrote, back as the quantized model.

The folder's ``quark_brevitas_checkpoint/`` is loaded with :func:`~quark_brevitas.checkpoint.load_quantized`: the
model is rebuilt exactly (its outputs are bit-identical to the exported model's) and stays a quark_brevitas model
that every exporter takes. The Quark-format tensors beside it are for other readers (transformers with amd-quark,
vLLM); a folder without the checkpoint (written by Quark, or by ``export_safetensors(checkpoint=False)``) is refused
with what to do instead: rebuilding Brevitas quantizers from packed codes is not offered.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.checkpoint import CheckpointError, load_quantized
from quark_brevitas.quark_compat.arguments import UnsupportedArgumentError, check_choice
from quark_brevitas.quark_compat.exporting import CHECKPOINT_FOLDER

__all__ = ["import_model_from_safetensors"]

logger = logging.getLogger(__name__)
_FUNCTION = "import_model_from_safetensors"


def _skeleton(model_dir: Path, trust_remote_code: bool, attn_implementation: str) -> nn.Module:
    """The float architecture described by ``model_dir/config.json`` (its weights come from the checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the recipe is the checkpoint's; the skeleton is the float model
    return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                            attn_implementation=attn_implementation)


def import_model_from_safetensors(model: nn.Module | None, model_dir: str | os.PathLike[str],
                                  multi_device: bool = False, trust_remote_code: bool = False,
                                  attn_implementation: str = "eager", device: str = "cuda",
                                  multi_gpu: Any = False) -> nn.Module:
    """The quantized model of ``model_dir`` (Quark's signature).

    ``model``: the float model (not modified: the rebuild works on a copy), or ``None`` to build it from
    ``model_dir/config.json`` with transformers (``trust_remote_code``, ``attn_implementation``), then moved to
    ``device`` (Quark's default ``"cuda"``; CPU-only machines pass ``device="cpu"``) and put in eval mode, as Quark
    does. ``multi_device`` / ``multi_gpu``: only ``False`` (Quark's accelerate dispatch is not offered).
    """
    check_choice(_FUNCTION, "multi_device", multi_device, [False], "is not offered: the model is loaded on one device")
    check_choice(_FUNCTION, "multi_gpu", multi_gpu, [False, None], "is not offered: the model is loaded on one device")
    check_choice(_FUNCTION, "trust_remote_code", trust_remote_code, [False, True], "is not a bool")
    directory = Path(model_dir)
    checkpoint = directory / CHECKPOINT_FOLDER
    if not checkpoint.is_dir():
        what = ("is not a folder" if not directory.is_dir() else
                f"has no {CHECKPOINT_FOLDER}/ (it was not written by quark_brevitas's export_safetensors, or with "
                "checkpoint=False)")
        raise CheckpointError(f"{_FUNCTION}: {str(directory)!r} {what}; the quantized model is rebuilt from the "
                              "quark_brevitas checkpoint export_safetensors writes beside Quark's tensors. A folder "
                              "Quark wrote loads with transformers and amd-quark "
                              "(AutoModelForCausalLM.from_pretrained), or quantize the float model again with its "
                              "recipe: Config.from_file(config.json)")
    if model is None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedArgumentError(_FUNCTION, "device", device, "is not available on this machine (no CUDA)",
                                           "'cpu' (or a device torch has here)")
        quantized = load_quantized(_skeleton(directory, trust_remote_code, attn_implementation), checkpoint)
        quantized = quantized.to(device)
        quantized.eval()
    else:
        quantized = load_quantized(model, checkpoint)
    logger.info("Imported %s from %s", type(quantized).__name__, directory)
    return quantized
