"""Attention quantization of Hugging Face decoders: static FP8 E4M3 / int8 scales for the query and the attention
probabilities (the softmax output), calibrated block by block like the KV-cache scales (the config side is
:mod:`quark_brevitas.config.attention`).

Where:

- **the probabilities**: transformers' eager attention computes ``softmax(q k^T * scaling + mask)`` in float32
  and multiplies the result with the values; the probability quantizer (the attention's ``prob_quantizer``)
  quantizes that softmax output. sdpa and flash attention never materialise it, so the model is switched to
  eager attention before anything runs (:func:`use_eager_attention`, a warning says so). Each quantized
  attention calls :func:`quantized_attention` through transformers' attention interface (its own copy of the
  model config names it), which runs the model family's own ``eager_attention_forward`` with its softmax
  quantized: a ``TorchFunctionMode`` catches the softmax call (exactly one per attention call, else an error).
- **the query**: with ``kv_cache_post_rope=True``, after RoPE, as the attention receives it (where vLLM applies
  ``q_scale``; the attention's ``q_quantizer``); otherwise on the query projection's output, before RoPE, where
  Quark applies its ``q_proj`` output spec (the projection's ``q_quantizer``, a forward hook).

The quantizers are :class:`~quark_brevitas.model_parts.kv_cache.StaticQuantizer` s: ``max |x|`` observed while
the block is calibrated, then ``scale = amax / 448`` (FP8 E4M3) or ``amax / 127`` (int8) and
``dequant(x) = clamp(cast(x / s)) * s``, the KV cache's formula. Their scales are buffers outside the state dict;
the exporters write them under the names their consumers read (:func:`attention_scales`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quark_brevitas.config.attention import attention_format
from quark_brevitas.config.kv_cache import KV_FORMATS
from quark_brevitas.errors import ModelError
from quark_brevitas.model_parts.kv_cache import StaticQuantizer, quantizers_disabled

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_FUNCTION",
    "AttentionQuantizer",
    "AttentionScales",
    "attach_attention_quantizers",
    "attention_plan_lines",
    "attention_quantization_disabled",
    "attention_scales",
    "attentions",
    "finish_attention_calibration",
    "quantized_attention",
    "query_projections",
    "use_eager_attention",
]

#: The name :func:`quantized_attention` is registered under in transformers' attention interface.
ATTENTION_FUNCTION = "quark_brevitas_eager"
QUERY_QUANTIZER, PROB_QUANTIZER = "q_quantizer", "prob_quantizer"
_QUERY_PROJECTION = "q_proj"


class AttentionQuantizer(StaticQuantizer):
    """Static per-tensor quantizer of an attention's query or probabilities (see :class:`StaticQuantizer`);
    ``target``: the query projection (``model.layers.0.self_attn.q_proj``) or the attention itself."""

    def __init__(self, fmt: str, target: str) -> None:
        super().__init__(fmt, target)


# ===================================================================== finding attentions
def attentions(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The attention modules of ``model``: modules with ``q_proj``, ``k_proj`` and ``v_proj`` children."""
    for name, module in model.named_modules():
        if all(isinstance(getattr(module, p, None), nn.Module) for p in (_QUERY_PROJECTION, "k_proj", "v_proj")):
            yield name, module


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def query_projections(model: nn.Module, config: Any) -> list[str]:
    """The query projections of ``model`` (names relative to it) whose ``output_tensors`` spec the attention's
    query quantizer executes instead of a layer output quantizer: all of them when ``softmax_quant_spec`` is set."""
    if config.softmax_quant_spec is None:
        return []
    return [_qualified(name, _QUERY_PROJECTION) for name, _ in attentions(model)]


def use_eager_attention(model: nn.Module) -> None:
    """Switch ``model`` to eager attention where it runs another (sdpa, flash): only eager attention computes the
    probabilities the probability quantizer quantizes. A model without any attention module is refused."""
    if not any(True for _ in attentions(model)):
        raise ModelError(f"softmax_quant_spec: {type(model).__name__} has no attention module with q_proj, k_proj "
                         "and v_proj children (fused projections are not supported); leave softmax_quant_spec None")
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if config is None or current in ("eager", None):
        return
    logger.warning("%s runs %r attention, which never materialises the attention probabilities: switched to "
                   "eager attention for softmax_quant_spec (attention_scheme)", type(model).__name__, current)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        config._attn_implementation = "eager"
    if config._attn_implementation != "eager":
        raise ModelError(f"{type(model).__name__}: could not switch from {current!r} to eager attention, which "
                         "attention quantization needs; load the model with attn_implementation='eager'")


# ===================================================================== the attention function
_SOFTMAX = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax})


class _QuantizedSoftmax(TorchFunctionMode):
    """Within an eager attention call: the softmax's output goes through ``quantizer``; ``calls`` counts them."""

    def __init__(self, quantizer: nn.Module) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.calls = 0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SOFTMAX:
            self.calls += 1
            out = self.quantizer(out)
        return out


def _family_eager(module: nn.Module) -> Callable[..., Any]:
    """The model family's own eager attention (``eager_attention_forward`` beside the attention class)."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(eager):
        raise ModelError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}; "
                         "attention quantization runs the family's eager attention through transformers' "
                         "attention interface")
    return eager


def quantized_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
    """The attention function quantized attentions call (transformers' attention interface): the family's eager
    attention on the quantized query (after RoPE, where the attention has a ``q_quantizer``), its softmax output
    quantized by the attention's ``prob_quantizer``."""
    quantizer = getattr(module, QUERY_QUANTIZER, None)
    if isinstance(quantizer, AttentionQuantizer):
        query = quantizer(query)
    mode = _QuantizedSoftmax(getattr(module, PROB_QUANTIZER))
    with mode:
        out = _family_eager(module)(module, query, key, value, attention_mask, *args, **kwargs)
    if mode.calls != 1:
        raise ModelError(f"{type(module).__name__}: its eager attention called softmax {mode.calls} times (expected "
                         "once: the probabilities the probability quantizer quantizes)")
    return out


def _route_through_quantized_attention(attention: nn.Module) -> None:
    """Give ``attention`` its own copy of the model config naming :func:`quantized_attention` (the rest of the
    model, its attention masks included, stays eager)."""
    from transformers import AttentionInterface

    if ATTENTION_FUNCTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_FUNCTION, quantized_attention)
    config = getattr(attention, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ModelError(f"{type(attention).__name__} has no config with an attention implementation; attention "
                         "quantization needs transformers' attention interface")
    if config._attn_implementation != "eager":
        raise ModelError(f"{type(attention).__name__} runs {config._attn_implementation!r} attention; attention "
                         "quantization needs eager attention (the model is switched before it runs)")
    own = copy.copy(config)
    own._attn_implementation_internal = ATTENTION_FUNCTION  # not the setter: it would reach shared sub-configs
    attention.config = own


def _quantize_query(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a query projection quantized before RoPE."""
    return getattr(module, QUERY_QUANTIZER)(output)


# ===================================================================== attaching and finishing
def attach_attention_quantizers(model: nn.Module, config: Any, query_specs: Mapping[str, Any],
                                prefix: str = "") -> int:
    """Give each attention of ``model`` its probability quantizer (``softmax_quant_spec``) and, where
    ``query_specs`` (query projection name relative to ``model`` -> its ``output_tensors`` spec, or ``None``)
    has one, its query quantizer, all calibrating; ``prefix``: ``model``'s place in the whole model. Returns how
    many attentions got them (0 without ``softmax_quant_spec``)."""
    if config.softmax_quant_spec is None:
        return 0
    prob_format = attention_format(config.softmax_quant_spec, "softmax_quant_spec")
    count = 0
    for name, attention in list(attentions(model)):
        where = _qualified(prefix, name)
        projection = _qualified(name, _QUERY_PROJECTION)
        spec = query_specs.get(projection)
        if spec is not None:
            target = _qualified(prefix, projection)
            query = AttentionQuantizer(attention_format(spec, f"{target}.output_tensors (the query)"), target)
            if config.kv_cache_post_rope:
                attention.add_module(QUERY_QUANTIZER, query)
            else:
                attention.q_proj.add_module(QUERY_QUANTIZER, query)
                attention.q_proj.register_forward_hook(_quantize_query)
        attention.add_module(PROB_QUANTIZER, AttentionQuantizer(prob_format, where))
        _route_through_quantized_attention(attention)
        count += 1
    return count


def query_specs(rows: Collection[Any], projections: Collection[str]) -> dict[str, Any]:
    """``{query projection: its output_tensors spec}`` from a plan's rows (``PlannedLayer``)."""
    wanted = set(projections)
    return {row.name: row.layer_config.output_tensors for row in rows
            if row.name in wanted and row.layer_config is not None and row.layer_config.output_tensors is not None}


def _quantizers(model: nn.Module) -> Iterator[AttentionQuantizer]:
    return (m for m in model.modules() if isinstance(m, AttentionQuantizer))


def finish_attention_calibration(model: nn.Module) -> None:
    """Scales from the observed maxima, and the attention quantizers of ``model`` switched from observing to
    quantizing. A quantizer no batch reached is an error (its attention never ran, or not through
    :func:`quantized_attention`)."""
    tiny = torch.finfo(torch.float32).tiny
    for quantizer in _quantizers(model):
        if not quantizer.calibrating:
            continue
        if quantizer.seen == 0:
            raise ModelError(f"{quantizer.target}: no calibration batch reached the attention quantizer; the "
                             "attention must run (through transformers' attention interface) during calibration")
        quantizer.scale.copy_((quantizer.amax / KV_FORMATS[quantizer.fmt]).clamp_min(tiny))
        quantizer.calibrating = False
        logger.debug("%s: attention scale %s", quantizer.target, quantizer.scale.tolist())


def attention_quantization_disabled(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``model``'s query and probability quantizers pass their tensors through in float."""
    return quantizers_disabled(_quantizers(model))


@dataclass(frozen=True)
class AttentionScales:
    """One attention's calibrated scales (0-d): the query's (``None`` where it is not quantized) and the
    probabilities', with their formats; ``query_target`` is the query projection's name."""

    attention: str
    prob_fmt: str
    prob: torch.Tensor
    query_fmt: str | None
    query: torch.Tensor | None
    query_target: str
    post_rope: bool


def attention_scales(model: nn.Module) -> list[AttentionScales]:
    """The calibrated attention scales of ``model``, one entry per quantized attention (names relative to it)."""
    found = []
    for name, attention in attentions(model):
        prob = getattr(attention, PROB_QUANTIZER, None)
        if not isinstance(prob, AttentionQuantizer):
            continue
        post = getattr(attention, QUERY_QUANTIZER, None)
        query = post if isinstance(post, AttentionQuantizer) else getattr(attention.q_proj, QUERY_QUANTIZER, None)
        for quantizer in (prob, query):
            if isinstance(quantizer, AttentionQuantizer) and quantizer.calibrating:
                raise ModelError(f"{quantizer.target}: the attention quantizers are not calibrated")
        has_query = isinstance(query, AttentionQuantizer)
        found.append(AttentionScales(name, prob.fmt, prob.scale.clone(), query.fmt if has_query else None,
                                     query.scale.clone() if has_query else None,
                                     _qualified(name, _QUERY_PROJECTION), isinstance(post, AttentionQuantizer)))
    return found


def attention_plan_lines(model: nn.Module, config: Any, specs: Mapping[str, Any]) -> list[str]:
    """What ``plan`` shows of attention quantization: the probabilities and queries quantized, and how
    (``specs``: :func:`query_specs` of the plan's rows)."""
    if config.softmax_quant_spec is None:
        return []
    where = "after RoPE (q_scale as vLLM applies it)" if config.kv_cache_post_rope else \
        "on the q_proj outputs, before RoPE (Quark's default)"
    found = list(attentions(model))
    prob = attention_format(config.softmax_quant_spec, "softmax_quant_spec")
    lines = [f"Attention: {len(found)} attention layers, probabilities (softmax output) {prob} static per tensor, "
             f"eager attention; queries quantized {where} with the q_proj rows' output spec"]
    for name, _ in found:
        projection = _qualified(name, _QUERY_PROJECTION)
        spec = specs.get(projection)
        query = f"query {attention_format(spec, projection)} static per tensor" if spec is not None else \
            "query in float (its projection has no output_tensors spec)"
        lines.append(f"  {name}: probabilities {prob}, {query}")
    return lines
