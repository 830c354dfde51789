"""Distributed calibration: this process's share of the data, and combining what Brevitas accumulated.

Under ``torch.distributed`` each process calibrates on every ``world_size``-th batch (:class:`Shard`), and
after every pass the statistics Brevitas accumulated inside the model (activation ranges, GPTQ/GPFQ
Hessians, equalization ranges, BatchNorm statistics) are combined across the processes
(:func:`all_reduce_statistics`), so every process ends with the model one process would have produced.
Everything that talks to ``torch.distributed`` or to Brevitas's per-layer statistics objects lives here:
the data, the pipeline and the streaming writer call :func:`current_shard`, :func:`barrier`,
:func:`require_equal_shares` and :meth:`Shard.all_reduce`; canaries in
``tests/brevitas_adapter/test_adapter_distributed.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.errors import CalibrationDataError, ModelError, QuarkBrevitasError

__all__ = [
    "Reducer",
    "Shard",
    "all_reduce_statistics",
    "barrier",
    "current_shard",
    "equalization_statistics",
    "gpxq_optimizers",
    "require_equal_shares",
    "runtime_stats_modules",
]


# ===================================================================== shards and process groups
@dataclass(frozen=True)
class Shard:
    """This process's share of calibration data sharded over ``torch.distributed`` processes: the batches
    whose index is ``rank`` modulo ``world_size``. ``group``: the process group (``None``: the default one)."""

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Shard: rank must be in [0, world_size), got rank {self.rank}, world_size "
                             f"{self.world_size}")

    @classmethod
    def current(cls) -> Shard | None:
        """The shard of this process if a ``torch.distributed`` process group of more than one process is
        initialised (``torchrun``), else ``None``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_rank(), dist.get_world_size())

    def owns(self, index: int) -> bool:
        return index % self.world_size == self.rank

    def global_index(self, local: int) -> int:
        """The index in the whole loader of this process's ``local``-th batch."""
        return local * self.world_size + self.rank

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return tensor


def current_shard(distributed: bool | None = None) -> Shard | None:
    """This process's shard for a quantization run: sharded when a process group of several processes is
    initialised, unless ``distributed=False``; ``distributed=True`` requires one (``ModelError`` otherwise,
    before any work, rather than a silent single-process run on every rank)."""
    shard = Shard.current() if distributed is not False else None
    if distributed is True and shard is None:
        raise ModelError("distributed=True needs an initialised torch.distributed process group of at least "
                         "two processes (launch with torchrun and call torch.distributed.init_process_group)")
    return shard


def barrier(shard: Shard | None) -> None:
    """Wait until every process of ``shard``'s group gets here (nothing to wait for without a shard): the
    first process writes shared files that the others then read."""
    if shard is not None:
        import torch.distributed as dist

        dist.barrier(group=shard.group)


def require_equal_shares(loader: Iterable[Any], shard: Shard, needed_by: str) -> None:
    """Reject calibration data that the processes cannot share equally, for an algorithm (``needed_by``, named
    in the message) that Brevitas averages over processes assuming equal shares: its bias correction
    all-reduces per-process means. ``loader``: the user's whole loader (every process's batches)."""
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = len(list(loader))
    if total % shard.world_size:
        raise CalibrationDataError(
            f"{needed_by} over {shard.world_size} processes needs a number of calibration batches "
            f"divisible by {shard.world_size} (Brevitas averages equal shares); got {total}"
        )


# ===================================================================== statistics across processes
#: ``reduce(tensor, op)``: combine ``tensor`` in place with the same tensor of every other process (``op``:
#: ``"sum"`` or ``"max"``) and return it; :meth:`quark_brevitas.calibration.data.CalibrationData.all_reduce`.
Reducer = Callable[[torch.Tensor, str], torch.Tensor]


def all_reduce_statistics(model: nn.Module, reduce: Reducer) -> int:
    """Combine the statistics Brevitas accumulated inside ``model`` during a pass over this process's share
    of the calibration data with those of the other processes; return how many were combined.

    Brevitas keeps these statistics in its own objects, which only this module may touch:

    - activation calibration: each runtime-statistics scale / zero point averages per-batch statistics
      (``buffer`` over ``counter`` batches) -> the batch-weighted mean over the processes;
    - GPTQ: each layer's Hessian ``H`` is a mean over ``nsamples`` input rows -> the sample-weighted mean;
    - GPFQ (and accumulator-aware GPFQ): ``H`` and ``G`` are sums over batches -> the sum;
    - layerwise activation equalization: per-channel input ranges are maxima -> the maximum;
    - BatchNorm re-estimation: running statistics averaged over ``num_batches_tracked`` batches -> the
      batch-weighted mean.

    Bias correction synchronises itself (Brevitas's ``bias_correction_mode`` all-reduces its correction
    when ``torch.distributed`` is initialised). Every process must run the same model, so the objects are
    found in the same order everywhere; the result is the single-process statistic up to float summation
    order.
    """
    return (_reduce_runtime_stats(model, reduce) + _reduce_gpxq(model, reduce)
            + _reduce_equalization(model, reduce) + _reduce_norm_correction(model, reduce))


def _weighted_mean(tensors: list[torch.Tensor], local: int, total: float, reduce: Reducer) -> None:
    """Replace each tensor, a mean over ``local`` items here, by the mean over all processes' items."""
    for tensor in tensors:
        combined = reduce(tensor.detach().to(torch.float64) * local, "sum") / total
        tensor.detach().copy_(combined.to(tensor.dtype))


def _counts(values: list[float], device: torch.device, reduce: Reducer) -> list[float]:
    counts = torch.tensor(values, dtype=torch.float64, device=device)
    return reduce(counts, "sum").tolist()


def runtime_stats_modules(model: nn.Module) -> list[nn.Module]:
    """The runtime-statistics scales and zero points of ``model`` still collecting statistics (Brevitas's
    ``ParameterFromRuntimeStatsScaling`` / ``ParameterFromRuntimeZeroPoint`` whose ``counter`` has not passed
    ``collect_stats_steps``): the activation quantizers calibration is initialising."""
    from brevitas.core.scaling.standalone import ParameterFromRuntimeStatsScaling
    from brevitas.core.zero_point import ParameterFromRuntimeZeroPoint

    kinds = (ParameterFromRuntimeStatsScaling, ParameterFromRuntimeZeroPoint)
    return [m for m in model.modules() if isinstance(m, kinds) and m.counter <= m.collect_stats_steps]


def _mean_over_processes(entries: list[tuple[int, list[torch.Tensor], Callable[[int], None]]],
                         reduce: Reducer) -> int:
    """Statistics that are means: each entry is (how many items its tensors average here, the tensors, how to
    record the new count). Entries without an item on any process are left alone."""
    if not entries:
        return 0
    totals = _counts([float(count) for count, _, _ in entries], entries[0][1][0].device, reduce)
    done = 0
    for (count, tensors, set_count), total in zip(entries, totals):
        if total > 0:
            _weighted_mean(tensors, count, total, reduce)
            set_count(int(total))
            done += 1
    return done


def _reduce_runtime_stats(model: nn.Module, reduce: Reducer) -> int:
    return _mean_over_processes([(m.counter, [m.buffer], functools.partial(setattr, m, "counter"))
                                 for m in runtime_stats_modules(model)], reduce)


def gpxq_optimizers(model: nn.Module) -> list[Any]:
    """The per-layer GPTQ / GPFQ objects of a GPxQ context running on ``model`` that still wait for their
    update, in module order: Brevitas keeps them in the context, and reaches them from the model only
    through the forward pre-hook each registers on its layer (a ``partial`` of its ``update_batch``)."""
    from brevitas.graph.gpxq import GPxQ

    found = []
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook.func, "__self__", None) if isinstance(hook, functools.partial) else None
            if isinstance(owner, GPxQ):
                found.append(owner)
    return found


def _reduce_gpxq(model: nn.Module, reduce: Reducer) -> int:
    from brevitas.graph.gpfq import GPFQ
    from brevitas.graph.gptq import GPTQ

    pending = [o for o in gpxq_optimizers(model) if hasattr(o, "H")]
    unknown = [o for o in pending if not isinstance(o, GPTQ | GPFQ)]
    if unknown:
        raise QuarkBrevitasError(f"distributed calibration cannot combine the statistics of "
                                 f"{type(unknown[0]).__name__} (layer {unknown[0].name})")
    # GPTQ's Hessian is a mean over input rows; GPFQ's H and G are sums over batches (a non-zero H means data).
    done = _mean_over_processes([(o.nsamples, [o.H], functools.partial(setattr, o, "nsamples"))
                                 for o in pending if isinstance(o, GPTQ)], reduce)
    sums = [o for o in pending if isinstance(o, GPFQ)]
    if sums:
        totals = _counts([float(bool(o.H.any())) for o in sums], sums[0].H.device, reduce)
        for optimizer, total in zip(sums, totals):
            if total > 0:
                reduce(optimizer.H, "sum")
                reduce(optimizer.G, "sum")
                done += 1
    return done


def equalization_statistics(model: nn.Module) -> list[tuple[Any, Any]]:
    """``(owner, key)`` of every per-channel input range layerwise activation equalization is collecting in
    ``model``: Brevitas wraps each layer in a ``KwargsForwardHook`` whose hook is a ``partial`` of the
    equalization object's ``forward_stats_hook``; the ranges live in that object's ``float_act_map[key]``."""
    from brevitas.utils.torch_utils import KwargsForwardHook

    found = []
    for module in model.modules():
        hook = getattr(module, "hook_fn", None)
        if isinstance(module, KwargsForwardHook) and isinstance(hook, functools.partial):
            owner = getattr(hook.func, "__self__", None)
            if owner is not None and hasattr(owner, "float_act_map"):
                found.append((owner, hook.keywords["name"]))
    return found


def _reduce_equalization(model: nn.Module, reduce: Reducer) -> int:
    done = 0
    for owner, key in equalization_statistics(model):
        value = owner.float_act_map.get(key)
        if value is not None:
            reduce(value, "max")
            done += 1
    return done


def _reduce_norm_correction(model: nn.Module, reduce: Reducer) -> int:
    """BatchNorm layers inside Brevitas's ``norm_correction_mode`` (marked by its ``old_running_mean``
    buffer) average their statistics over ``num_batches_tracked`` batches (momentum ``None``)."""
    layers = [m for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and hasattr(m, "old_running_mean")]
    return _mean_over_processes([(int(m.num_batches_tracked), [m.running_mean, m.running_var],
                                  m.num_batches_tracked.fill_) for m in layers], reduce)
