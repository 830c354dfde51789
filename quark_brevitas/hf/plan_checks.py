"""Whether a quantization plan can be written in an export format, decided before calibration starts.

Why: ``quantize --model DIR --export FORMAT`` with a config the format cannot hold used to be refused by the
exporter, after the calibration (hours on a real model). The refusal must come first, and it must be the
exporter's own: a second, hand-written list of what each format holds would drift from the one its writer applies.
So each distinct (layer type, layer spec, input width, output rows) of the plan is quantized on a small stand-in
layer (a few output rows with the layer's divisibility, one calibration batch: the layout of the codes does not
depend on the data) and handed to the same
per-layer function the writer runs on every layer. Each format's check is named by its row of the format table
(:attr:`quark_brevitas.export.registry.ExportFormat.plan_check`); the command line asks the table, not an if-chain.

GGUF's check (:func:`check_gguf_plan`) packs each distinct (weight spec, input width) of a two-row stand-in with the
writer's own functions (:func:`quark_brevitas.export.gguf.writer.gguf_type`,
:func:`~quark_brevitas.export.gguf.writer.pack_gguf_tensor`), and asks the writer's checks of the model's family and
of the tokenizer's fit to the embedding.

The checks quantize their stand-ins with :class:`~quark_brevitas.api.ModelQuantizer`, the pipeline the run will use,
so they live above the api, in the Hugging Face room (``quantize --model DIR`` is the only caller); the format table
names them by path and imports them only when a row's check runs, as it does the block-by-block writers.

A check takes ``(rows, skeleton, hf_config, tokenizer_dir)``: ``rows`` is ``ModelQuantizer(config).plan(skeleton)``,
``skeleton`` the model on the ``meta`` device (no weights needed), ``tokenizer_dir`` the folder whose tokenizer
will be written with it; it raises the :class:`~quark_brevitas.export.ExportError` the export would raise at its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config import Config, QLayerConfig
from quark_brevitas.export.errors import ExportError

__all__ = ["check_compressed_tensors_plan", "check_gguf_plan", "check_qcdq_plan", "check_quark_plan", "input_width",
           "output_rows", "quiet", "stand_ins"]

#: Files of which a folder holding a Hugging Face tokenizer has at least one (the ONNX export of a language model
#: is traced with a sentence through it).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")


def input_width(module: nn.Module) -> int | None:
    """Input channels of a layer stored as ``[out, in]`` (Linear; Hugging Face's Conv1D stores ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0])
    return None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The stand-ins are not the user's model: their "Quantized 1 layers" lines would only confuse."""
    package = logging.getLogger("quark_brevitas")
    previous = package.level
    package.setLevel(max(previous, logging.WARNING))
    try:
        yield
    finally:
        package.setLevel(previous)


def output_rows(module: nn.Module) -> int:
    """Output rows of a layer's stand-in: the layer's own up to 128, else 64 plus its count modulo 64 -- a few rows,
    with the same divisibility by every power of two up to 64 (formats pack along output channels: Quark's 4-bit
    codes go eight to an int32), and at least two (one scale per row is told apart from one per tensor)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        rows = int(module.out_features)
    elif weight is not None and weight.dim() == 2:  # Hugging Face's Conv1D: [in, out]
        rows = int(weight.shape[1])
    else:
        rows = 2
    return max(2, rows if rows <= 128 else 64 + rows % 64)


def _stand_in(module: nn.Module, width: int) -> nn.Module:
    """A layer of ``module``'s class with ``width`` inputs and :func:`output_rows` outputs, with deterministic
    weights."""
    has_bias = getattr(module, "bias", None) is not None
    rows = output_rows(module)
    if isinstance(module, nn.Linear):
        layer: nn.Module = nn.Linear(width, rows, bias=has_bias)
    else:  # Hugging Face's Conv1D(nf, nx)
        layer = type(module)(rows, width)
    with torch.no_grad():
        weight = layer.weight
        weight.copy_(torch.linspace(-1.0, 1.0, weight.numel()).reshape(weight.shape))
    return layer


def stand_ins(rows: list[Any], skeleton: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, quantized stand-in)`` for each distinct (layer class, layer spec, input width) the plan quantizes,
    named after the first layer of the plan that has it."""
    tried: set[tuple[str, str, int, int]] = set()
    for row in rows:
        if row.layer_config is None:
            continue
        module = skeleton.get_submodule(row.name)
        width = input_width(module)
        key = (type(module).__name__, repr(row.layer_config), width or 0, output_rows(module))
        if width is None or key in tried:
            continue
        tried.add(key)
        config = Config(row.layer_config, pre_quant_opt_config=[], algo_config=[])
        generator = torch.Generator().manual_seed(0)
        calibration = [torch.randn(4, width, generator=generator)]
        with quiet():
            quantized = ModelQuantizer(config).quantize_model(nn.Sequential(_stand_in(module, width)), calibration)
        yield row.name, quantized[0]


def _folder_check(format_name: str) -> Callable[..., None]:
    def check(rows: list[Any], skeleton: nn.Module, hf_config: Any,
              tokenizer_dir: str | os.PathLike[str] | None) -> None:
        from quark_brevitas.export.hf.checkpoints import check_layer_fits

        for name, layer in stand_ins(rows, skeleton):
            check_layer_fits(name, layer, format_name)

    check.__doc__ = (f"Raise the ExportError the {format_name} export of this plan would raise at its end: a layer "
                     "whose type, weight layout or activations the format does not hold (named).")
    return check


check_compressed_tensors_plan = _folder_check("compressed-tensors")
check_quark_plan = _folder_check("quark")


def check_qcdq_plan(rows: list[Any], skeleton: nn.Module, hf_config: Any,
                    tokenizer_dir: str | os.PathLike[str] | None) -> None:
    """ONNX QCDQ of a language model: traced with a sentence through its tokenizer (refused if there is none), and
    every layer spec exported on a stand-in and run in onnxruntime, as the export does."""
    import tempfile

    from quark_brevitas.export.onnx.qcdq import export_onnx_qcdq

    if tokenizer_dir is None or not any((Path(tokenizer_dir) / name).is_file() for name in _TOKENIZER_MARKERS):
        raise ExportError(f"the ONNX export of a language model is traced with a sentence through its tokenizer, and "
                          f"{str(tokenizer_dir)!r} holds none; give --tokenizer DIR")
    with tempfile.TemporaryDirectory(prefix="qb-plan-check-") as scratch:
        for index, (name, layer) in enumerate(stand_ins(rows, skeleton)):
            width = input_width(layer)
            try:
                with quiet():
                    export_onnx_qcdq(nn.Sequential(layer), torch.zeros(1, width or 1), Path(scratch) / f"{index}.onnx",
                                     dynamic_sequence=False)
            except ExportError as exc:
                raise ExportError(f"layer '{name}': {exc}") from exc


def _try_layer(name: str, layer_config: Any, width: int) -> None:
    """Quantize a ``[2, width]`` Linear with ``layer_config``'s weight spec and pack it as the writer would (two
    rows, so that one scale per row is told apart from one per tensor)."""
    from quark_brevitas.brevitas_adapter.kquant import is_kquant_layer
    from quark_brevitas.export.gguf.writer import gguf_type, pack_gguf_tensor
    from quark_brevitas.export.intweights import integer_weights

    config = Config(QLayerConfig(weight=layer_config.weight), pre_quant_opt_config=[], algo_config=[])
    stand_in = nn.Linear(width, 2, bias=False)
    with torch.no_grad():
        stand_in.weight.copy_(torch.linspace(-1.0, 1.0, 2 * width).reshape(2, width))
    with quiet():  # the stand-in is not the user's model: its "Quantized 1 layers" would only confuse
        quantized = ModelQuantizer(config).quantize_model(stand_in)
    entry = next(iter(integer_weights(quantized).values()))
    pack_gguf_tensor(name, entry, gguf_type(name, entry, is_kquant_layer(quantized)))


def check_gguf_plan(rows: list[Any], skeleton: nn.Module, hf_config: Any,
                    tokenizer_dir: str | os.PathLike[str] | None) -> None:
    """Raise the :class:`ExportError` the GGUF export of this plan would raise at its end, now: a family GGUF does
    not hold, a layer with quantized activations or a weight layout no GGUF type holds (named), a quantized MoE
    router, a tokenizer with ids beyond the embedding.
    ``rows``: ``ModelQuantizer(config).plan(skeleton)``; ``skeleton``: the model, on the
    ``meta`` device (no weights needed); ``tokenizer_dir``: the tokenizer folder that will be written with it."""
    from quark_brevitas.export.gguf.experts import refuse_quantized_router
    from quark_brevitas.export.gguf.writer import check_tokenizer_fits, plan_gguf

    plan = plan_gguf(hf_config, None, None)
    tried: dict[tuple[str, int], None] = {}
    for row in rows:
        layer = row.layer_config
        if layer is None:
            continue
        activations = [role for role in ("input_tensors", "output_tensors") if getattr(layer, role, None) is not None]
        if activations:
            raise ExportError(f"layer '{row.name}' quantizes its {' and '.join(activations)}; GGUF holds weight-only "
                              "models (float activations): use a gguf_* preset, or another --export format")
        width = input_width(skeleton.get_submodule(row.name))
        if layer.weight is None or width is None:
            continue
        refuse_quantized_router(str(plan.name_map.get_name(row.name)), row.name)
        key = (repr(layer.weight), width)
        if key not in tried:
            _try_layer(row.name, layer, width)
            tried[key] = None
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        check_tokenizer_fits(tokenizer_dir, getattr(hf_config, "vocab_size", None),
                             wordpiece=plan.family.metadata == "bert")
