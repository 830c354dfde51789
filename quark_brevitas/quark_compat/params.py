"""``save_params`` / ``load_params`` (Quark 0.13): a quantized model's state, saved and loaded without calibration
data, as a quark_brevitas checkpoint (:func:`~quark_brevitas.checkpoint.save_quantized` /
:func:`~quark_brevitas.checkpoint.load_quantized`: ``config.json``, ``manifest.json``, ``model.safetensors``).

``save_params(model, model_type, export_dir=d)`` writes the checkpoint into ``d``; ``load_params(model,
json_path=..., safetensors_path=...)`` loads the checkpoint folder the two paths lie in: its ``config.json`` or
``manifest.json`` and its ``model.safetensors`` (Quark names them ``<model_type>.json`` / ``<model_type>.safetensors``).
The state is stored unrounded (float weights with their quantizers, Quark's ``compressed=False``): the model comes
back bit-identical. Quark's FX graph mode and compressed layout are refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.checkpoint import CheckpointError, load_quantized, save_quantized
from quark_brevitas.quark_compat.arguments import UnsupportedArgumentError, check_choice, require_quantized

__all__ = ["load_params", "save_params"]

_EAGER = "eager_mode"
_COMPRESSED = ("(integer codes) is not offered: the checkpoint stores the float weights with their quantizers, which "
               "reload bit-identically; integer layouts are written by export_safetensors")


def _check_mode(function: str, quant_mode: Any, compressed: Any, reorder: Any) -> None:
    if getattr(quant_mode, "name", quant_mode) != _EAGER:
        raise UnsupportedArgumentError(function, "quant_mode", getattr(quant_mode, "name", quant_mode),
                                       "is not offered: quark_brevitas replaces layers in place (eager mode)",
                                       "QuantizationMode.eager_mode")
    check_choice(function, "compressed", compressed, [False], _COMPRESSED)
    check_choice(function, "reorder", reorder, [True, False], "is not a bool (it only matters with compressed=True)")


def save_params(model: nn.Module, model_type: str, args: Any = None, kwargs: dict[str, Any] | None = None,
                export_dir: str | os.PathLike[str] | None = None, quant_mode: Any = _EAGER, compressed: bool = False,
                reorder: bool = True) -> Path:
    """Save the quantized ``model`` as a checkpoint in ``export_dir`` (Quark's signature); returns the folder.

    ``model_type``: recorded nowhere (a name, as in Quark); ``args`` / ``kwargs``: an example input (positional
    tensors / keyword tensors) stored with the checkpoint, for ``quark-brevitas export``. ``export_dir`` is required
    (Quark's default, the system's temporary folder, holds other programs' files, which quark_brevitas does not
    write among).
    """
    function = "save_params"
    model = require_quantized(model, function)
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedArgumentError(function, "model_type", model_type, "is not a name", "a non-empty str")
    _check_mode(function, quant_mode, compressed, reorder)
    if export_dir is None:
        raise UnsupportedArgumentError(function, "export_dir", None, "must be given (the checkpoint is a folder of "
                                       "its own)", "a folder path")
    if args is not None and kwargs:
        raise UnsupportedArgumentError(function, "kwargs", sorted(kwargs), "and args cannot both be given (the "
                                       "example input is positional or by keyword)", "None when args is given")
    example = kwargs if kwargs else (args[0] if isinstance(args, tuple) and len(args) == 1 else args)
    return save_quantized(model, export_dir, example_input=example)


def load_params(model: nn.Module | None = None, json_path: str | os.PathLike[str] = "",
                safetensors_path: str | os.PathLike[str] = "", pth_path: str = "", quant_mode: Any = _EAGER,
                compressed: bool = False, reorder: bool = True) -> nn.Module:
    """The quantized model of the checkpoint folder ``json_path`` and ``safetensors_path`` lie in, rebuilt from
    the float ``model`` (Quark's signature; ``model`` is not modified)."""
    function = "load_params"
    _check_mode(function, quant_mode, compressed, reorder)
    if pth_path:
        raise UnsupportedArgumentError(function, "pth_path", pth_path, "is Quark's FX graph mode file",
                                       "'' (give json_path and safetensors_path)")
    if not isinstance(model, nn.Module):
        raise UnsupportedArgumentError(function, "model", type(model).__name__, "is not the float model",
                                       "the torch.nn.Module the checkpoint was quantized from")
    if not json_path or not safetensors_path:
        raise UnsupportedArgumentError(function, "json_path" if not json_path else "safetensors_path", "",
                                       "is needed", "a file of the checkpoint folder save_params wrote")
    json_file, weights_file = Path(json_path), Path(safetensors_path)
    for argument, path in (("json_path", json_file), ("safetensors_path", weights_file)):
        if not path.is_file():
            raise CheckpointError(f"{function}: {argument} {str(path)!r} does not exist; save_params writes a "
                                  "checkpoint folder: pass its config.json (or manifest.json) and model.safetensors")
    if json_file.resolve().parent != weights_file.resolve().parent:
        raise CheckpointError(f"{function}: json_path {str(json_file)!r} and safetensors_path {str(weights_file)!r} "
                              "are in different folders; both name files of the one checkpoint folder")
    return load_quantized(model, json_file.parent)
