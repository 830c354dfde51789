"""Reading checkpoint files: JSON parts, safetensors checked against the SHA-256 the manifest recorded, the
weights of a single-file or sharded checkpoint, and the config/manifest/example of a checkpoint folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from quark_brevitas.checkpoint.manifest import (
    CHECKSUMS_KEY,
    CONFIG_FILE,
    EXAMPLE_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    CheckpointInfo,
    ExampleInput,
)
from quark_brevitas.config import Config
from quark_brevitas.errors import ConfigError
from quark_brevitas.outputs import file_sha256

__all__ = ["checksums", "read_checkpoint", "read_json", "read_safetensors", "read_weights"]


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a quark_brevitas checkpoint directory holds {WEIGHTS_FILE}, "
                              f"{CONFIG_FILE} and {MANIFEST_FILE} (written by save_quantized)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_safetensors(path: Path, checksum: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file, after checking it against the SHA-256 its manifest recorded
    (``checksum``; ``None`` for checkpoints written before checksums): damage is reported with the file's
    name, never loaded."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: write it again "
                              "(save_quantized / quantize_pretrained) or restore the file")
    if checksum is not None and file_sha256(path) != checksum:
        raise CheckpointError(f"{path} has changed since it was written (its SHA-256 differs from the one in "
                              f"{MANIFEST_FILE}): it is damaged or was overwritten; write the checkpoint again "
                              "(save_quantized / quantize_pretrained) or restore the file")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}): it is truncated or damaged; "
                              "write the checkpoint again (save_quantized / quantize_pretrained) or restore "
                              "the file") from exc


def checksums(directory: Path) -> dict[str, str]:
    """File name -> SHA-256 recorded in a checkpoint's manifest (empty for checkpoints without checksums)."""
    manifest_path = directory / MANIFEST_FILE
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    recorded = manifest.get(CHECKSUMS_KEY, {}) if isinstance(manifest, dict) else {}
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{manifest_path}: {CHECKSUMS_KEY!r} must map file names to SHA-256 digests")
    return recorded


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: ``model.safetensors``, or the files its sharded index lists; each file
    checked against the checksum its manifest records."""
    recorded = checksums(directory)
    index = directory / WEIGHTS_INDEX_FILE
    if not index.is_file():
        return read_safetensors(directory / WEIGHTS_FILE, recorded.get(WEIGHTS_FILE))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map (written by quark_brevitas.hf.streaming)")
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        state.update(read_safetensors(directory / name, recorded.get(name)))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise CheckpointError(f"{index} lists tensor {missing[0]!r} in {weight_map[missing[0]]}, which lacks it")
    return state


def read_checkpoint(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """Read and check a checkpoint's config, manifest and example input (not the weights)."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    manifest = read_json(path / MANIFEST_FILE)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST_FILE} is not a quark_brevitas checkpoint manifest "
                              f"(expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / MANIFEST_FILE}: checkpoint format version {manifest.get('format_version')!r} "
                              f"is not supported by this quark_brevitas (reads version {FORMAT_VERSION})")
    try:
        config = Config.from_dict(read_json(path / CONFIG_FILE))
    except ConfigError as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from exc
    example: ExampleInput | None = None
    description = manifest.get("example_input")
    if description is not None:
        stored = read_safetensors(path / EXAMPLE_FILE, manifest.get(CHECKSUMS_KEY, {}).get(EXAMPLE_FILE))
        names = [t["name"] for t in description["tensors"]]
        missing = [n for n in names if n not in stored]
        if missing:
            raise CheckpointError(f"{path / EXAMPLE_FILE} lacks the example tensor {missing[0]!r} its manifest lists")
        if description["kind"] == "tensor":
            example = stored[names[0]]
        elif description["kind"] == "tuple":
            example = tuple(stored[n] for n in names)
        else:
            example = {n: stored[n] for n in names}
    return CheckpointInfo(directory=path, config=config, manifest=manifest, example_input=example)

