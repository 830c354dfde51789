"""Peak memory held in tensors, counted deterministically: PyTorch's own record of every CPU allocation and release
(the profiler's memory events), summed in order. Sampling the process (resident set, glibc's counters) depends on
timing and on what the allocator keeps; this counts what the code holds, the same on every run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(run: Callable[[], Any]) -> int:
    """The most bytes of CPU tensors allocated during ``run()`` and not yet released, at any moment of it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run()
    events = sorted((event for event in recorded.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        if event.device_type() == torch._C._autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak
