"""Decoder LMs exported with their key/value cache as graph inputs and outputs (incremental decoding in onnxruntime).

A Hugging Face decoder keeps the keys and values of the tokens it has seen in a ``Cache`` object, which the
TorchScript ONNX exporter cannot take or return. :class:`CachedDecoder` is the export wrapper that turns it into
tensors: it takes the keyword inputs (``input_ids``, ``attention_mask`` covering past and current tokens, ...) and one
``past_key_values.{i}.key`` / ``past_key_values.{i}.value`` tensor ``[batch, kv_heads, past_sequence, head_dim]`` per
layer, rebuilds a ``DynamicCache`` from them inside ``forward`` (traced as ``Concat`` of past and new keys), calls the
model with ``use_cache=True`` and returns the model's outputs (``logits``) plus ``present.{i}.key`` /
``present.{i}.value`` (past and current tokens): the names optimum / onnxruntime-genai users know.

:func:`with_past` turns the user's prompt batch into the example that is traced and verified: the model runs on the
first tokens of the prompt to make a past of a few tokens, and the rest of the prompt (at least two tokens) is the
current input. At least two current tokens, because transformers takes another path for a single query token
(``sdpa_attention_forward`` packs grouped-query heads with ``pack_gqa`` when ``q_length == 1``) and a trace keeps only
the path it saw: traced on two or more tokens the graph is right for any number of tokens, one included; traced on
one it would break on longer inputs. A past given by the caller (keys named as above) is used as is.

:func:`export_module` is the one place that picks the module the exporter traces for an example (this wrapper, the
keyword wrapper of :mod:`~quark_brevitas.export.args`, or the model itself). transformers is imported only here and
only for examples with a past.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from quark_brevitas.calibration.data import CACHE_KEYWORDS, cache_keyword, output_cache, takes
from quark_brevitas.export.args import Example, KeywordInputs, past_name, past_names, type_name
from quark_brevitas.export.errors import ExportError

logger = logging.getLogger(__name__)

#: What :func:`with_past` accepts, for error messages.
ALLOWED = ("past_key_values=True exports decoder language models whose forward takes a key/value cache (cache, "
           "or past_key_values before transformers 5.24) and use_cache and returns a transformers DynamicCache "
           "(GPT-2, OPT, Llama, Mistral, Qwen2, ... *ForCausalLM or their base models)")

#: The symbolic dimension of past + current tokens (``attention_mask``, ``present.*``).
TOTAL = "past_sequence + sequence"


class CachedDecoder(nn.Module):
    """Export wrapper: keyword tensors and per-layer past keys/values in, the model's outputs and the present
    keys/values out (see the module docstring). Make it with ``.eval()`` (as :class:`KeywordInputs`)."""

    def __init__(self, model: nn.Module, names: Sequence[str], layers: int) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.layers = layers
        #: The cache argument's name in this model's forward (``cache`` or ``past_key_values``, see
        #: :func:`~quark_brevitas.calibration.data.cache_keyword`); :func:`with_past` has checked that there is one.
        self.cache_keyword = cache_keyword(model) or "past_key_values"

    def forward(self, *args: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers import DynamicCache

        n = len(self.names)
        past = args[n:]
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layers)],
                             config=getattr(self.model, "config", None))
        out = self.model(**dict(zip(self.names, args[:n])), **{self.cache_keyword: cache}, use_cache=True)
        result = {key: value for key, value in out.items() if key not in CACHE_KEYWORDS and value is not None}
        for i, (key, value) in enumerate(cache_tensors(self.model, output_cache(out))):
            result[f"present.{i}.key"] = key
            result[f"present.{i}.value"] = value
        return result


def cache_tensors(model: nn.Module, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (key, value) tensors of each layer of a decoder's ``DynamicCache``; :class:`ExportError` for anything
    else (no cache: not a decoder; an encoder-decoder or sliding-window cache: not supported)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    where = f"{type_name(model)} called with use_cache=True returned"
    if cache is None:
        raise ExportError(f"{where} no key/value cache: it is not a decoder with a cache. {ALLOWED}.")
    if not isinstance(cache, DynamicCache):
        raise ExportError(f"{where} a {type_name(cache)}, not a DynamicCache. {ALLOWED}.")
    pairs = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
            raise ExportError(f"{where} a {type_name(layer)} at layer {i}; sliding-window and other special cache "
                              f"layers are not supported. {ALLOWED}.")
        if not (isinstance(layer.keys, torch.Tensor) and layer.keys.ndim == 4):
            raise ExportError(f"{where} no 4-D key tensor at layer {i}. {ALLOWED}.")
        pairs.append((layer.keys, layer.values))
    return pairs


def _require_decoder(model: nn.Module) -> None:
    missing = [] if cache_keyword(model) else ["cache / past_key_values"]
    missing += [] if takes(model, "use_cache") else ["use_cache"]
    if missing:
        raise ExportError(f"{type_name(model)}.forward takes no {' / '.join(missing)}: it is not a decoder with a "
                          f"cache. {ALLOWED}.")


def with_past(model: nn.Module, example: Example) -> Example:
    """The example of a cached export (model in eval mode): keyword inputs first, then ``past_key_values.{i}.key`` /
    ``.value`` in layer order. A past in ``example`` is kept (only reordered); otherwise the model runs on the first
    ``min(n // 2, n - 2)`` of the prompt's ``n >= 3`` tokens to make one, the rest is the current input and
    ``attention_mask`` (all ones if missing) covers both. :class:`ExportError` for models without a cache, examples
    that are not a dict with ``input_ids``, and fewer than two current tokens."""
    _require_decoder(model)
    if not example.keyword:
        raise ExportError("past_key_values=True needs the example as a dict of keyword tensors, e.g. "
                          "{'input_ids': ..., 'attention_mask': ...}; got positional tensors")
    inputs = dict(zip(example.names, example.tensors))
    ids = inputs.get("input_ids")
    if ids is None or ids.ndim != 2:
        raise ExportError(f"past_key_values=True needs 'input_ids' of shape [batch, sequence] in the example; got "
                          f"{tuple(ids.shape) if ids is not None else 'none'} (inputs: {', '.join(example.names)})")
    if example.past:
        return _given_past(model, inputs, example)
    length = int(ids.shape[1])
    if length < 3:
        raise ExportError(f"past_key_values=True needs a prompt of at least 3 tokens in the example (got {length}): "
                          "the first become the past, at least 2 the traced step (a 1-token trace keeps transformers' "
                          "single-token attention path, wrong for longer inputs)")
    split = min(length // 2, length - 2)
    inputs.setdefault("attention_mask", torch.ones_like(ids))
    aligned = [k for k, v in inputs.items() if v.ndim >= 2 and int(v.shape[1]) == length]  # input_ids, position_ids
    first = {k: v[:, :split] if k in aligned else v for k, v in inputs.items()}
    with torch.no_grad():
        out = model(**first, use_cache=True)
    pairs = cache_tensors(model, output_cache(out))
    current = {k: v[:, split:] if k in aligned and k != "attention_mask" else v for k, v in inputs.items()}
    logger.info("exporting with past key/values: a past of %d token(s) made by running the model on the prompt's "
                "first tokens, %d current token(s), %d layers", split, length - split, len(pairs))
    names = (*current, *past_names(len(pairs)))
    tensors = (*current.values(), *(t.detach().clone() for pair in pairs for t in pair))
    return Example(tuple(tensors), tuple(names), keyword=True, past=len(pairs))


def _given_past(model: nn.Module, inputs: dict[str, torch.Tensor], example: Example) -> Example:
    keyword = {k: v for k, v in inputs.items() if past_name(k) is None}
    count = len(inputs) - len(keyword)
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    expected = past_names(layers if isinstance(layers, int) else (count + 1) // 2)
    missing = sorted(set(expected) - set(inputs))
    if missing:
        raise ExportError(f"the example's past is incomplete: give past_key_values.{{i}}.key and "
                          f"past_key_values.{{i}}.value for every layer i = 0..n-1 (missing: {', '.join(missing)})")
    if int(inputs["input_ids"].shape[1]) < 2:
        raise ExportError("with a past, the example's input_ids need at least 2 tokens: a 1-token trace keeps "
                          "transformers' single-token attention path, wrong for longer inputs")
    names = (*keyword, *expected)
    return Example(tuple(inputs[n] for n in names), names, keyword=True, past=len(expected) // 2)


def export_module(model: nn.Module, example: Example) -> nn.Module:
    """The module the exporter traces and verification runs for ``example`` (called with its tensors positionally):
    :class:`CachedDecoder` for an example with a past, :class:`KeywordInputs` for keyword inputs or a decoder whose
    cache must be turned off, else ``model`` itself."""
    if example.past:
        keyword = [n for n in example.names if past_name(n) is None]
        return CachedDecoder(model, keyword, example.past).eval()
    if KeywordInputs.needed(model, example):
        return KeywordInputs(model, example.names, example.keyword).eval()
    return model


def past_axes(example: Example, outputs: Sequence[str], *, batch: bool, sequence: bool) -> dict[str, dict[int, str]]:
    """Symbolic axes of a cached export: ``batch`` on dimension 0 of everything; ``sequence`` on the current tokens
    (``input_ids``, ``logits``, ...), ``past_sequence`` on dimension 2 of the pasts and ``past_sequence + sequence``
    on ``attention_mask`` and dimension 2 of the presents."""
    current = int(example.tensors[example.names.index("input_ids")].shape[1])
    axes: dict[str, dict[int, str]] = {}

    def put(name: str, dims: dict[int, str]) -> None:
        chosen = {d: s for d, s in dims.items() if (s == "batch" and batch) or (s != "batch" and sequence)}
        if chosen:
            axes[name] = chosen

    for name, tensor in zip(example.names, example.tensors):
        if past_name(name) is not None:
            put(name, {0: "batch", 2: "past_sequence"})
        elif name == "attention_mask":
            put(name, {0: "batch", 1: TOTAL})
        elif tensor.ndim >= 2 and int(tensor.shape[1]) == current:
            put(name, {0: "batch", 1: "sequence"})
        elif tensor.ndim >= 1:
            put(name, {0: "batch"})
    for name in outputs:
        put(name, {0: "batch", 2: TOTAL} if name.startswith("present.") else {0: "batch", 1: "sequence"})
    return axes
