"""Argument handling shared by the exporters, the verification and the runners.

The ``TensorArgs`` / ``PathLike`` type aliases, the type checks of the model and the output path,
normalization of the example arguments (a tensor or a sequence of tensors) into a tuple, and the graph
input names derived from their number. One place, so that every entry point rejects a wrong argument
with the same :class:`~quark_brevitas.export.errors.ExportArgumentError` message.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
from brevitas.quant_tensor import QuantTensor
from torch import nn

from quark_brevitas.export.errors import ExportArgumentError

TensorArgs: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
PathLike: TypeAlias = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------


def type_name(obj: object) -> str:
    """The name error messages use for the type of ``obj``."""
    return type(obj).__qualname__


def check_model(model: object) -> None:
    """Raise :class:`ExportArgumentError` unless ``model`` is a ``torch.nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ExportArgumentError(f"model must be a torch.nn.Module; got {type_name(model)}")


def check_path(path: object) -> pathlib.Path:
    """``path`` as a :class:`pathlib.Path`; :class:`ExportArgumentError` unless it is a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise ExportArgumentError(f"path must be a str or os.PathLike; got {type_name(path)}")
    return pathlib.Path(path)


def normalize_args(args: object, *, allow_numpy: bool = False) -> tuple[Any, ...]:
    """Return ``args`` as a non-empty tuple of tensors, or raise :class:`ExportArgumentError`."""
    allowed: tuple[type, ...] = (torch.Tensor, np.ndarray) if allow_numpy else (torch.Tensor,)
    what = "a torch.Tensor or a tuple/list of torch.Tensor" + (" / numpy.ndarray" if allow_numpy else "")
    if isinstance(args, allowed):
        return (args,)
    if isinstance(args, (tuple, list)) and not isinstance(args, QuantTensor):
        if not args:
            raise ExportArgumentError(f"args must be {what}; got an empty {type_name(args)}")
        for i, item in enumerate(args):
            if not isinstance(item, allowed):
                raise ExportArgumentError(
                    f"args[{i}] must be {what.split(' or ')[0]}; got {type_name(item)}"
                )
        return tuple(args)
    raise ExportArgumentError(f"args must be {what}; got {type_name(args)}")


def input_names(n: int) -> tuple[str, ...]:
    """Graph input names for ``n`` positional inputs: ``input``, or ``input_0``, ``input_1``, ..."""
    return ("input",) if n == 1 else tuple(f"input_{i}" for i in range(n))
