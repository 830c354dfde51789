"""Canaries of the adapter: MLAS's reciprocal int8 codes (quark_brevitas/brevitas_adapter/reciprocal.py).

``ReciprocalIntQuant`` subclasses Brevitas's ``IntQuant`` and overrides ``to_int(scale, zero_point, bit_width, x)``,
relying on ``forward`` calling it, on ``input_view_impl`` giving the grouped view (``group_dim``) and on
``scaling_min_val=None`` leaving the dynamic group scale ``max|x| / 127`` unclamped.
"""

from __future__ import annotations

import inspect

import brevitas.nn as qnn
import pytest
import torch
from brevitas.core.quant import IntQuant

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.config import QTensorConfig
from quark_brevitas.quantizers import build_quantizer
from quark_brevitas.types import Dtype, QSchemeType

GROUP = 16


def _layer(spec: QTensorConfig) -> qnn.QuantLinear:
    return qnn.QuantLinear(4 * GROUP, 4, bias=False, weight_quant=None, return_quant_tensor=False,
                           input_quant=build_quantizer(spec, "input_tensors"))


def _int8_groups(**kwargs: object) -> QTensorConfig:
    return QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_group, group_size=GROUP, is_dynamic=True, **kwargs)


def test_int_quant_keeps_the_method_the_variant_overrides() -> None:
    assert list(inspect.signature(IntQuant.to_int).parameters) == ["self", "scale", "zero_point", "bit_width", "x"]
    assert "self.to_int(" in inspect.getsource(IntQuant.forward), "IntQuant.forward no longer calls to_int"


def test_dynamic_int8_per_group_inputs_compute_mlas_codes_and_scales() -> None:
    proxy = _layer(_int8_groups()).input_quant
    assert adapter.uses_reciprocal_codes(proxy)
    x = torch.randn(3, 5, 4 * GROUP, generator=torch.Generator().manual_seed(0))
    x[0, 0, :GROUP] = 0  # an all-zero group: scale 0, codes 0
    x[0, 1, GROUP:2 * GROUP] *= 1e-12  # below Brevitas's default scaling_min_val (1e-10): not clamped
    with torch.no_grad():
        out = proxy(x)
    groups = x.reshape(3, 5, 4, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    expected = torch.round(groups * inverse) * (amax / 127)
    assert torch.equal(out.value, expected.reshape(x.shape))
    assert torch.equal(out.scale.reshape(3, 5, 4, GROUP)[..., :1], amax / 127)  # Brevitas's scale: amax / 127
    assert not out.value[0, 0, :GROUP].any() and out.value[0, 1, GROUP:2 * GROUP].abs().max() > 0


@pytest.mark.parametrize("spec", [
    QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_tensor, is_dynamic=True),
    QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=GROUP, is_dynamic=True),
    QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_channel, is_dynamic=True, ch_axis=-1),
], ids=["per-tensor", "int4", "per-token"])
def test_other_dynamic_inputs_keep_brevitas_codes(spec: QTensorConfig) -> None:
    assert not adapter.uses_reciprocal_codes(_layer(spec).input_quant)
