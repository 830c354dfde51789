"""Canaries of the adapter: statistics combined across processes (quark_brevitas/brevitas_adapter/distributed.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import pytest
import torch
from helpers.adapter_layers import quant_linear
from torch import nn

from quark_brevitas import brevitas_adapter as adapter
from quark_brevitas.errors import CalibrationDataError, ModelError


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
    reference, halves = quant_linear(act=act), [quant_linear(act=act) for _ in _SHARDS]
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
        models = [nn.Sequential(quant_linear(weight=weight)) for _ in shards]
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


# ===================================================================== shards and process groups
def test_shard_helpers_without_a_process_group() -> None:
    """Outside ``torch.distributed`` nothing is sharded, ``distributed=True`` is refused before any work, and a
    barrier without a shard returns at once."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    assert adapter.current_shard() is None and adapter.current_shard(False) is None
    with pytest.raises(ModelError, match="distributed=True needs an initialised torch.distributed process group"):
        adapter.current_shard(True)
    adapter.barrier(None)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\), got rank 2, world_size 2"):
        adapter.Shard(2, 2)
    from quark_brevitas.calibration import data

    assert data.Shard is adapter.Shard, "data.Shard must stay the adapter's class (one Shard, re-exported)"


def test_require_equal_shares_counts_every_batch_of_the_loader() -> None:
    shard = adapter.Shard(1, 2)
    adapter.require_equal_shares([0, 1, 2, 3], shard, "BiasCorrection")
    with pytest.raises(CalibrationDataError, match=r"BiasCorrection over 2 processes needs a number of calibration "
                                                   r"batches divisible by 2 \(Brevitas averages equal shares\); got 5"):
        adapter.require_equal_shares(range(5), shard, "BiasCorrection")
    with pytest.raises(CalibrationDataError, match="got 3"):  # a loader without len() is counted
        adapter.require_equal_shares((b for b in range(3)), shard, "BiasCorrection")


def test_barrier_and_all_reduce_in_a_one_process_group(tmp_path) -> None:
    """``barrier`` and ``Shard.all_reduce`` go through ``torch.distributed`` (gloo, one process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert adapter.current_shard() is None, "one process is not sharded"
        shard = adapter.Shard(0, 1)
        adapter.barrier(shard)
        tensor = torch.tensor([1.0, -2.0])
        assert shard.all_reduce(tensor, "max") is tensor and tensor.tolist() == [1.0, -2.0]
        assert shard.all_reduce(tensor, "sum").tolist() == [1.0, -2.0]
    finally:
        dist.destroy_process_group()
