"""Argument handling shared by the exporters, the verification and the runners.

The ``TensorArgs`` / ``PathLike`` type aliases, the type checks of the model and the output path,
normalization of the example arguments into an :class:`Example` (a tensor, a sequence of positional
tensors, or a mapping of keyword tensors such as a Hugging Face tokenizer's output), the graph input names
derived from them, and the wrapper that lets the exporter call a keyword-argument model positionally. One
place, so that every entry point rejects a wrong argument with the same
:class:`~quark_brevitas.export.errors.ExportArgumentError` message.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import torch
from brevitas.quant_tensor import QuantTensor
from torch import nn

from quark_brevitas.calibration.data import takes
from quark_brevitas.export.errors import ExportArgumentError

logger = logging.getLogger(__name__)

TensorArgs: TypeAlias = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
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
    if not allow_numpy:
        what += " (or a dict of keyword tensors, for exports)"
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


@dataclass(frozen=True)
class Example:
    """The example inputs of an export: tensors in graph-input order, their graph names, and whether the model
    takes them as keyword arguments (a mapping such as a tokenizer's output) or positionally."""

    tensors: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    keyword: bool = False
    #: Number of decoder layers whose past keys/values are inputs (``past_key_values.{i}.key`` / ``.value``, see
    #: :mod:`~quark_brevitas.export.onnx.kv`); 0 for an export without a cache.
    past: int = 0


_PAST_NAME = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def past_name(name: str) -> tuple[int, str] | None:
    """``(layer, "key" | "value")`` of a past key/value input name ``past_key_values.{i}.key``, else ``None``."""
    match = _PAST_NAME.match(name)
    return (int(match[1]), match[2]) if match else None


def past_names(layers: int) -> tuple[str, ...]:
    """The past key/value input names of ``layers`` decoder layers, in graph order."""
    return tuple(f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))


def normalize_example(args: object) -> Example:
    """``args`` (a tensor, a tuple/list of tensors, or a mapping of keyword tensors) as an :class:`Example`.

    Mappings (dicts, Hugging Face ``BatchEncoding``) keep their key order; entries that are ``None`` are
    dropped (the model's default is used); entries named ``past_key_values.{i}.key`` / ``.value`` make it an example
    with a past (:mod:`~quark_brevitas.export.onnx.kv`). Graph inputs are named after the keys, positional inputs
    ``input`` / ``input_0``, ``input_1``, ...
    """
    if isinstance(args, Mapping) and not isinstance(args, (torch.Tensor, QuantTensor)):
        items = [(key, value) for key, value in args.items() if value is not None]
        if not items:
            raise ExportArgumentError(f"args is an empty {type_name(args)}; give the model's keyword tensors")
        for key, value in items:
            if not isinstance(key, str) or not (key.isidentifier() or past_name(key)):
                raise ExportArgumentError(f"args keys must be keyword names (str) or past_key_values.<layer>.key / "
                                          f".value; got {key!r}")
            if not isinstance(value, torch.Tensor):
                raise ExportArgumentError(f"args[{key!r}] must be a torch.Tensor; got {type_name(value)}")
        past = sum(past_name(k) is not None for k, _ in items)
        return Example(tuple(v for _, v in items), tuple(k for k, _ in items), keyword=True, past=(past + 1) // 2)
    tensors = normalize_args(args)
    return Example(tensors, input_names(len(tensors)))


def with_attention_mask(model: nn.Module, example: Example) -> Example:
    """``example`` with an all-ones ``attention_mask`` (the shape of ``input_ids``, right after it in graph order)
    when ``model.forward`` takes one and the keyword example has ``input_ids`` but no mask; else ``example``.

    Why: without a mask, transformers builds the causal mask along a path the TorchScript exporter cannot write (5.x
    looks for packed sequences with ``aten::diff``, no ONNX op at opset 14), and a deployed decoder is fed a mask
    anyway. An all-ones mask means what a missing one means (every token is real), except where the model reads
    sequence boundaries from ``position_ids`` given without a mask (packed sequences): such examples, and examples
    with a past (whose mask must also cover the past tokens), are left as they are."""
    if not example.keyword or example.past or "attention_mask" in example.names or "position_ids" in example.names:
        return example
    if "input_ids" not in example.names or not takes(model, "attention_mask"):
        return example
    at = example.names.index("input_ids")
    ids = example.tensors[at]
    if ids.ndim != 2:
        return example
    logger.info("export: %s.forward takes attention_mask and the example has none: adding an all-ones "
                "attention_mask %s as a graph input (give one in the example to choose it)",
                type_name(model), list(ids.shape))
    mask = torch.ones_like(ids, dtype=torch.int64)
    return Example((*example.tensors[:at + 1], mask, *example.tensors[at + 1:]),
                   (*example.names[:at + 1], "attention_mask", *example.names[at + 1:]), keyword=True)


class KeywordInputs(nn.Module):
    """Export wrapper calling ``model(**{name: tensor})`` with the positional tensors it is given (ONNX graphs
    take positional inputs; Hugging Face models take keyword arguments), or ``model(*tensors)`` when
    ``keyword`` is false; either way without a decoder's key/value cache. Make it with ``.eval()``:
    ``torch.onnx.export`` restores the traced module's mode afterwards, and a fresh module is in train mode."""

    def __init__(self, model: nn.Module, names: Sequence[str], keyword: bool = True) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.keyword = keyword
        # A decoder LM returns its key/value cache (a Cache object, no tensor) unless told not to: export the
        # plain forward pass unless the caller passes the cache explicitly.
        self.extra = {"use_cache": False} if takes(model, "use_cache") and "use_cache" not in self.names else {}

    def forward(self, *args: torch.Tensor) -> Any:
        if not self.keyword:
            return self.model(*args, **self.extra)
        return self.model(**dict(zip(self.names, args)), **self.extra)

    @staticmethod
    def needed(model: nn.Module, example: Example) -> bool:
        """Whether exporting ``model`` on ``example`` needs the wrapper (keyword inputs, or a cache to turn off)."""
        return example.keyword or takes(model, "use_cache")



def dynamic_axes(example: Example, *, batch: bool, sequence: bool) -> dict[str, dict[int, str]] | None:
    """The symbolic axes of the graph inputs: dimension 0 ``batch``; with ``sequence``, dimension 1 of token
    inputs (rank-2 integer tensors: ``input_ids``, ``attention_mask``, ...) and of every other input of rank >= 2
    whose dimension 1 has the tokens' length (``inputs_embeds``, float masks) is ``sequence``."""
    if not batch and not sequence:
        return None
    tokens = {int(t.shape[1]) for t in example.tensors if t.ndim == 2 and not t.is_floating_point()}
    axes: dict[str, dict[int, str]] = {}
    for name, tensor in zip(example.names, example.tensors):
        dims: dict[int, str] = {}
        if batch and tensor.ndim > 0:
            dims[0] = "batch"
        if sequence and tensor.ndim >= 2 and int(tensor.shape[1]) in tokens:
            dims[1] = "sequence"
        if dims:
            axes[name] = dims
    return axes or None
