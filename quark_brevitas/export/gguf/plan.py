"""Whether a quantization plan can be written as GGUF, decided before calibration starts.

Why: ``quantize --model DIR --export gguf`` with a config GGUF cannot hold used to be refused by the exporter,
after the calibration (hours on a real model). The refusal must come first, and it must be the exporter's own:
a second, hand-written list of what GGUF holds would drift from the one the writer applies. So each distinct
(weight spec, input width) of the plan is tried on a two-row stand-in layer, quantized with that spec (no data,
no algorithm: the layout of the codes does not depend on them) and packed by the same functions the writer uses
(:func:`quark_brevitas.export.gguf.writer.gguf_type` and
:func:`~quark_brevitas.export.gguf.writer.pack_gguf_tensor`); the
model's family (:func:`plan_gguf`) and the tokenizer's fit to the embedding (:func:`check_tokenizer_fits`) are the
writer's checks too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.plan_checks import input_width, quiet

__all__ = ["check_gguf_plan"]


def _try_layer(name: str, layer_config: Any, width: int) -> None:
    """Quantize a ``[2, width]`` Linear with ``layer_config``'s weight spec and pack it as the writer would (two
    rows, so that one scale per row is told apart from one per tensor)."""
    from quark_brevitas.api import ModelQuantizer
    from quark_brevitas.brevitas_adapter.kquant import is_kquant_layer
    from quark_brevitas.config import Config, QLayerConfig
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
    router, a tokenizer with ids
    beyond the embedding. ``rows``: ``ModelQuantizer(config).plan(skeleton)``; ``skeleton``: the model, on the
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
