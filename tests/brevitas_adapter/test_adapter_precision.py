"""Canaries of the adapter: float32 quantizers for half-precision models (quark_brevitas/brevitas_adapter/precision.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import pytest
import torch
from helpers.adapter_layers import half_linear

from quark_brevitas import brevitas_adapter as adapter


def test_weight_quantizers_take_their_dtype_from_the_weight_unless_the_injector_sets_it() -> None:
    """SolveDtypeDeviceFromTrackedParameterList: a float16 weight gives a float16 scale; an explicit dtype in
    the injector (float32_quantizer_kwargs) wins, also after the re-initialisation a state-dict load does."""
    plain = half_linear(torch.float16)
    plain.quant_weight()
    assert plain.weight_quant.tensor_quant.scaling_impl.value.dtype == torch.float16, \
        "Brevitas no longer derives the weight scale's dtype from the weight: keep_quantizers_float32 may be obsolete"
    wide = half_linear(torch.float16, adapter.float32_quantizer_kwargs)
    wide.quant_weight()
    state = wide.state_dict()
    assert wide.weight_quant.tensor_quant.scaling_impl.value.dtype == torch.float32
    with adapter.ignore_missing_keys():
        wide.load_state_dict(state)
    assert wide.weight_quant.tensor_quant.scaling_impl.value.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_layers_mix_dtypes_without_float32_quantizers(dtype: torch.dtype) -> None:
    """The failure keep_quantizers_float32 fixes: activation scales are float32, so a half layer's
    quantized input is float32 and meets a half weight."""
    layer = half_linear(dtype)
    with pytest.raises(RuntimeError, match="dtype|type"):
        layer(torch.randn(2, 8, dtype=dtype))
    fixed = half_linear(dtype, adapter.float32_quantizer_kwargs)
    adapter.keep_quantizers_float32(fixed)
    out = fixed(torch.randn(2, 8, dtype=dtype))
    assert out.dtype == dtype
    assert all(t.dtype == torch.float32 for s in adapter.iter_quantizers(fixed, enabled_only=False)
               for t in (*s.proxy.parameters(), *s.proxy.buffers()) if t.is_floating_point())


def test_quant_tensors_keep_their_values_in_the_first_field() -> None:
    from brevitas.quant_tensor import (
        FloatQuantTensor,
        GroupwiseFloatQuantTensor,
        GroupwiseIntQuantTensor,
        IntQuantTensor,
    )

    assert IntQuantTensor._fields[0] == "value" and FloatQuantTensor._fields[0] == "value"
    assert GroupwiseIntQuantTensor._fields[0] == "value_" and GroupwiseFloatQuantTensor._fields[0] == "value_"
