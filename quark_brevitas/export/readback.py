"""Proving what is on disk: every weight file an export writes is read back, complete, before it is moved into place.

Why a separate step: an exporter proves its tensors in memory (every packed GGUF block dequantizes to the quantized
weight, every compressed-tensors layer's codes give it exactly), but the file is what the user gets. Between the
proof and the file lie a serialiser, temporary files (a streamed export spills each block to disk and memory-maps it
back) and the disk itself; a fault there (two spill files under one name, a truncated write) would write another
layer's weights, or garbage, under a proven name. So each writer records, at proof time, what every tensor must be
(its name, type, shape and the SHA-256 of its bytes; for an in-memory GGUF export also the weight its blocks must
dequantize to), writes the file into its temporary folder, and calls this module on the *written file*, read through
the format's own reader (``gguf.GGUFReader``, ``safetensors.safe_open``). A difference is a :class:`ReadBackError`
naming the tensor and the file; the temporary folder is then removed by :mod:`quark_brevitas.outputs`, so nothing is
moved into place. See ``docs/explanation/verification.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from quark_brevitas.export.errors import ExportError

__all__ = ["ReadBackError", "TensorRecord", "array_digest", "records_of", "verify_gguf_file", "verify_json_file",
           "verify_copied_files", "verify_npz_file", "verify_safetensors_file", "verify_text_file"]


class ReadBackError(ExportError):
    """A file read back after it was written differs from what was proven; ``path`` (the final path the file was
    meant for) and ``tensor`` (``None``: the file as a whole) say where."""

    def __init__(self, path: Path, tensor: str | None, why: str) -> None:
        where = f"tensor {tensor!r} of {str(path)!r}" if tensor is not None else repr(str(path))
        super().__init__(f"{where}, read back from disk after it was written, {why}; the output was not moved into "
                         "place (please report this: the disk, a concurrent writer or the exporter changed the file)")
        self.path, self.tensor = path, tensor


def array_digest(array: np.ndarray | torch.Tensor) -> str:
    """The SHA-256 of a tensor's bytes in C order (its dtype and shape are checked apart)."""
    if isinstance(array, torch.Tensor):
        flat = array.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
    else:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return hashlib.sha256(data).hexdigest()


# ===================================================================== GGUF
class ProvenGGUFTensor(Protocol):
    """What the GGUF writer proved of one tensor (:class:`quark_brevitas.export.gguf.writer.GGUFTensor`)."""

    name: str
    data: np.ndarray
    qtype: str
    expected: np.ndarray | None
    digest: str | None


def verify_gguf_file(gguf: Any, written: Path, shown: Path, tensors: Sequence[ProvenGGUFTensor]) -> None:
    """Read the complete file ``written`` with ``gguf.GGUFReader`` and check that it holds ``tensors``, in order,
    with their types, shapes and bytes (the SHA-256 recorded when they were proven; ``digest`` ``None``: of ``data``,
    which is then the proven array itself), and that each tensor with an ``expected`` weight dequantizes to it
    exactly (``gguf``'s own dequantization of the file's blocks). ``shown``: the path named in errors."""
    try:
        reader = gguf.GGUFReader(str(written))
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not what was written
        raise ReadBackError(shown, None, f"is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    found = list(reader.tensors)
    if [t.name for t in found] != [t.name for t in tensors]:
        raise ReadBackError(shown, None, f"holds {len(found)} tensors, not the {len(tensors)} written (first "
                            f"difference: {_first_difference([t.name for t in found], [t.name for t in tensors])})")
    for tensor, stored in zip(tensors, found):
        if stored.tensor_type.name != tensor.qtype:
            raise ReadBackError(shown, tensor.name, f"is {stored.tensor_type.name}, not {tensor.qtype}")
        data = np.asarray(stored.data)
        if tuple(data.shape) != tuple(tensor.data.shape):
            raise ReadBackError(shown, tensor.name, f"has shape {tuple(data.shape)}, not {tuple(tensor.data.shape)}")
        digest = tensor.digest if tensor.digest is not None else array_digest(tensor.data)
        if array_digest(data) != digest:
            raise ReadBackError(shown, tensor.name, "holds other bytes than the ones proven (SHA-256 differs)")
        if tensor.expected is not None:
            decoded = gguf.quants.dequantize(data, stored.tensor_type)
            if decoded.shape != tensor.expected.shape or not np.array_equal(decoded, tensor.expected):
                raise ReadBackError(shown, tensor.name, f"does not dequantize to the quantized weight "
                                    f"({tensor.qtype}, gguf's own dequantization)")
    del reader, found  # the reader memory-maps the file: release it before the file is moved


def _first_difference(found: list[str], meant: list[str]) -> str:
    for index, (a, b) in enumerate(zip(found, meant)):
        if a != b:
            return f"position {index} is {a!r}, not {b!r}"
    if len(found) < len(meant):
        return f"{meant[len(found)]!r} is missing"
    return f"{found[len(meant)]!r} was not written"


# ===================================================================== safetensors and JSON
@dataclass(frozen=True)
class TensorRecord:
    """What one safetensors tensor must be when read back: dtype, shape and the SHA-256 of its bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorRecord:
        return cls(tensor.dtype, tuple(tensor.shape), array_digest(tensor))


def records_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorRecord]:
    """The records of the tensors about to be saved (recorded while they are in memory)."""
    return {name: TensorRecord.of(tensor) for name, tensor in tensors.items()}


def verify_safetensors_file(written: Path, shown: Path, expected: Mapping[str, TensorRecord]) -> None:
    """Read the complete file ``written`` with safetensors and check it holds exactly the ``expected`` tensors
    (names, dtypes, shapes, bytes), one tensor in memory at a time. ``shown``: the path named in errors."""
    from safetensors import safe_open

    try:
        handle_ = safe_open(str(written), framework="pt")
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not what was written
        raise ReadBackError(shown, None, f"is not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    with handle_ as handle:
        names = set(handle.keys())
        if names != set(expected):
            missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
            raise ReadBackError(shown, (missing or extra)[0], "is missing" if missing else "was not written by this "
                                "export")
        for name in sorted(expected):
            tensor, record = handle.get_tensor(name), expected[name]
            if tensor.dtype != record.dtype or tuple(tensor.shape) != record.shape:
                raise ReadBackError(shown, name, f"is {tensor.dtype} {tuple(tensor.shape)}, not {record.dtype} "
                                    f"{record.shape}")
            if array_digest(tensor) != record.digest:
                raise ReadBackError(shown, name, "holds other bytes than the ones proven (SHA-256 differs)")


def verify_npz_file(written: Path, shown: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Read the complete ``.npz`` file ``written`` (without pickle) and check it holds exactly ``arrays`` (names,
    dtypes, shapes, bytes)."""
    try:
        archive = np.load(written, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not what was written
        raise ReadBackError(shown, None, f"is not a readable .npz file ({type(exc).__name__}: {exc})") from exc
    with archive:
        if set(archive.files) != set(arrays):
            missing, extra = sorted(set(arrays) - set(archive.files)), sorted(set(archive.files) - set(arrays))
            raise ReadBackError(shown, (missing or extra)[0], "is missing" if missing else "was not written by this "
                                "export")
        for name, meant in arrays.items():
            found = archive[name]
            if found.dtype != meant.dtype or found.shape != meant.shape or \
                    array_digest(found) != array_digest(meant):
                raise ReadBackError(shown, name, "differs from the array written (dtype, shape or bytes)")


def verify_text_file(written: Path, shown: Path, text: str) -> None:
    """Check that the file ``written`` reads back as ``text`` (``config.json``, an index)."""
    if written.read_text(encoding="utf-8") != text:
        raise ReadBackError(shown, None, "differs from the text written")


def verify_json_file(written: Path, shown: Path, value: Any) -> None:
    """Check that the file ``written`` parses to ``value``."""
    try:
        found = json.loads(written.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ReadBackError(shown, None, f"is not valid JSON ({exc})") from exc
    if found != value:
        raise ReadBackError(shown, None, "differs from the JSON written")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_copied_files(work: Path, shown: Path, source: Path, names: Sequence[str]) -> None:
    """Check that each file ``names`` copied from the folder ``source`` into ``work`` reads back with the source's
    bytes (tokenizer files beside a safetensors folder: a tokenizer that differs from the user's gives other token
    ids, silently). ``shown``: the folder ``work`` becomes."""
    for name in names:
        if _file_sha256(work / name) != _file_sha256(source / name):
            raise ReadBackError(shown / name, None, f"differs from {str(source / name)!r}, the file it copies")
