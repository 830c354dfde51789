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
- **Like any Unix tool**: what is moved into place has the mode a plain ``open``/``mkdir`` would give it
  (``0666``/``0777`` less the umask), not the private ``0600``/``0700`` of :mod:`tempfile`, so a colleague
  or a container running as another user can read it. An output is claimed (:func:`reserve`) before any
  work: a lock beside it refuses a second run on the same output at once, naming its process, and a probe
  write proves the destination writable (a read-only file system, a missing permission, a full disk), so
  that such a run fails in its first second, not after hours of calibration. See docs/how-to/outputs.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from quark_brevitas.errors import QuarkBrevitasError

try:
    import fcntl
except ImportError:  # Windows: no flock; the probe write still runs, the lock is not taken
    fcntl = None  # type: ignore[assignment]

__all__ = ["MARKER_FILE", "OVERWRITE_HINT", "OutputBusyError", "OutputError", "OutputNotWritableError", "add_file",
           "add_folder", "check_output_dir", "commit", "file_sha256", "final_paths", "foreign_entries", "lock_path",
           "open_work_dir", "output_dir", "reserve", "work_dir", "write_file"]

logger = logging.getLogger(__name__)

#: The file, in every folder quark_brevitas writes, that lists the entries the writing run created.
MARKER_FILE = ".quark_brevitas_output.json"
#: How a caller says "replace it anyway", in the Python API and on the command line.
OVERWRITE_HINT = "pass overwrite=True (--overwrite on the command line)"
_MARKER_KEY = "written_by_quark_brevitas"
_CHUNK = 1 << 20


class OutputError(QuarkBrevitasError):
    """An output path cannot be written without destroying files the run did not create."""


class OutputNotWritableError(OutputError, OSError):
    """The output's location cannot be written (read-only file system, no permission, full disk, a file where a
    folder is needed). Also an :class:`OSError`, which is what it is; ``filename`` is the output path."""

    def __str__(self) -> str:  # the message, not OSError's "[Errno n] strerror: filename"
        return str(self.args[0]) if self.args else ""


class OutputBusyError(OutputError):
    """Another process is writing the same output (its lock is held); ``pid`` names it when it could be read."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


# ===================================================================== modes
def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc``): setting it to read it, as
    ``os.umask`` must, would give files other threads create meanwhile the wrong mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _public(path: Path, *, folder: bool) -> None:
    """Give a file or folder made by :mod:`tempfile` (``0600`` / ``0700``) the mode ``open`` / ``mkdir`` would
    have given it: ``0666`` / ``0777`` less the umask."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def _make_temp_dir(parent: Path, prefix: str, suffix: str = "") -> Path:
    work = Path(tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=suffix))
    _public(work, folder=True)
    return work


#: Temporary folders being filled -> the folder each becomes when it is moved into place.
_PENDING: dict[str, str] = {}


def final_paths(message: str) -> str:
    """``message`` with every temporary output folder being filled named as the folder it will become: writers deep
    inside a run log the paths they wrote, which a user would look for after the run has moved them into place
    (the command line's log handler applies this to every record)."""
    for work in sorted(_PENDING, key=len, reverse=True):  # the absolute spelling before the relative one
        message = message.replace(work, _PENDING[work])
    return message


@contextlib.contextmanager
def _pending(work: Path, directory: Path) -> Iterator[None]:
    spellings = {str(work): str(directory), str(work.resolve()): str(directory.resolve())}
    _PENDING.update(spellings)
    try:
        yield
    finally:
        for work_name in spellings:
            _PENDING.pop(work_name, None)


# ===================================================================== files
def write_file(target: str | os.PathLike[str], write: Callable[[Path], Any]) -> Path:
    """Call ``write(temporary_path)`` and rename the file to ``target`` (same directory, so atomic): a reader
    sees the old file or the new one, never a partial one; the temporary file goes if ``write`` fails. The file
    gets the umask's mode, as one written in place would."""
    target = Path(target)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        _public(tmp, folder=False)  # after write: a writer may have replaced the file by a new one
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
    with _signals_deferred():
        return _commit(work, directory, stale)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM until the block ends: moving a finished folder into place entry by entry must not
    stop half-way (Ctrl-C then acts right after, on a consistent output). Python runs signal handlers in the
    main thread only, so only there can (and need) they be deferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[tuple[int, Any]] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.getsignal(number) for number in held}
    for number in held:
        signal.signal(number, lambda signum, frame: arrived.append((signum, frame)))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        for signum, frame in arrived[:1]:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def _commit(work: Path, directory: Path, stale: Iterable[str]) -> Path:
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
    with reserve(directory):
        work = _make_temp_dir(directory.parent, f".{directory.name}.partial-")
        try:
            with _pending(work, directory):
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
    tmp = _make_temp_dir(directory, f".{name}.", ".tmp")
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


# ===================================================================== claiming an output before the work
_held: dict[str, tuple[int, int]] = {}  # lock file -> (descriptor, depth): a process may claim an output twice
_held_guard = threading.Lock()


def lock_path(output: str | os.PathLike[str]) -> Path:
    """The lock file of ``output`` (a file or a folder, and its ``.partial``): a hidden sibling, so that it
    exists before the output does and outlives neither the run nor, when it ends normally, the run's exit."""
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


def _not_writable(output: Path, what: Path, exc: OSError) -> OutputNotWritableError:
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        reason = f"{_file_on_path(what)} is a file, not a folder"
    else:
        reason = f"{exc.strerror or exc} (writing {str(what)!r})"
    error = OutputNotWritableError(f"cannot write the output {str(output)!r}: {reason}; choose a writable "
                                   "location with enough free space")
    error.filename = str(output)
    error.errno = exc.errno
    return error


def _file_on_path(path: Path) -> str:
    """The first component of ``path`` that exists and is not a folder (why a folder cannot be made there)."""
    for parent in [*reversed(path.parents), path]:
        if parent.exists() and not parent.is_dir():
            return repr(str(parent))
    return repr(str(path))


def _holder(lock: Path) -> tuple[int | None, str]:
    try:
        record = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return None, ""
    pid = record.get("pid") if isinstance(record, dict) else None
    return (pid if isinstance(pid, int) else None), str(record.get("command", "")) if isinstance(record, dict) else ""


def _acquire(output: Path, lock: Path) -> int:
    """Open, lock (without waiting) and fill ``lock`` with this process's id; a lock file left by a process that
    died is taken over (the kernel released its lock with it)."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise _not_writable(output, lock, exc) from exc
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid, command = _holder(lock)
            who = f"process {pid}" + (f" ({command})" if command else "") if pid is not None else "another process"
            raise OutputBusyError(f"output {str(output)!r} is being written by {who}; wait for it to finish, or "
                                  f"choose another output (lock {str(lock)!r})", pid) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder removed it between our open and our lock: lock the new one
            break
        os.close(fd)
    try:  # the probe: a write that reaches the disk fails on a read-only or full file system
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)[:300]}) + "\n").encode())
        os.fsync(fd)
    except OSError as exc:
        _release(lock, fd)
        raise _not_writable(output, lock, exc) from exc
    return fd


def _release(lock: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        lock.unlink()  # before the lock goes, so that nobody locks a file that is about to vanish
    os.close(fd)


def _probe_folder(output: Path, folder: Path) -> None:
    """Create and remove a file in an existing ``folder`` the run will move its entries into."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".quark_brevitas_probe-")
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise _not_writable(output, folder, exc) from exc


@contextlib.contextmanager
def reserve(output: str | os.PathLike[str]) -> Iterator[Path]:
    """Claim ``output`` (a file or a folder) for this run, before any work: its parent folder is created, a lock
    beside it (:func:`lock_path`) is taken without waiting and written to (which proves the location writable:
    read-only file systems, missing permissions and full disks fail here, as :class:`OutputNotWritableError`),
    and an existing output folder is probed too. A second run on the same output is refused at once
    (:class:`OutputBusyError`, naming the process that holds it); a lock left by a process that died is taken
    over. The same process may claim an output again inside (the claims nest); the lock file goes when the
    outermost claim ends. Parent folders it had to create go again if the output was not written, so a refused
    or failed run leaves nothing behind."""
    output = Path(output)
    created = [parent for parent in output.parents if not parent.exists()]
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _not_writable(output, output.parent, exc) from exc
    try:
        with _claim(output):
            yield output
    finally:
        if not output.exists():
            for parent in created:  # deepest first
                with contextlib.suppress(OSError):
                    parent.rmdir()


@contextlib.contextmanager
def _claim(output: Path) -> Iterator[None]:
    lock = lock_path(output.parent.resolve() / output.name)
    key = str(lock)
    with _held_guard:
        fd, depth = _held.get(key, (-1, 0))
        if depth == 0:
            fd = _acquire(output, lock)
            try:
                if output.is_dir():
                    _probe_folder(output, output)
            except OutputError:
                _release(lock, fd)
                raise
        _held[key] = (fd, depth + 1)
    try:
        yield
    finally:
        with _held_guard:
            fd, depth = _held.pop(key)
            if depth > 1:
                _held[key] = (fd, depth - 1)
            else:
                _release(lock, fd)
