"""Canaries: one test per Brevitas internal the adapter (quark_brevitas/brevitas_adapter.py) relies on.

Each test names the internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import brevitas
import brevitas.nn as qnn
import pytest
import torch
from brevitas import config as brevitas_config
from packaging.version import Version
from torch import nn

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.quantizers import build_quantizer


def _layer(weight=None, act=None) -> qnn.QuantLinear:
    from quark_brevitas.config import QTensorConfig

    torch.manual_seed(0)
    return qnn.QuantLinear(8, 4, bias=True,
                           weight_quant=build_quantizer(weight or QTensorConfig(), "weight"),
                           input_quant=build_quantizer(act, "input_tensors") if act is not None else None,
                           return_quant_tensor=False)


def test_supported_version_range_is_installed() -> None:
    low, high = (Version(v) for v in adapter.SUPPORTED_BREVITAS)
    assert low <= Version(brevitas.__version__) < high, "the adapter's SUPPORTED_BREVITAS must include the install"


@pytest.mark.parametrize("flag", ["IGNORE_MISSING_KEYS", "_FULL_STATE_DICT"])
def test_global_flags_exist(flag: str) -> None:
    assert hasattr(brevitas_config, flag), f"brevitas.config.{flag} is gone: checkpoint loading relies on it"
    context = adapter.ignore_missing_keys if flag == "IGNORE_MISSING_KEYS" else adapter.full_state_dict
    before = getattr(brevitas_config, flag)
    with context():
        assert getattr(brevitas_config, flag) is True
    assert getattr(brevitas_config, flag) == before


def test_full_state_dict_includes_uninitialised_activation_scales() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = _layer(act=QTensorConfig())
    plain = set(layer.state_dict())
    with adapter.full_state_dict():
        full = set(layer.state_dict())
    assert full > plain, "_FULL_STATE_DICT no longer adds uninitialised quantizer values to state_dict()"


def test_private_symbolic_trace_accepts_a_custom_tracer() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.ReLU())
    traced = adapter.symbolic_trace(model, lambda m, _: isinstance(m, MyLinear))
    assert adapter.is_graph_module(traced)
    assert any(node.op == "call_module" and node.target == "0" for node in traced.graph.nodes), \
        "brevitas.fx.brevitas_tracer._symbolic_trace no longer keeps leaf modules of a custom tracer"


def test_quantizer_walk_finds_every_proxy_with_its_kind() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = nn.Sequential(_layer(act=QTensorConfig()))
    sites = {site.attribute: site for site in adapter.iter_quantizers(layer)}
    assert {"weight_quant", "input_quant"} <= set(sites), sorted(sites)
    assert sites["weight_quant"].kind == "weight" and sites["input_quant"].kind == "act"
    assert sites["weight_quant"].layer_name == "0" and sites["weight_quant"].role == "weight"
    assert "0.bias_quant" in adapter.quantizer_names(layer)  # disabled proxies are still proxies


def test_dynamic_activation_quantizers_are_recognised() -> None:
    from quark_brevitas.config import QTensorConfig

    dynamic = _layer(act=QTensorConfig(is_dynamic=True))
    static = _layer(act=QTensorConfig())
    assert adapter.is_dynamic_activation(dynamic.input_quant)
    assert not adapter.is_dynamic_activation(static.input_quant)


def test_calibration_mode_keeps_dynamic_quantizers_quantizing() -> None:
    """Relies on the proxies' ``disable_quant`` and the observers' ``observer_only`` attributes."""
    from quark_brevitas.config import QTensorConfig

    layer = _layer(act=QTensorConfig(is_dynamic=True))
    flags = [m for m in layer.input_quant.modules() if hasattr(m, "observer_only")]
    assert hasattr(layer.input_quant, "disable_quant")
    x = torch.randn(3, 8)

    def value(t):
        return t.value if hasattr(t, "value") else t

    with torch.no_grad():
        quantized = value(layer.input_quant(x))
    assert not torch.equal(quantized, x)
    with torch.no_grad(), adapter.calibration_mode(layer):
        assert layer.input_quant.disable_quant is False
        assert all(m.observer_only is False for m in flags)
        inside = value(layer.input_quant(x))
    assert torch.equal(inside, quantized), "dynamic quantizers must quantize inside calibration mode"


def test_scale_parameters_live_in_scaling_impl() -> None:
    layer = _layer()
    scales = adapter.scale_parameters(nn.Sequential(layer))
    assert scales, "no parameter under a 'scaling_impl' module: Brevitas renamed the scale module"
    assert all(".scaling_impl." in name for name in scales)
    assert adapter.scale_impl(layer.weight_quant) is not None


def test_scale_initialisation_flags() -> None:
    """``init_done`` (parameter-from-stats scalings) / ``counter`` and ``collect_stats_steps`` (runtime
    statistics): marking a scale initialised must stop Brevitas from re-deriving it."""
    from quark_brevitas.config import QTensorConfig

    layer = _layer(act=QTensorConfig())
    impl = adapter.scale_impl(layer.input_quant)
    assert hasattr(impl, "counter") and hasattr(impl, "collect_stats_steps"), type(impl).__name__
    with torch.no_grad():
        impl.value.fill_(0.5)
    adapter.mark_scale_initialised(impl)
    layer.train()
    layer(torch.randn(4, 8) * 100)
    assert float(impl.value.detach()) == 0.5, "a scale marked initialised was re-estimated from statistics"
    weight_impl = adapter.scale_impl(layer.weight_quant)
    assert hasattr(weight_impl, "init_done"), type(weight_impl).__name__


def test_generative_quantizers_ship_in_brevitas_examples() -> None:
    for name in ("IntWeightSymmetricGroupQuant", "Int8DynamicActPerTensorFloat", "Int8DynamicActPerRowFloat",
                 "ShiftedUint8DynamicActPerRowFloat", "Int8DynamicActPerGroupFloat"):
        assert hasattr(adapter.generative_quantizers, name), f"brevitas_examples lost {name}"


def test_accumulator_aware_gpfq_ships_in_brevitas_examples() -> None:
    assert adapter.a2gpfq_available(), "brevitas_examples.common.axe.a2gpfq_mode is gone"


def test_gptq_mode_takes_create_weight_orig() -> None:
    layer = nn.Sequential(_layer())
    adapter.init_weight_scales(layer)
    with torch.no_grad(), adapter.gptq_mode(layer, act_order=False) as mode:
        for _ in range(mode.num_layers):
            layer(torch.randn(16, 8))
            mode.update()
    assert not hasattr(layer[0], "weight_orig"), "gptq_mode(create_weight_orig=False) kept a float copy"


def test_equalized_module_structure() -> None:
    """Activation equalization wraps a layer in EqualizedModule(scale=ScaleBias(...), layer=...)."""
    wrapped = adapter.wrap_equalized(nn.Linear(8, 4), 8, [8])
    assert adapter.equalized_scale_shape(wrapped) == (8, [8])
    assert isinstance(wrapped.layer, nn.Linear) and wrapped.scale.weight.shape == (8,)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(wrapped(x), wrapped.layer(x))  # unit scales


def test_load_quant_model_mode_marks_loaded_scales_initialised() -> None:
    source = _layer()
    source(torch.randn(2, 8))
    target = _layer()
    with torch.no_grad():
        target.weight.mul_(3.0)
    with adapter.ignore_missing_keys(), adapter.load_quant_model_mode(target):
        target.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert torch.equal(target.quant_weight().value, source.quant_weight().value)


def test_float8_table_matches_torch() -> None:
    for (e, m, _bias), dtype in adapter.FLOAT8_DTYPES.items():
        info = torch.finfo(dtype)
        assert info.bits == 1 + e + m
    assert adapter.float8_dtype(4, 3) is torch.float8_e4m3fn
    assert adapter.float8_dtype(5, 2, fnuz=True) is torch.float8_e5m2fnuz
    assert adapter.float8_dtype(3, 2) is None


# ===================================================================== weight grids and activation re-calibration
def _grid_specs():
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import Dtype, ParamType, QSchemeType, RoundType, ScaleType

    return [
        QTensorConfig(),
        QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
        QTensorConfig(bit_width=3, symmetric=False),
        QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=4, symmetric=False),
        QTensorConfig(qscheme=QSchemeType.per_group, group_size=4, bit_width=4, param_type=ParamType.mse),
        QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4, round_method=RoundType.round,
                      scale_type=ScaleType.pof2),
    ]


@pytest.mark.parametrize("spec", _grid_specs(), ids=lambda s: s.short())
def test_weight_grid_repeats_int_quant_and_reinitialises_from_any_tensor(spec) -> None:
    """Guards ``IntQuant`` (x / scale + zero point, float_to_int_impl, tensor_clamp_impl, min_int/max_int, then
    (codes - zero point) * scale), the proxy's QuantTensor scale/zero point, and ``init_done`` plus the
    parameter-from-stats value folding (x 1 for scales, + 0 for zero points) of weight scales and zero points."""
    layer = _layer(spec)
    grid = adapter.weight_grid(layer)
    assert torch.equal(grid.quantize(layer.weight.detach()), layer.quant_weight().value)
    other = torch.randn_like(layer.weight) * 3
    fresh = _layer(spec)
    with torch.no_grad():
        fresh.weight.copy_(other)
    expected = fresh.quant_weight().value  # a quantizer initialised from ``other`` the first time
    for _ in range(2):  # re-initialising twice must give the same grid (no accumulation in the parameters)
        grid = adapter.weight_grid(layer, other)
    assert torch.equal(grid.quantize(other), expected)
    with torch.no_grad():
        layer.weight.copy_(grid.quantize(other))
    assert torch.equal(layer.quant_weight().value, layer.weight), "values on the grid must stay where they are"
    with adapter.quantization_disabled(layer):  # works while quantization is switched off too
        assert torch.equal(adapter.weight_grid(layer, other).quantize(other), expected)


def test_int_weight_format() -> None:
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import Dtype, QSchemeType

    assert adapter.int_weight_format(_layer()) == adapter.IntWeightFormat(8, -1, True)
    per_group = QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=4, symmetric=False)
    assert adapter.int_weight_format(_layer(per_group)) == adapter.IntWeightFormat(4, 4, False)
    assert adapter.int_weight_format(_layer(QTensorConfig(dtype=Dtype.fp8_e4m3))) is None
    assert adapter.int_weight_format(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_restart_activation_statistics_gives_a_fresh_calibration(symmetric: bool) -> None:
    """Guards ``ParameterFromRuntimeStatsScaling`` / ``ParameterFromRuntimeZeroPoint``: ``counter``, ``buffer``
    and ``value`` (1 for scales, 0 for zero points) are the whole calibration state."""
    from quark_brevitas.calibration import calibrate
    from quark_brevitas.config import QTensorConfig

    act = QTensorConfig(symmetric=symmetric)
    torch.manual_seed(1)
    first = [torch.randn(16, 8) for _ in range(3)]
    second = [torch.randn(16, 8) * 4 + 1 for _ in range(3)]
    layer, reference = _layer(act=act), _layer(act=act)
    calibrate(layer, first)
    assert adapter.has_static_activation_quantizers(layer)
    assert adapter.restart_activation_statistics(layer) >= 1
    calibrate(layer, second)
    calibrate(reference, second)
    assert torch.equal(layer.input_quant.scale(), reference.input_quant.scale())
    assert torch.equal(layer.input_quant.zero_point(), reference.input_quant.zero_point())
