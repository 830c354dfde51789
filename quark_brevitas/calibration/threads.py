"""How many intra-op threads torch uses while quantizing (issue 20).

The user's choice always wins: ``torch.set_num_threads`` (before or after importing this package) and the
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` variables are respected, and on one process nothing is changed (torch
already uses every core it sees). Only when calibration is sharded over ``n`` ``torch.distributed`` processes on
one machine and the thread count is still torch's default does each process run with ``max(1, cores // n)``
threads for the duration of the call: ``n`` processes each spinning up a thread per core would oversubscribe the
machine ``n`` times (on 2 cores, OpenMP spin-waiting makes that several times slower than one thread each).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["available_cores", "thread_count_is_default", "threads_per_process"]

#: Environment variables by which a user fixes the thread count.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: torch's thread count when this module was first imported (before the caller could change it, normally).
_AT_IMPORT = torch.get_num_threads()


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_count_is_default() -> bool:
    """Whether torch's intra-op thread count is still what torch chose itself: no thread variable set, unchanged
    since this package was imported, and one of the counts torch picks by default (the logical or physical
    cores), so that a count set before the import is not mistaken for the default."""
    if any(os.environ.get(name) for name in THREAD_VARIABLES):
        return False
    current, cores = torch.get_num_threads(), available_cores()
    return current == _AT_IMPORT and current in {cores, max(1, cores // 2)}


@contextlib.contextmanager
def threads_per_process(shard: Any) -> Iterator[None]:
    """While the context lasts, ``max(1, cores // world_size)`` threads when ``shard`` (a
    :class:`~quark_brevitas.brevitas_adapter.Shard`, or ``None``) splits the work over several processes and the
    user left the thread count alone; otherwise nothing changes."""
    world = getattr(shard, "world_size", 1) if shard is not None else 1
    if world < 2 or not thread_count_is_default():
        yield
        return
    previous = torch.get_num_threads()
    share = max(1, available_cores() // world)
    logger.info("%d processes share %d cores: %d torch thread(s) each (set torch.set_num_threads or "
                "OMP_NUM_THREADS to choose)", world, available_cores(), share)
    torch.set_num_threads(share)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
