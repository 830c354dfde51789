"""Cached activations of every calibration batch at one point of a model, in memory or on disk.

The block-by-block data phase (:mod:`quark_brevitas.blocks.engine`) runs each block on the inputs the
previous block produced; those inputs are kept here, one entry per calibration batch. An entry is any
nest of tuples, lists and dicts of tensors (a block's output, or a layer's ``(args, kwargs)``).

Entries stay in memory (on CPU) until the store holds more than its memory budget; later entries go to
files in a directory (``torch.save``, read back with ``weights_only=True``), so a calibration set whose
activations do not fit in memory still runs. With an explicit directory every entry goes to disk, which
is what a resumable run needs (the files of the last finished block survive an interruption).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quark_brevitas.calibration.data import map_tensors

logger = logging.getLogger(__name__)

__all__ = ["ActivationStore", "StoreFactory", "available_memory", "default_memory_budget", "detached",
           "nbytes"]


def available_memory() -> int | None:
    """Bytes of memory the system can still give (psutil, else Linux's ``/proc/meminfo``); ``None`` if unknown."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_memory_budget() -> int | None:
    """How many bytes of activations a store keeps in memory by default: half of the available memory."""
    free = available_memory()
    return None if free is None else free // 2


def nbytes(value: Any) -> int:
    """Bytes held by the tensors of a nest of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, tuple | list):
        return sum(nbytes(v) for v in value)
    return 0


def detached(value: Any, device: torch.device | str = "cpu") -> Any:
    """The nest with every tensor detached and moved to ``device`` (see :func:`map_tensors`)."""
    return map_tensors(value, lambda tensor: tensor.detach().to(device))


class ActivationStore:
    """A list of per-batch entries, in memory up to ``memory_budget`` bytes and on disk beyond it.

    - ``directory``: every entry is written there (the directory is created). :meth:`close` removes it
      unless ``keep``. Without a directory, entries beyond the budget go to a temporary directory that
      :meth:`close` removes.
    - ``memory_budget``: bytes kept in memory before spilling (default :func:`default_memory_budget`;
      ``None``: no limit).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, memory_budget: int | None = -1,
                 keep: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.keep = keep
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            memory_budget = 0
        elif memory_budget == -1:
            memory_budget = default_memory_budget()
        self.memory_budget = memory_budget
        self._entries: list[Any] = []  # the entry, or the Path of its file
        self._in_memory = 0
        self._temporary: Path | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, keep: bool = True) -> ActivationStore:
        """The store a previous run wrote to ``directory`` (for resuming)."""
        store = cls(directory, keep=keep)
        files = sorted(store.directory.glob("batch_*.pt"))
        for index, path in enumerate(files):
            if path.name != f"batch_{index:06d}.pt":
                raise FileNotFoundError(f"{store.directory}: batch file {index} is missing (found {path.name})")
        store._entries = list(files)
        return store

    def _spill_directory(self) -> Path:
        if self.directory is not None:
            return self.directory
        if self._temporary is None:
            self._temporary = Path(tempfile.mkdtemp(prefix="quark_brevitas_activations_"))
            logger.info("Cached activations exceed the memory budget (%.0f MiB); further batches go to %s",
                        (self.memory_budget or 0) / 2**20, self._temporary)
        return self._temporary

    def append(self, value: Any) -> None:
        """Add the entry of the next batch (its tensors should already be detached and on CPU)."""
        size = nbytes(value)
        if self.memory_budget is None or self._in_memory + size <= self.memory_budget:
            self._entries.append(value)
            self._in_memory += size
            return
        path = self._spill_directory() / f"batch_{len(self._entries):06d}.pt"
        tmp = path.with_name(path.name + ".tmp")
        torch.save(value, tmp)
        os.replace(tmp, path)
        self._entries.append(path)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> Any:
        entry = self._entries[index]
        if isinstance(entry, Path):
            return torch.load(entry, weights_only=True)
        return entry

    def __iter__(self) -> Iterator[Any]:
        for index in range(len(self)):
            yield self[index]

    @property
    def on_disk(self) -> int:
        """How many entries are files."""
        return sum(isinstance(e, Path) for e in self._entries)

    def close(self) -> None:
        """Forget the entries and remove their files (an explicit directory is kept if ``keep``)."""
        self._entries = []
        self._in_memory = 0
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
        if self.directory is not None and not self.keep:
            shutil.rmtree(self.directory, ignore_errors=True)


class StoreFactory:
    """Where cached activations go: ``None`` (memory, spilling to a temporary directory beyond half of the
    available memory), or a directory (every entry on disk, one subdirectory per store, removed when the
    store is closed; ``temporary``: the directory itself is removed by :meth:`cleanup`)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, memory_budget: int | None = -1,
                 temporary: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.memory_budget = memory_budget
        self.temporary = temporary
        self._count = 0

    def create(self, label: str) -> ActivationStore:
        if self.directory is None:
            return ActivationStore(memory_budget=self.memory_budget)
        self._count += 1
        return ActivationStore(self.directory / f"{self._count:04d}_{label}")

    def cleanup(self) -> None:
        if self.temporary and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def for_offload(cls, offload: str | os.PathLike[str] | None) -> StoreFactory:
        """``offload`` of ``quantize_model``: ``None`` (memory), ``"disk"`` (a temporary directory) or a path."""
        if offload is None:
            return cls()
        if offload == "disk":
            return cls(tempfile.mkdtemp(prefix="quark_brevitas_offload_"), temporary=True)
        if isinstance(offload, str | os.PathLike):
            return cls(offload)
        raise TypeError(f"offload must be None, 'disk' or a directory path, got {type(offload).__name__}")
