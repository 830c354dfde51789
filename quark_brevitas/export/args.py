"""Argument handling shared by the exporters.

The ``TensorArgs`` / ``PathLike`` type aliases, normalization of the example arguments (a tensor or a
sequence of tensors) into a tuple, and the graph input names derived from their number.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
from brevitas.quant_tensor import QuantTensor

from quark_brevitas.export.errors import ExportArgumentError

TensorArgs: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
PathLike: TypeAlias = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------


def _type_name(obj: object) -> str:
    return type(obj).__qualname__


def _normalize_args(args: object, *, allow_numpy: bool = False) -> tuple[Any, ...]:
    """Return ``args`` as a non-empty tuple of tensors, or raise :class:`ExportArgumentError`."""
    allowed: tuple[type, ...] = (torch.Tensor, np.ndarray) if allow_numpy else (torch.Tensor,)
    what = "a torch.Tensor or a tuple/list of torch.Tensor" + (" / numpy.ndarray" if allow_numpy else "")
    if isinstance(args, allowed):
        return (args,)
    if isinstance(args, (tuple, list)) and not isinstance(args, QuantTensor):
        if not args:
            raise ExportArgumentError(f"args must be {what}; got an empty {_type_name(args)}")
        for i, item in enumerate(args):
            if not isinstance(item, allowed):
                raise ExportArgumentError(
                    f"args[{i}] must be {what.split(' or ')[0]}; got {_type_name(item)}"
                )
        return tuple(args)
    raise ExportArgumentError(f"args must be {what}; got {_type_name(args)}")


def _input_names(n: int) -> tuple[str, ...]:
    return ("input",) if n == 1 else tuple(f"input_{i}" for i in range(n))
