"""Half-precision models: quantizers that compute and keep their state in float32.

Brevitas creates activation scales in float32 but weight scales in the weight's dtype and multiplies half
tensors with float32 scales, so a float16/bfloat16 model fails on its first quantized forward pass. The
patch here (float32 injectors, a pair of hooks per quantizer proxy) is the one place the package reaches
into Brevitas's dtype handling; the canaries in ``tests/brevitas_adapter/test_adapter_precision.py`` say when it becomes
obsolete.
"""

from __future__ import annotations

from typing import Any

import torch
from brevitas.quant_tensor import QuantTensor
from torch import nn

from quark_brevitas.brevitas_adapter.introspection import iter_quantizers

__all__ = ["HALF_DTYPES", "float32_quantizer_kwargs", "keep_quantizers_float32"]


# ===================================================================== half-precision models
#: Floating dtypes whose models get float32 quantizers (see :func:`keep_quantizers_float32`).
HALF_DTYPES = (torch.float16, torch.bfloat16)
_IO_DTYPE = "_quark_brevitas_io_dtype"


def _quantizer_inputs_float32(proxy: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: half-precision tensor arguments go into the quantizer as float32; the dtype
    of the first one is remembered for :func:`_quantizer_output_in_model_dtype`."""
    dtype = None
    cast = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dtype in HALF_DTYPES:
            dtype = dtype or arg.dtype
            arg = arg.float()
        cast.append(arg)
    object.__setattr__(proxy, _IO_DTYPE, dtype)
    return tuple(cast) if dtype is not None else args


def _quantizer_output_in_model_dtype(proxy: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook: the quantizer's result goes back to the dtype its input had. Of a quant tensor
    only the values are cast (its first field: ``value`` or a group-wise ``value_``); scales and zero
    points stay float32, as computed."""
    dtype = proxy.__dict__.get(_IO_DTYPE)
    if dtype is None:
        return output
    if isinstance(output, torch.Tensor):
        return output.to(dtype)
    if isinstance(output, QuantTensor):
        return output._replace(**{output._fields[0]: output[0].to(dtype)})
    return output


def float32_quantizer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A quantized layer's keyword arguments with every quantizer injector creating float32 state.

    Brevitas derives a weight or bias quantizer's dtype from the tracked parameter (a float16 weight
    gives a float16 scale) and re-creates the quantizer with it whenever a state dict is loaded; an
    explicit ``dtype`` in the injector keeps the quantizers of a half-precision model in float32 for
    good (see :func:`keep_quantizers_float32`).
    """
    return {key: value.let(dtype=torch.float32) if key.endswith("_quant") and hasattr(value, "let") else value
            for key, value in kwargs.items()}


def keep_quantizers_float32(model: nn.Module) -> None:
    """Make the quantizers of a float16/bfloat16 model compute in float32, and keep their state there.

    Brevitas creates activation scales, zero points and bias quantizers in float32 but weight scales
    in the weight's dtype, and multiplies half-precision tensors with float32 scales, so a quantized
    half model mixes dtypes and fails on its first forward pass (``Float and Half``). Here every
    quantizer's parameters and buffers are float32, and each quantizer proxy gets a pair of hooks:
    half-precision inputs are quantized in float32 (no int32-bias overflow, no bfloat16 division
    error in the scale search) and the quantized values are returned in the input's dtype, so the
    layers compute in the model's dtype. Hooks are module-level functions, so the model deep-copies
    and pickles; in a float32 copy of the model they do nothing.
    """
    for site in iter_quantizers(model, enabled_only=False):
        proxy = site.proxy
        proxy.float()
        if _quantizer_inputs_float32 not in proxy._forward_pre_hooks.values():
            proxy.register_forward_pre_hook(_quantizer_inputs_float32)
            proxy.register_forward_hook(_quantizer_output_in_model_dtype)
