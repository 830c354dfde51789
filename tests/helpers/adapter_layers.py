"""Small quantized layers the adapter canaries (``tests/test_adapter_*.py``) exercise Brevitas through."""

from __future__ import annotations

from typing import Any

import brevitas.nn as qnn
import torch

from quark_brevitas.quantizers import build_quantizer


def quant_linear(weight=None, act=None) -> qnn.QuantLinear:
    """A QuantLinear(8, 4) with the library's quantizers for ``weight`` (default: the default spec) and
    ``act`` (input; none by default), seeded so that every call builds the same layer."""
    from quark_brevitas.config import QTensorConfig

    torch.manual_seed(0)
    return qnn.QuantLinear(8, 4, bias=True,
                           weight_quant=build_quantizer(weight or QTensorConfig(), "weight"),
                           input_quant=build_quantizer(act, "input_tensors") if act is not None else None,
                           return_quant_tensor=False)


def half_linear(dtype: torch.dtype, kwargs_filter: Any = None) -> qnn.QuantLinear:
    """A W8A8 QuantLinear(8, 4) in ``dtype`` with a 32-bit bias quantizer; ``kwargs_filter`` rewrites its
    quantizer keyword arguments first (e.g. ``float32_quantizer_kwargs``)."""
    from quark_brevitas.backend import wbiol_kwargs
    from quark_brevitas.config import QLayerConfig, QTensorConfig

    kwargs = wbiol_kwargs(QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(),
                                       bias=QTensorConfig(bit_width=32)))
    if kwargs_filter is not None:
        kwargs = kwargs_filter(kwargs)
    torch.manual_seed(0)
    return qnn.QuantLinear(8, 4, bias=True, dtype=dtype, **kwargs)


def export_linear(**kwargs: object) -> qnn.QuantLinear:
    """A QuantLinear(32, 4) without bias, in eval mode, with the Brevitas quantizers given as keywords."""
    torch.manual_seed(0)
    return qnn.QuantLinear(32, 4, bias=False, **kwargs).eval()


def weight_only_linear(spec: Any, features: int, outputs: int) -> qnn.QuantLinear:
    """A bias-free QuantLinear(features, outputs) with the library's weight quantizer for ``spec`` and nothing else,
    seeded: the layer the rounding algorithms' column loops are tested on."""
    torch.manual_seed(0)
    return qnn.QuantLinear(features, outputs, bias=False, weight_quant=build_quantizer(spec, "weight"))
