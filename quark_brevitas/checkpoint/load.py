"""Loading a checkpoint: the structure phase rebuilt on a copy of the float model, compared with the manifest
(modules, FX code, tensor names, shapes, dtypes; the first difference is the error), then the state loaded."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.ties import untie_differing
from quark_brevitas.brevitas_adapter import (
    brevitas_version,
    full_state_dict,
    ignore_missing_keys,
    load_quant_model_mode,
)
from quark_brevitas.checkpoint.files import read_checkpoint, read_weights
from quark_brevitas.checkpoint.manifest import (
    CheckpointError,
    CheckpointInfo,
    ExampleInput,
    dtype_name,
    graph_code,
    module_structure,
)
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.pipeline import CONFIG_ATTRIBUTE, Pipeline, SavedStructure

__all__ = ["check_state", "check_structure", "load_quantized"]

logger = logging.getLogger(__name__)


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
    check_structure(model, info.manifest, prefix)
    check_state(model, state, prefix)
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


def check_structure(model: nn.Module, manifest: Mapping[str, Any], prefix: str) -> None:
    saved_types: dict[str, str] = manifest.get("modules", {})
    rebuilt_types = module_structure(model)
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
    rebuilt_code = graph_code(model)
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


def check_state(model: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
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
            raise CheckpointError(f"{prefix}: tensor '{key}' is {dtype_name(tensor.dtype)} in the checkpoint but "
                                  f"{dtype_name(expected.dtype)} in the rebuilt model (convert the float model "
                                  f"with .to({dtype_name(tensor.dtype)}) first)")
    if extra:
        raise CheckpointError(f"{prefix}: the checkpoint has tensor '{extra[0]}' {list(state[extra[0]].shape)} that "
                              f"the rebuilt model does not have" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                                                    else ""))

