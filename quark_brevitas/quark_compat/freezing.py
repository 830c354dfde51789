"""``ModelQuantizer.freeze(model)`` (Quark 0.13): the quantized model, fixed for inference and export.

In Quark, freezing replaces each fake quantizer by a frozen one that no longer observes, and by default writes the
fake-quantized weight into ``layer.weight``. Here calibration has ended when ``quantize_model`` returns (its
activation statistics are no longer collected), so freezing fixes what can still move: the model leaves training
mode (a QAT model's learned scales and weights stop changing, Dropout and BatchNorm statistics too) and no parameter
requires a gradient any more (the flags are stored in a checkpoint and restored by ``load_quantized``).
``layer.weight`` keeps the float weight: Brevitas quantizes it in every forward call, and the exporters read the
integer codes from the layer's own quantizer (writing the rounded weight back would make a re-quantization of it
choose another scale for the full-range grids); the quantized weight is ``layer.quant_weight()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from quark_brevitas.quark_compat.arguments import UnsupportedArgumentError, require_quantized

__all__ = ["freeze"]

logger = logging.getLogger(__name__)


def freeze(model: nn.Module, quantize: bool | None = None, runtime_options: Any = None) -> nn.Module:
    """Fix the quantized ``model`` in place (eval mode, no gradients) and return it (Quark's signature).

    - ``quantize``: Quark's "write the fake-quantized weight into ``layer.weight``". ``None`` (the default) and
      ``False`` keep the float weight, which is what quark_brevitas does (see the module docstring); ``True`` is
      refused.
    - ``runtime_options``: Quark's native inference kernels; only ``None``.
    """
    model = require_quantized(model, "ModelQuantizer.freeze")
    if quantize is not None and not isinstance(quantize, bool):
        raise UnsupportedArgumentError("ModelQuantizer.freeze", "quantize", quantize, "is not a bool",
                                       "None or False")
    if quantize:
        raise UnsupportedArgumentError(
            "ModelQuantizer.freeze", "quantize", quantize,
            "asks for the fake-quantized weight in layer.weight; quark_brevitas keeps the float weight there "
            "(Brevitas quantizes it in forward, the exporters read the codes from its quantizer) and gives the "
            "quantized one as layer.quant_weight()", "None or False")
    if runtime_options is not None:
        raise UnsupportedArgumentError("ModelQuantizer.freeze", "runtime_options", type(runtime_options).__name__,
                                       "selects Quark's native inference kernels, which quark_brevitas does not have "
                                       "(its quantized model runs on plain PyTorch)", "None")
    model.eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    logger.info("Froze %s (eval mode, no gradients)", type(model).__name__)
    return model
