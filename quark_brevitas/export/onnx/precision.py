"""Exporting half-precision quantized models: through a float32 copy.

A model quantized in float16 or bfloat16 keeps its weights and activations in that dtype and its
quantizers in float32 (:func:`quark_brevitas.brevitas_adapter.keep_quantizers_float32`). onnxruntime's
CPU kernels are float32-centric (no bfloat16 ``Gemm``/``Conv``, few float16 integer-kernel fusions),
and Brevitas's exporters trace the model as it is, so the exporter writes a float32 copy of the
quantized model instead: the same integer weights, scales and zero points (float32 holds every
float16 and bfloat16 value exactly), with the layers' arithmetic in float32. The file is verified
against that copy, and the difference between the copy and the half-precision model (the rounding of
the half model's own arithmetic, not a quantization difference) is logged with the model's dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from quark_brevitas.export.args import Example
from quark_brevitas.export.onnx.kv import export_module
from quark_brevitas.export.onnx.verify import eval_mode, flatten_outputs

logger = logging.getLogger(__name__)

__all__ = ["HALF_PRECISION", "float32_for_export"]

#: Model dtypes exported through a float32 copy.
HALF_PRECISION = (torch.float16, torch.bfloat16)


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    return next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), None)


def float32_for_export(model: nn.Module, example: Example) -> tuple[nn.Module, Example]:
    """``(model, example)`` unchanged for a float32 model; for a float16/bfloat16 model a float32 copy of it
    and ``example`` with its floating tensors in float32 (integer inputs such as token ids are kept).

    The caller's model is not changed. Logs the largest difference between the copy's outputs and the
    half-precision model's on ``example``.
    """
    dtype = _model_dtype(model)
    if dtype not in HALF_PRECISION:
        return model, example
    wide = copy.deepcopy(model).float()
    wide_args = tuple(a.float() if a.is_floating_point() else a for a in example.tensors)
    half_args = tuple(a.to(dtype) if a.is_floating_point() else a for a in example.tensors)
    with torch.no_grad(), eval_mode(model), eval_mode(wide):
        half = flatten_outputs(export_module(model, example)(*half_args))
        full = flatten_outputs(export_module(wide, example)(*wide_args))
    difference = max((float((h.float() - f).abs().max()) for (_, h), (_, f) in zip(half, full) if h.numel()),
                     default=0.0)
    logger.info("Exporting a float32 copy of the %s model (onnxruntime's CPU kernels compute in float32; the "
                "integer weights, scales and zero points are identical). The file is verified against the copy; "
                "the copy's outputs differ from the %s model's by at most %.3g on the example input (%s rounding "
                "of the layers' arithmetic)", _name(dtype), _name(dtype), difference, _name(dtype))
    return wide, dataclasses.replace(example, tensors=wide_args)


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
