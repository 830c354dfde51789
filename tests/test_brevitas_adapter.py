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
