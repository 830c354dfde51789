"""Canaries: one test per Brevitas internal the adapter (quark_brevitas/brevitas_adapter.py) relies on.

Each test names the internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

from typing import Any

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


# ===================================================================== statistics across processes
class _ThreadAllReduce:
    """``torch.distributed.all_reduce`` between threads of this process: what the adapter's reductions do
    across processes, so that they can be checked against one model that saw all the batches."""

    def __init__(self, size: int) -> None:
        import threading

        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def reducer(self, rank: int):
        def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            result = stacked.sum(0) if op == "sum" else stacked.amax(0)
            self.barrier.wait()
            tensor.detach().copy_(result)
            return tensor

        return reduce


def _run_shards(models: list[nn.Module], contexts: list, shards: list) -> list[int]:
    """Enter each model's context, run its shard of batches, then reduce the statistics across the models
    (if there are several); the contexts stay open."""
    with torch.no_grad():
        for context, model, shard in zip(contexts, models, shards):
            context.__enter__()
            for batch in shard:
                model(batch)
    return _reduce_in_threads(models) if len(models) > 1 else []


def _reduce_in_threads(models: list[nn.Module]) -> list[int]:
    """``all_reduce_statistics`` on each model, one thread per model (one "process" each)."""
    import threading

    group, counts = _ThreadAllReduce(len(models)), [0] * len(models)

    def run(rank: int) -> None:
        counts[rank] = adapter.all_reduce_statistics(models[rank], group.reducer(rank))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


_BATCHES = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) * (1 + i) for i in range(5)]
_SHARDS = (_BATCHES[0::2], _BATCHES[1::2])


def test_runtime_statistics_combine_as_one_calibration() -> None:
    """Activation calibration: ParameterFromRuntimeStatsScaling averages per-batch statistics in ``buffer``
    over ``counter`` batches; two halves combined must give the scale of one run over all batches."""
    from quark_brevitas.config import QTensorConfig

    act = QTensorConfig(symmetric=False)
    reference, halves = _layer(act=act), [_layer(act=act) for _ in _SHARDS]
    with torch.no_grad(), adapter.calibration_mode(reference):
        for batch in _BATCHES:
            reference(batch)
    contexts = [adapter.calibration_mode(model) for model in halves]
    modules = adapter.runtime_stats_modules(halves[0])
    assert modules and all(hasattr(m, "buffer") for m in modules), "runtime-stats scale/zero point not found"
    assert _run_shards(halves, contexts, list(_SHARDS)) == [2, 2]  # the scale and the zero point
    assert [m.counter for m in modules] == [len(_BATCHES)] * len(modules)
    with torch.no_grad():
        for context in contexts:
            context.__exit__(None, None, None)
        expected = reference.input_quant(_BATCHES[0])
        for model in halves:
            got = model.input_quant(_BATCHES[0])
            torch.testing.assert_close(got.scale, expected.scale, rtol=1e-6, atol=0)
            torch.testing.assert_close(got.zero_point, expected.zero_point, rtol=0, atol=1e-5)


def test_gptq_hessians_combine_as_one_run() -> None:
    """GPTQ keeps each layer's Hessian ``H`` (a mean over ``nsamples`` rows) in an object reached through the
    forward pre-hook it puts on the layer."""
    from quark_brevitas.config import QTensorConfig

    weight = QTensorConfig(bit_width=4)

    def quantized(shards: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        models = [nn.Sequential(_layer(weight=weight)) for _ in shards]
        for model in models:
            adapter.init_weight_scales(model)
        modes = [adapter.gptq_mode(model, act_order=False) for model in models]
        reduced = _run_shards(models, modes, shards)
        with torch.no_grad():
            optimizers = adapter.gpxq_optimizers(models[0])
            assert len(optimizers) == 1 and hasattr(optimizers[0], "H") and hasattr(optimizers[0], "nsamples"), \
                "GPTQ's per-layer object is no longer reachable through its forward pre-hook"
            if len(models) > 1:
                assert reduced == [1, 1]
                assert optimizers[0].nsamples == sum(b.shape[0] for b in _BATCHES)
            for mode in modes:
                mode.update()
                mode.__exit__(None, None, None)
            return [model[0].quant_weight().value for model in models]

    expected = quantized([_BATCHES])[0]
    for got in quantized(list(_SHARDS)):
        assert torch.equal(got, expected)


def test_equalization_ranges_combine_as_maxima() -> None:
    """Layerwise activation equalization wraps each layer in a KwargsForwardHook whose hook (a partial of
    the equalization object's forward_stats_hook) collects per-channel maxima in ``float_act_map``."""

    def equalized(shards: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(8, 4)) for _ in shards]
        for model in models[1:]:
            model.load_state_dict(models[0].state_dict())
        modes = [adapter.activation_equalization_mode(model, alpha=0.5) for model in models]
        reduced = _run_shards(models, modes, shards)
        assert len(adapter.equalization_statistics(models[0])) == 1, "equalization hooks not found"
        assert reduced == ([1, 1] if len(models) > 1 else [])
        with torch.no_grad():
            for mode in modes:
                mode.__exit__(None, None, None)
        return [model[0].scale.weight.detach().clone() for model in models]

    expected = equalized([_BATCHES])[0]
    for got in equalized(list(_SHARDS)):
        assert torch.equal(got, expected)


def test_norm_correction_statistics_combine_as_one_run() -> None:
    images = [torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(i)) + i for i in range(5)]

    def corrected(shards: list[list[torch.Tensor]]) -> list[nn.Module]:
        models = [nn.Sequential(nn.BatchNorm2d(3)).eval() for _ in shards]
        modes = [adapter.norm_correction_mode(model) for model in models]
        assert _run_shards(models, modes, shards) == ([1, 1] if len(models) > 1 else [])
        with torch.no_grad():
            for mode in modes:
                mode.__exit__(None, None, None)
        return [model[0] for model in models]

    expected = corrected([images])[0]
    for got in corrected([images[0::2], images[1::2]]):
        torch.testing.assert_close(got.running_mean, expected.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.running_var, expected.running_var, rtol=1e-6, atol=1e-6)
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


# ===================================================================== analysis (quark_brevitas.analysis)
def test_quantized_units_are_outermost_layers_and_equalized_wrappers() -> None:
    from quark_brevitas.layers import QuantMultiheadAttention

    attention = QuantMultiheadAttention(8, 2, batch_first=True, packed_in_proj=False)
    model = nn.Sequential(adapter.wrap_equalized(_layer(), 8, [1, -1]), attention)
    units = adapter.quantized_units(model, {qnn.QuantLinear, QuantMultiheadAttention})
    assert list(units) == ["0", "1"], "EqualizedModule no longer keeps its layer as .layer, or the walk changed"
    assert isinstance(units["0"], adapter.EqualizedModule) and units["1"] is attention


def test_weight_pairs_are_the_float_and_quantized_weights_in_layout() -> None:
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import QSchemeType

    grouped = _layer(QTensorConfig(bit_width=4, qscheme=QSchemeType.per_group, group_size=4))
    ((float_weight, quant_weight),) = adapter.weight_quantization_pairs(grouped)
    assert float_weight is not None and quant_weight.shape == grouped.weight.shape, \
        "group-wise quant tensors' .value is no longer in the weight's layout"
    assert torch.equal(float_weight, grouped.weight.detach())
    import reference as ref

    w = grouped.weight.detach()
    expected = ref.int_qdq(w, ref.group_symmetric_scale(w, 4, 4), 0.0, 4, True, True)
    assert torch.allclose(quant_weight, expected, atol=1e-6), "the quantized weight is not the group-wise qdq"
    with adapter.weight_quant_disabled(grouped.weight_quant):
        assert adapter.weight_quantization_pairs(grouped) == []


def test_input_quantizer_hook_sees_the_quantized_input_and_runs_when_disabled() -> None:
    from quark_brevitas.config import QTensorConfig

    layer = _layer(act=QTensorConfig())
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


def test_quantization_disabled_on_a_layer_restores_each_quantizer_state() -> None:
    from quark_brevitas.config import QTensorConfig

    model = nn.Sequential(_layer(act=QTensorConfig()), _layer(act=QTensorConfig())).eval()
    model[0].input_quant.disable_quant = True  # a quantizer already off stays off afterwards
    with adapter.quantization_disabled(model[0]):
        assert not model[0].weight_quant.is_quant_enabled
        assert model[1].weight_quant.is_quant_enabled, "disabling one layer reached another"
    assert model[0].weight_quant.is_quant_enabled and model[0].input_quant.disable_quant is True


# ===================================================================== half precision, ties, MSE, tracing (issue 13)
def _half_layer(dtype: torch.dtype, kwargs_filter: Any = None) -> qnn.QuantLinear:
    from quark_brevitas.backend import wbiol_kwargs
    from quark_brevitas.config import QLayerConfig, QTensorConfig

    kwargs = wbiol_kwargs(QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(),
                                       bias=QTensorConfig(bit_width=32)))
    if kwargs_filter is not None:
        kwargs = kwargs_filter(kwargs)
    torch.manual_seed(0)
    return qnn.QuantLinear(8, 4, bias=True, dtype=dtype, **kwargs)


def test_weight_quantizers_take_their_dtype_from_the_weight_unless_the_injector_sets_it() -> None:
    """SolveDtypeDeviceFromTrackedParameterList: a float16 weight gives a float16 scale; an explicit dtype in
    the injector (float32_quantizer_kwargs) wins, also after the re-initialisation a state-dict load does."""
    plain = _half_layer(torch.float16)
    plain.quant_weight()
    assert plain.weight_quant.tensor_quant.scaling_impl.value.dtype == torch.float16, \
        "Brevitas no longer derives the weight scale's dtype from the weight: keep_quantizers_float32 may be obsolete"
    wide = _half_layer(torch.float16, adapter.float32_quantizer_kwargs)
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
    layer = _half_layer(dtype)
    with pytest.raises(RuntimeError, match="dtype|type"):
        layer(torch.randn(2, 8, dtype=dtype))
    fixed = _half_layer(dtype, adapter.float32_quantizer_kwargs)
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


def test_registering_a_weight_reinitialises_the_quantizer_and_swap_parameter_does_not() -> None:
    layer = _layer()
    layer.quant_weight()
    scaling = layer.weight_quant.tensor_quant.scaling_impl
    assert scaling.init_done
    adapter.swap_parameter(layer, "weight", nn.Parameter(layer.weight.detach().clone()))
    assert layer.weight_quant.tensor_quant.scaling_impl is scaling and scaling.init_done
    layer.weight = nn.Parameter(layer.weight.detach().clone())
    assert not layer.weight_quant.tensor_quant.scaling_impl.init_done, \
        "QuantWeightMixin.register_parameter no longer re-initialises the quantizer: swap_parameter may be setattr"


def test_adopt_parameters_keeps_the_float_layers_parameters() -> None:
    from brevitas.graph.base import ModuleToModuleByInstance

    old = nn.Linear(8, 4)
    new = ModuleToModuleByInstance(old, qnn.QuantLinear).init_new_module(old)
    assert new.weight is not old.weight, "Brevitas's replacement now keeps the Parameter objects itself"
    adapter.adopt_parameters(new, old)
    assert new.weight is old.weight and new.bias is old.bias
    assert new.weight_quant.tracked_parameter_list[0] is old.weight


def test_mse_stats_module_interface() -> None:
    """sampled_activation_mse replaces MSE.mse_search per instance and MSE.mse_loss_fn per search."""
    from brevitas.core.stats.stats_op import MSE

    for name in ("mse_search", "mse_loss_fn", "evaluate_loss"):
        assert callable(getattr(MSE, name, None)), f"brevitas MSE lost {name}"
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import ParamType

    layer = _layer(act=QTensorConfig(param_type=ParamType.mse))
    modules = [m for m in layer.modules() if isinstance(m, MSE)]
    assert modules and all(m.stats_reduce_dim is None for m in modules)
    with adapter.sampled_activation_mse(layer):
        assert all("mse_search" in vars(m) for m in modules)
    assert not any("mse_search" in vars(m) or "mse_loss_fn" in vars(m) for m in modules)


def test_brevitas_tracer_still_warns_about_children_specs() -> None:
    """Canary for the one filter in symbolic_trace: when Brevitas stops reading treespec.children_specs,
    this fails and the filter can go."""
    import warnings

    from brevitas.fx import Tracer
    from brevitas.fx.brevitas_tracer import _symbolic_trace

    model = nn.Sequential(nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        _symbolic_trace(Tracer(), model, None)
    assert any(issubclass(w.category, FutureWarning) and "children_specs" in str(w.message) for w in raw)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        adapter.symbolic_trace(model)
    assert not any("children_specs" in str(w.message) for w in ours)
