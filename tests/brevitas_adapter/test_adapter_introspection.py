"""Canaries of the adapter: the quantizer walk and questions about proxies and quant tensors
(quark_brevitas/brevitas_adapter/introspection.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import brevitas.nn as qnn
import torch
from brevitas.quant.scaled_int import Int8WeightPerTensorFloat
from helpers.adapter_layers import export_linear, quant_linear
from torch import nn

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.brevitas_adapter import (
    generative_quantizers,
    groupwise_parts,
    weight_quant_disabled,
)


def test_quantizer_walk_finds_every_proxy_with_its_kind() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = nn.Sequential(quant_linear(act=QTensorConfig()))
    sites = {site.attribute: site for site in adapter.iter_quantizers(layer)}
    assert {"weight_quant", "input_quant"} <= set(sites), sorted(sites)
    assert sites["weight_quant"].kind == "weight" and sites["input_quant"].kind == "act"
    assert sites["weight_quant"].layer_name == "0" and sites["weight_quant"].role == "weight"
    assert "0.bias_quant" in adapter.quantizer_names(layer)  # disabled proxies are still proxies


def test_dynamic_activation_quantizers_are_recognised() -> None:
    from quark_brevitas.config import QTensorConfig

    dynamic = quant_linear(act=QTensorConfig(is_dynamic=True))
    static = quant_linear(act=QTensorConfig())
    assert adapter.is_dynamic_activation(dynamic.input_quant)
    assert not adapter.is_dynamic_activation(static.input_quant)


def test_generative_quantizers_ship_in_brevitas_examples() -> None:
    for name in ("IntWeightSymmetricGroupQuant", "Int8DynamicActPerTensorFloat", "Int8DynamicActPerRowFloat",
                 "ShiftedUint8DynamicActPerRowFloat", "Int8DynamicActPerGroupFloat"):
        assert hasattr(adapter.generative_quantizers, name), f"brevitas_examples lost {name}"


def test_float8_table_matches_torch() -> None:
    for (e, m, _bias), dtype in adapter.FLOAT8_DTYPES.items():
        info = torch.finfo(dtype)
        assert info.bits == 1 + e + m
    assert adapter.float8_dtype(4, 3) is torch.float8_e4m3fn
    assert adapter.float8_dtype(5, 2, fnuz=True) is torch.float8_e5m2fnuz
    assert adapter.float8_dtype(3, 2) is None


def test_quantized_units_are_outermost_layers_and_equalized_wrappers() -> None:
    from quark_brevitas.backend.layers import QuantMultiheadAttention

    attention = QuantMultiheadAttention(8, 2, batch_first=True, packed_in_proj=False)
    model = nn.Sequential(adapter.wrap_equalized(quant_linear(), 8, [1, -1]), attention)
    units = adapter.quantized_units(model, {qnn.QuantLinear, QuantMultiheadAttention})
    assert list(units) == ["0", "1"], "EqualizedModule no longer keeps its layer as .layer, or the walk changed"
    assert isinstance(units["0"], adapter.EqualizedModule) and units["1"] is attention


def test_weight_pairs_are_the_float_and_quantized_weights_in_layout() -> None:
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.config.specs import narrow_range_of
    from quark_brevitas.types import QSchemeType

    spec = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_group, group_size=4)
    grouped = quant_linear(spec)
    ((float_weight, quant_weight),) = adapter.weight_quantization_pairs(grouped)
    assert float_weight is not None and quant_weight.shape == grouped.weight.shape, \
        "group-wise quant tensors' .value is no longer in the weight's layout"
    assert torch.equal(float_weight, grouped.weight.detach())
    from helpers import reference as ref

    w = grouped.weight.detach()
    narrow = narrow_range_of(spec)  # the default 4-bit grid: full range -8..7 with max / 7.5
    scale = ref.group_absmax(w, 4) / (7.0 if narrow else 7.5)
    expected = ref.int_qdq(w, scale, 0.0, 4, True, narrow)
    assert torch.allclose(quant_weight, expected, atol=1e-6), "the quantized weight is not the group-wise qdq"
    with adapter.weight_quant_disabled(grouped.weight_quant):
        assert adapter.weight_quantization_pairs(grouped) == []


def test_input_quantizer_hook_sees_the_quantized_input_and_runs_when_disabled() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = quant_linear(act=QTensorConfig())
    seen = []
    adapter.input_quantizer(layer).register_forward_hook(lambda m, a, out: seen.append(adapter.plain_tensor(out)))
    x = torch.randn(4, 8)
    with adapter.calibration_mode(layer):
        layer(x)
    layer.eval()
    layer(x)
    step = (seen[-1] - x).abs().max()
    assert isinstance(seen[-1], torch.Tensor) and 0 < step < x.abs().max() / 100, "input_quant output changed"
    with adapter.quantization_disabled(layer):
        layer(x)
    assert torch.equal(seen[-1], x), "a disabled input quantizer no longer passes its input through (or is skipped)"


def test_groupwise_parts_rebuild_the_quantized_weight() -> None:
    layer = export_linear(weight_quant=generative_quantizers.IntWeightSymmetricGroupQuant.let(group_size=8))
    with torch.no_grad():
        qt = layer.quant_weight()
    value, scale, zero_point, group_dim, group_size = groupwise_parts(qt)
    assert (group_dim, group_size) == (1, 8), "Brevitas's group-wise quant tensor changed its group_dim/group_size"
    assert tuple(value.shape) == (4, 4, 8), (
        f"Brevitas's group-wise quant tensor keeps value_ as {tuple(value.shape)}, not [out, groups, group_size]; "
        "update brevitas_adapter.groupwise_parts (the blocked weight export reads it)"
    )
    codes = value / scale
    torch.testing.assert_close(codes, codes.round())
    assert zero_point is None or not bool(zero_point.any())
    torch.testing.assert_close(value.flatten(1, 2), qt.value)


def test_weight_quant_disabled_passes_the_float_weight() -> None:
    layer = export_linear(weight_quant=Int8WeightPerTensorFloat)
    with torch.no_grad(), weight_quant_disabled(layer.weight_quant):
        out = layer.weight_quant(layer.weight)
    value = getattr(out, "value", out)
    assert torch.equal(value, layer.weight), "Brevitas's proxy 'disable_quant' flag no longer bypasses quantization"
    with torch.no_grad():
        assert not torch.equal(layer.quant_weight().value, layer.weight), "weight_quant_disabled did not restore"
