"""Atomic outputs: every file and folder quark_brevitas writes appears whole or not at all, and never over
the user's files.

Why one module: a run that dies half-way (an exception, Ctrl-C, an out-of-memory kill) must not leave a
folder whose files disagree with each other, and a run pointed at the wrong folder (the model's own folder,
a folder of other work) must not delete what it finds there. Every writer goes through the same three
rules:

- **Files** are written under a temporary name in the same directory and renamed into place
  (:func:`write_file`): ``os.replace`` within one directory is atomic.
- **Folders** are written into a temporary sibling and moved into place at the end (:func:`output_dir`,
  :func:`commit`); an existing folder is only touched once everything is written, and then only the entries
  this run wrote (and entries an earlier quark_brevitas run wrote there, listed in :data:`MARKER_FILE`).
- **Whose files**: a folder is ours when it is empty or every entry in it is listed by its marker, written
  by the run that filled it. Any other folder is refused (:class:`OutputError`, naming the folder and the
  flag) unless the caller passes ``overwrite=True`` (``--overwrite`` on the command line); even then, only
  the entries the run writes are replaced: the user's other files stay. The input model's folder is refused
  always: its files are what the run reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from quark_brevitas.errors import QuarkBrevitasError

__all__ = ["MARKER_FILE", "OVERWRITE_HINT", "OutputError", "add_file", "add_folder", "check_output_dir", "commit",
           "file_sha256", "foreign_entries", "open_work_dir", "output_dir", "work_dir", "write_file"]

logger = logging.getLogger(__name__)

#: The file, in every folder quark_brevitas writes, that lists the entries the writing run created.
MARKER_FILE = ".quark_brevitas_output.json"
#: How a caller says "replace it anyway", in the Python API and on the command line.
OVERWRITE_HINT = "pass overwrite=True (--overwrite on the command line)"
_MARKER_KEY = "written_by_quark_brevitas"
_CHUNK = 1 << 20


class OutputError(QuarkBrevitasError):
    """An output path cannot be written without destroying files the run did not create."""


# ===================================================================== files
def write_file(target: str | os.PathLike[str], write: Callable[[Path], Any]) -> Path:
    """Call ``write(temporary_path)`` and rename the file to ``target`` (same directory, so atomic): a reader
    sees the old file or the new one, never a partial one; the temporary file goes if ``write`` fails."""
    target = Path(target)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file, read in 1 MiB chunks (weight files can be larger than memory allows)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ===================================================================== whose folder
def _marker_entries(directory: Path) -> set[str] | None:
    """The entries a quark_brevitas run recorded as its own in ``directory`` (``None``: no readable marker)."""
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    entries = marker.get(_MARKER_KEY) if isinstance(marker, dict) else None
    return set(entries) if isinstance(entries, list) else None


def _write_marker(directory: Path, entries: Iterable[str]) -> None:
    text = json.dumps({_MARKER_KEY: sorted(set(entries) - {MARKER_FILE})}, indent=1) + "\n"
    write_file(directory / MARKER_FILE, lambda p: p.write_text(text))


def foreign_entries(directory: str | os.PathLike[str]) -> list[str]:
    """The entries of ``directory`` no quark_brevitas run recorded as its own (all of them without a marker)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    ours = _marker_entries(directory) or set()
    return sorted(p.name for p in directory.iterdir() if p.name != MARKER_FILE and p.name not in ours)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_output_dir(directory: str | os.PathLike[str], *, overwrite: bool = False,
                     sources: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """Refuse an output folder that is one of the run's input folders (``sources``), or that holds entries no
    quark_brevitas run wrote (unless ``overwrite``); cheap, so entry points call it before any work."""
    directory = Path(directory)
    for source in sources:
        if _same(directory, Path(source)):
            raise OutputError(f"output folder {str(directory)!r} is the input model folder {str(source)!r}: "
                              "writing there would replace the model's own files; choose another output folder")
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"output folder {str(directory)!r} exists and is not a directory")
    foreign = foreign_entries(directory)
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"output folder {str(directory)!r} holds files quark_brevitas did not write ({shown}); "
                          f"choose another output folder, or {OVERWRITE_HINT} to replace the entries this run "
                          "writes (the others are kept)")
    return directory


# ===================================================================== moving a finished folder into place
def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _replace_entry(source: Path, target: Path, trash: Path) -> None:
    """Move ``source`` to ``target``; an existing target is moved into ``trash`` first (a directory cannot be
    replaced by a rename)."""
    if target.is_dir() and not target.is_symlink():
        os.replace(target, trash / target.name)
    os.replace(source, target)


def commit(work: str | os.PathLike[str], directory: str | os.PathLike[str], *, stale: Iterable[str] = ()) -> Path:
    """Move the finished folder ``work`` to ``directory`` (a sibling of it): renamed as a whole if
    ``directory`` is absent or empty; else entry by entry, after which entries an earlier quark_brevitas run
    wrote there (its marker) and the names ``stale`` (files that would contradict the new ones, e.g. an index
    that takes precedence) are removed unless this run wrote them. Entries nobody recorded are left alone."""
    work, directory = Path(work), Path(directory)
    written = {p.name for p in work.iterdir()} - {MARKER_FILE}
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
    if not directory.exists():
        _write_marker(work, written)
        os.replace(work, directory)
        return directory
    previous = (_marker_entries(directory) or set()) | set(stale)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.old-") as trash:
        for name in sorted(written):
            _replace_entry(work / name, directory / name, Path(trash))
        for name in sorted(previous - written):
            if (directory / name).exists() or (directory / name).is_symlink():
                logger.debug("Removing %s (written by an earlier run)", directory / name)
                _remove(directory / name)
        _write_marker(directory, written)
    shutil.rmtree(work, ignore_errors=True)
    return directory


@contextlib.contextmanager
def output_dir(directory: str | os.PathLike[str], *, overwrite: bool = False,
               sources: Iterable[str | os.PathLike[str]] = (), stale: Iterable[str] = ()) -> Iterator[Path]:
    """A temporary sibling of ``directory`` to write into; on success it is moved into place (:func:`commit`),
    on failure removed, so ``directory`` holds the old files or the new ones, never a mix of a half-written
    run's. ``directory`` is checked first (:func:`check_output_dir`)."""
    directory = check_output_dir(directory, overwrite=overwrite, sources=sources)
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.partial-"))
    try:
        yield work
        commit(work, directory, stale=stale)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def add_file(directory: str | os.PathLike[str], name: str, write: Callable[[Path], Any]) -> Path:
    """Write ``directory/name`` atomically into a folder quark_brevitas wrote (e.g. a report beside a
    checkpoint) and record it in the folder's marker, so that a later run may replace it."""
    directory = Path(directory)
    target = write_file(directory / name, write)
    _write_marker(directory, (_marker_entries(directory) or set()) | {name})
    return target


def add_folder(directory: str | os.PathLike[str], name: str, write: Callable[[Path], Any]) -> Path:
    """Write the folder ``directory/name`` (``write`` fills a temporary sibling, renamed into place when it is
    complete) inside a folder quark_brevitas wrote, and record it in the folder's marker: e.g. the tokenizer
    saved beside a checkpoint, for export's example input. An earlier entry of ours by that name is replaced."""
    directory = Path(directory)
    target = directory / name
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{name}.", suffix=".tmp"))
    try:
        write(tmp)
        if target.exists():
            _remove(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    _write_marker(directory, (_marker_entries(directory) or set()) | {name})
    return target


# ===================================================================== a resumable run's folder
def work_dir(directory: str | os.PathLike[str]) -> Path:
    """The sibling ``<directory>.partial`` a resumable run (a streamed quantization) writes into until it is
    finished, then :func:`commit` moves it into place; kept when the run fails, so that a later run resumes
    there. Refused if it exists without our marker (someone else's folder of that name)."""
    directory = Path(directory)
    work = directory.with_name(directory.name + ".partial")
    if work.exists() and not (work / MARKER_FILE).is_file() and (not work.is_dir() or any(work.iterdir())):
        raise OutputError(f"{str(work)!r}, where an unfinished run into {str(directory)!r} is kept, holds files "
                          "quark_brevitas did not write; move or remove it, or choose another output folder")
    return work


def open_work_dir(work: str | os.PathLike[str]) -> Path:
    """Create a resumable run's folder (see :func:`work_dir`) with its marker, if it is not there yet."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / MARKER_FILE).is_file():
        _write_marker(work, ())
    return work
