"""Checkpoints of quantized models: safetensors and JSON (no pickle), rebuilt without calibration data.

A quantized model is a float architecture plus what the pipeline did to it: structural changes
(FX tracing, BatchNorm merging, channel splitting, activation-equalization scale modules, layer
replacement) and values (weights, biases, scales, zero points, BatchNorm statistics). A checkpoint
therefore stores the *recipe* and the *values* but no code:

- ``model.safetensors``: the quantized model's ``state_dict`` -- weights, biases and every
  initialised quantizer parameter (scales, zero points). Brevitas leaves uninitialised quantizer
  values out of its state dict; so do we. A checkpoint written one block at a time
  (:mod:`quark_brevitas.hf.streaming`) has several files instead, listed by
  ``model.safetensors.index.json`` (Hugging Face's sharded layout); loading reads either.
- ``config.json``: the :class:`~quark_brevitas.config.Config` (algorithms included).
- ``manifest.json``: format version, library/Brevitas/torch versions, the model's dtype (its weights';
  a float16/bfloat16 model's quantizer scales are float32), the module names and
  types of the quantized model (Brevitas quantizer internals excluded), the FX code of traced graphs,
  every tensor's shape and dtype, the train/eval mode, frozen parameters and the example input's shapes.
- ``example_input.safetensors`` (optional): the example input given to :func:`save_quantized`, used
  for export from the command line.

:func:`load_quantized` rebuilds the structure on a *copy* of the float model with the pipeline's
structure phase (:meth:`quark_brevitas.pipeline.Pipeline.rebuild`): ``Preprocess`` (data-free) runs as
in quantization, the backend replaces the layers, and each data-driven algorithm that leaves structure
behind (activation equalization's scale modules, the bias bias correction gives a bias-free layer)
recreates it from the checkpoint's record of modules and tensor shapes, through its own handler. No
calibration data or example input is needed. Loading marks every quantizer whose value is loaded as
initialised, so nothing is re-derived from statistics: the outputs are bit-identical.

Before loading, the rebuilt model is compared with the manifest -- modules, FX code, tensor names,
shapes and dtypes -- and the first difference is reported as a :class:`CheckpointError`, so a model
of another architecture, a different config or a custom layer whose mapping was not registered
(pass the same ``container`` as for quantization) never loads into a wrong model. One limit:
channel splitting over a region with several layers chooses how many channels to split from the
float weights, so such a model must be rebuilt from the same float weights it was quantized from
(a mismatch is reported, never loaded).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.ties import untie_differing
from quark_brevitas.brevitas_adapter import (
    brevitas_version,
    full_state_dict,
    ignore_missing_keys,
    is_graph_module,
    load_quant_model_mode,
    quantizer_names,
)
from quark_brevitas.config import Config, verify_config
from quark_brevitas.container import Container
from quark_brevitas.errors import ConfigError, QuarkBrevitasError
from quark_brevitas.outputs import check_output_dir, file_sha256, output_dir
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE, Pipeline, SavedStructure
from quark_brevitas.version import __version__

__all__ = [
    "CONFIG_ATTRIBUTE",
    "CheckpointError",
    "CheckpointInfo",
    "ExampleInput",
    "load_quantized",
    "read_checkpoint",
    "read_weights",
    "save_quantized",
]

logger = logging.getLogger(__name__)

FORMAT = "quark_brevitas.checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
EXAMPLE_FILE = "example_input.safetensors"
#: Manifest key: weight file name -> its SHA-256 when written (checkpoints before it have none and load unchecked).
CHECKSUMS_KEY = "checksums"

#: A model's example input: a tensor, a tuple/list of positional tensors or a dict of keyword tensors.
ExampleInput = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]


class CheckpointError(QuarkBrevitasError):
    """A checkpoint cannot be written, read, or does not fit the model it is loaded into."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`read_checkpoint` found in a checkpoint directory (the weights are not read)."""

    directory: Path
    config: Config
    manifest: dict[str, Any]
    example_input: ExampleInput | None


# ===================================================================== save
def save_quantized(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    example_input: ExampleInput | None = None,
    config: Config | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (returned by ``ModelQuantizer.quantize_model``) as a checkpoint directory.

    - ``example_input``: optional model input (a tensor, a tuple of positional tensors or a dict of
      keyword tensors), stored so that ``quark-brevitas export`` can export the checkpoint without
      being given an input.
    - ``config``: only for models not produced by ``quantize_model`` (which carry their Config).

    - ``overwrite``: also write into a folder that holds files quark_brevitas did not write (a Hugging Face
      model folder, other work); without it such a folder is refused (:class:`~quark_brevitas.outputs.OutputError`).
      Only the checkpoint's own files are replaced; the others stay.

    Works in train and eval mode (the mode is restored on load, so QAT can be resumed). The checkpoint is
    written into a temporary sibling folder and moved into place once complete (:mod:`quark_brevitas.outputs`),
    so an interrupted save leaves the folder as it was; a checkpoint saved there before is replaced as a whole.
    The manifest records each weight file's SHA-256, checked on load. Returns the directory.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = getattr(model, CONFIG_ATTRIBUTE, None)
        if config is None:
            raise CheckpointError(
                f"{type(model).__name__} carries no quark_brevitas Config (it was not returned by "
                "ModelQuantizer.quantize_model or load_quantized); pass config= to save_quantized"
            )
    verify_config(config)
    if Path(directory).exists() and not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} exists and is not a directory")
    path = check_output_dir(directory, overwrite=overwrite)
    tensors = _state_tensors(model.state_dict())
    example = _example_tensors(example_input) if example_input is not None else None
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "model_class": type(model).__name__,
        "training": model.training,
        "dtype": _model_dtype_name(model),
        "modules": _structure(model),
        "graph_code": _graph_code(model),
        "tensors": {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in tensors.items()},
        "frozen_parameters": [n for n, p in model.named_parameters() if not p.requires_grad],
        "example_input": example[0] if example is not None else None,
        "huggingface": huggingface_architecture(model),
    }
    from safetensors.torch import save_file

    # The index of a sharded checkpoint would take precedence over model.safetensors, and a stale example
    # input would be misleading: both go when the folder is replaced.
    with output_dir(path, overwrite=overwrite, stale=(WEIGHTS_INDEX_FILE, EXAMPLE_FILE)) as work:
        save_file(tensors, str(work / WEIGHTS_FILE), metadata={"format": FORMAT})
        checksums = {WEIGHTS_FILE: file_sha256(work / WEIGHTS_FILE)}
        if example is not None:
            save_file(example[1], str(work / EXAMPLE_FILE), metadata={"format": FORMAT})
            checksums[EXAMPLE_FILE] = file_sha256(work / EXAMPLE_FILE)
        manifest[CHECKSUMS_KEY] = checksums
        (work / CONFIG_FILE).write_text(config.to_json() + "\n")
        (work / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
        size = (work / WEIGHTS_FILE).stat().st_size
    logger.info("Saved checkpoint %s (%d tensors, %.1f KiB)", path, len(tensors), size / 1024)
    return path


def huggingface_architecture(model: nn.Module) -> dict[str, Any] | None:
    """The class and config of a Hugging Face ``PreTrainedModel`` (``None`` for other models), recorded in the
    manifest so that ``quark-brevitas export`` can rebuild the float architecture with ``Class(config)`` and no
    ``--model`` argument; the attention implementation is kept (``sdpa`` / ``eager``)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)) or not hasattr(type(model), "config_class"):
        return None
    values = config.to_dict()
    attention = getattr(config, "_attn_implementation", None)
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
            "config": json.loads(json.dumps(values, default=str)),
            "attn_implementation": attention if isinstance(attention, str) else None}


def _versions() -> dict[str, str]:
    return {"quark_brevitas": __version__, "brevitas": brevitas_version(), "torch": torch.__version__}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_dtype_name(model: nn.Module) -> str | None:
    """The dtype of the model's weights (its first floating parameter): a float16/bfloat16 model keeps its
    weights and activations in that dtype and its quantizers' scales and zero points in float32."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return _dtype_name(dtype) if dtype is not None else None


def _state_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict as detached, contiguous CPU tensors; tensors sharing memory are copied
    (safetensors refuses shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state_dict entry {key!r} is a {type(value).__name__}, not a tensor; "
                                  "only tensors can be stored in safetensors")
        tensor = value.detach().cpu().contiguous()
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if ident in seen and tensor.numel() > 0:
            tensor = tensor.clone()
        seen.add(ident)
        tensors[key] = tensor
    return tensors


def _example_tensors(example: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest description, tensors to store) of an example input."""
    if isinstance(example, torch.Tensor):
        kind, named = "tensor", {"input": example}
    elif isinstance(example, tuple | list) and example and all(isinstance(t, torch.Tensor) for t in example):
        kind, named = "tuple", {f"input_{i}": t for i, t in enumerate(example)}
    elif (isinstance(example, Mapping) and example and all(isinstance(k, str) for k in example)
          and all(isinstance(t, torch.Tensor) for t in example.values())):
        kind, named = "dict", dict(example)
    else:
        raise CheckpointError(
            f"example_input must be a tensor, a non-empty tuple/list of tensors or a dict of tensors; "
            f"got {type(example).__name__}"
        )
    description = {
        "kind": kind,
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in named.items()],
    }
    return description, {n: t.detach().cpu().contiguous() for n, t in named.items()}


# ===================================================================== structure
def _structure(model: nn.Module) -> dict[str, str]:
    """Module name -> class name, in model order, not descending into Brevitas quantizers (their
    internals are covered by the state-dict keys)."""
    rows: dict[str, str] = {}
    proxies = quantizer_names(model)
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(".".join(parts[:i]) in proxies for i in range(1, len(parts))):
            continue
        rows[name] = type(module).__name__
    return rows


def _graph_code(model: nn.Module) -> dict[str, str]:
    """The generated Python code of every FX graph module (torch's or Brevitas's backport)."""
    return {name: module.code for name, module in model.named_modules() if is_graph_module(module)}


# ===================================================================== read
def _read_json(path: Path) -> Any:
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
    manifest = _read_json(manifest_path) if manifest_path.is_file() else {}
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
    weight_map = _read_json(index).get("weight_map")
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
    manifest = _read_json(path / MANIFEST_FILE)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST_FILE} is not a quark_brevitas checkpoint manifest "
                              f"(expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / MANIFEST_FILE}: checkpoint format version {manifest.get('format_version')!r} "
                              f"is not supported by this quark_brevitas (reads version {FORMAT_VERSION})")
    try:
        config = Config.from_dict(_read_json(path / CONFIG_FILE))
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


# ===================================================================== load
def load_quantized(
    float_model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    config: Config | None = None,
    container: Container | None = None,
    example_input: ExampleInput | None = None,
) -> nn.Module:
    """Rebuild the quantized model of a checkpoint from ``float_model``'s architecture and load it.

    ``float_model`` is not modified (the rebuild works on a copy); its weights are replaced by the
    checkpoint's. No calibration data is needed: outputs are bit-identical to the saved model's.

    - ``config``: if given, must equal the checkpoint's config (else the first differing field is named).
    - ``container``: the container used for quantization, if it registered custom layer mappings.
    - ``example_input``: deprecated and ignored: checkpoints record the structure that data-driven
      algorithms leave, so rebuilding needs no input any more.

    Raises :class:`CheckpointError` naming the first module, tensor, shape or config field that does
    not fit. The returned model is in the mode it was saved in (train mode: QAT can continue).
    """
    if not isinstance(float_model, nn.Module):
        raise TypeError(f"float_model must be a torch.nn.Module, got {type(float_model).__name__}")
    info = read_checkpoint(directory)
    where = f"checkpoint {str(info.directory)!r}"
    if config is not None:
        difference = _first_difference(info.config.to_dict(), _config_dict(config))
        if difference is not None:
            raise CheckpointError(f"{where} was made with a different config: {difference}")
    if example_input is not None:
        warnings.warn("load_quantized(example_input=...) is ignored: checkpoints record the structure that "
                      "data-driven algorithms leave, so rebuilding needs no input", DeprecationWarning, stacklevel=2)
    _warn_versions(info)
    state = read_weights(info.directory)
    model = _rebuild(float_model, info, container, state)
    prefix = f"{where} does not fit {type(float_model).__name__}"
    _check_structure(model, info.manifest, prefix)
    _check_state(model, state, prefix)
    untie_differing(model, state)  # ties an algorithm broke before saving (GPTQ on a tied lm_head)
    # Quantizers that were never initialised (e.g. an activation quantizer no calibration batch
    # reached) are absent from the state dict in both models; Brevitas accepts that only with this flag.
    try:
        with ignore_missing_keys(), load_quant_model_mode(model):
            model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{prefix}: {exc}") from exc
    model.train(bool(info.manifest.get("training", False)))
    frozen = set(info.manifest.get("frozen_parameters", []))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in frozen)
    setattr(model, CONFIG_ATTRIBUTE, info.config)
    logger.info("Loaded checkpoint %s into %s (%d tensors)", info.directory, type(model).__name__, len(state))
    return model


def _config_dict(config: Config) -> dict[str, Any]:
    if not isinstance(config, Config):
        raise TypeError(f"config must be a quark_brevitas Config, got {type(config).__name__}")
    return config.to_dict()


def _first_difference(saved: Any, given: Any, path: str = "") -> str | None:
    """The first place where two plain (JSON-like) values differ, as a readable sentence."""
    label = path or "the config"
    if isinstance(saved, dict) and isinstance(given, dict):
        for key in [*saved, *(k for k in given if k not in saved)]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in given:
                return f"{sub} is set in the checkpoint's config but not in the given config"
            if key not in saved:
                return f"{sub} is set in the given config but not in the checkpoint's config"
            found = _first_difference(saved[key], given[key], sub)
            if found is not None:
                return found
        return None
    if isinstance(saved, list) and isinstance(given, list):
        for index, (a, b) in enumerate(zip(saved, given)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        if len(saved) != len(given):
            return f"{label} has {len(saved)} entries in the checkpoint, {len(given)} in the given config"
        return None
    if saved != given:
        return f"{label} is {saved!r} in the checkpoint, {given!r} in the given config"
    return None


def _warn_versions(info: CheckpointInfo) -> None:
    saved = info.manifest.get("versions", {}).get("brevitas")
    if saved is not None and saved != brevitas_version():
        logger.warning("checkpoint %s was written with Brevitas %s, this is Brevitas %s; quantizer state "
                       "names may differ", info.directory, saved, brevitas_version())


def _rebuild(float_model: nn.Module, info: CheckpointInfo, container: Container | None,
             state: Mapping[str, torch.Tensor]) -> nn.Module:
    """The pipeline's structure phase on a copy of ``float_model``, with what the checkpoint records of
    the structure data-driven algorithms left."""
    saved = SavedStructure(modules=dict(info.manifest.get("modules", {})),
                           tensors={key: tuple(tensor.shape) for key, tensor in state.items()})
    try:
        return Pipeline(info.config, container).rebuild(float_model, saved)
    except QuarkBrevitasError as exc:
        raise CheckpointError(f"cannot rebuild the quantized model of checkpoint {str(info.directory)!r} from "
                              f"{type(float_model).__name__}: {exc}") from exc


def _check_structure(model: nn.Module, manifest: Mapping[str, Any], prefix: str) -> None:
    saved_types: dict[str, str] = manifest.get("modules", {})
    rebuilt_types = _structure(model)
    hint = " (a custom layer needs the same container= as for quantization)"
    # The root's class is not compared: an equivalent architecture under another class name fits.
    for name, kind in saved_types.items():
        if not name:
            continue
        label = f"'{name}'"
        if name not in rebuilt_types:
            raise CheckpointError(f"{prefix}: module {label} ({kind}) of the checkpoint is missing from the "
                                  "rebuilt model")
        if rebuilt_types[name] != kind:
            raise CheckpointError(f"{prefix}: module {label} is a {kind} in the checkpoint but a "
                                  f"{rebuilt_types[name]} in the rebuilt model"
                                  + (hint if kind.startswith("Quant") else ""))
    for name, kind in rebuilt_types.items():
        if name not in saved_types:
            raise CheckpointError(f"{prefix}: the rebuilt model has module '{name}' ({kind}) that the checkpoint "
                                  "does not have")
    saved_code = manifest.get("graph_code", {})
    rebuilt_code = _graph_code(model)
    for name in sorted(set(saved_code) | set(rebuilt_code)):
        old, new = saved_code.get(name), rebuilt_code.get(name)
        if old == new:
            continue
        label = f"'{name}'" if name else "the model"
        if old is None or new is None:
            raise CheckpointError(f"{prefix}: {label} is {'not ' if new is None else ''}an FX graph in the "
                                  f"rebuilt model but {'not ' if old is None else ''}in the checkpoint")
        old_lines, new_lines = old.strip().splitlines(), new.strip().splitlines()
        line = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b),
                    min(len(old_lines), len(new_lines)))
        raise CheckpointError(f"{prefix}: the FX graph of {label} differs at line {line + 1}: checkpoint "
                              f"{_line(old_lines, line)!r}, rebuilt model {_line(new_lines, line)!r}")


def _line(lines: list[str], index: int) -> str:
    return lines[index].strip() if index < len(lines) else "<end of graph>"


def _check_state(model: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Compare the checkpoint's tensors with the rebuilt model's (names, shapes, dtypes), in model order."""
    with full_state_dict():
        full = model.state_dict()
    required = model.state_dict().keys()
    modules = dict(model.named_modules())
    extra = []
    for key, tensor in state.items():
        if key in full:
            continue
        owner, _, attr = key.rpartition(".")
        module = modules.get(owner)
        if module is not None and isinstance(getattr(module, attr, None), torch.Tensor) and \
                tuple(getattr(module, attr).shape) == tuple(tensor.shape):
            # A quantizer tensor left out of an uncalibrated quantizer's state dict even in Brevitas's full
            # mode (the runtime zero point of asymmetric activations); loading it restores it.
            continue
        extra.append(key)
    for key, expected in full.items():
        if key not in state:
            if key in required:
                raise CheckpointError(f"{prefix}: the rebuilt model needs tensor '{key}' {list(expected.shape)} that "
                                      "the checkpoint does not have")
            continue
        tensor = state[key]
        if tuple(expected.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{prefix}: tensor '{key}' has shape {list(tensor.shape)} in the checkpoint but "
                                  f"{list(expected.shape)} in the rebuilt model")
        if expected.dtype != tensor.dtype:
            raise CheckpointError(f"{prefix}: tensor '{key}' is {_dtype_name(tensor.dtype)} in the checkpoint but "
                                  f"{_dtype_name(expected.dtype)} in the rebuilt model (convert the float model "
                                  f"with .to({_dtype_name(tensor.dtype)}) first)")
    if extra:
        raise CheckpointError(f"{prefix}: the checkpoint has tensor '{extra[0]}' {list(state[extra[0]].shape)} that "
                              f"the rebuilt model does not have" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                                                    else ""))
