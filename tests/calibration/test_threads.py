"""Thread counts while quantizing (issue 20): the user's setting wins; sharded processes share the cores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quark_brevitas.calibration import threads


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-core machine whose torch thread count is still torch's default (4), no thread variables set."""
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.setattr(threads, "_AT_IMPORT", 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(previous)


def _inside(shard: object) -> int:
    with threads.threads_per_process(shard):
        return torch.get_num_threads()


@pytest.mark.usefixtures("four_cores")
def test_sharded_processes_split_the_cores_and_restore_the_count() -> None:
    assert _inside(SimpleNamespace(world_size=2)) == 2
    assert _inside(SimpleNamespace(world_size=8)) == 1  # at least one thread each
    assert torch.get_num_threads() == 4


@pytest.mark.usefixtures("four_cores")
def test_one_process_keeps_every_core() -> None:
    assert _inside(None) == 4
    assert _inside(SimpleNamespace(world_size=1)) == 4


@pytest.mark.usefixtures("four_cores")
def test_a_count_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(3)
    assert _inside(SimpleNamespace(world_size=2)) == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert _inside(SimpleNamespace(world_size=2)) == 4
