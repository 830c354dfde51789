"""The attention scales (query and probabilities) in the Hugging Face folders
:func:`~quark_brevitas.export.export_safetensors` writes, under the names their consumers read (the scales come from
:func:`quark_brevitas.model_parts.attention.attention_scales`).

- **Quark** (amd-quark's importer, vLLM's and SGLang's Quark loaders): as Quark 0.13 writes an ``attention_scheme``
  model: ``softmax_quant_spec`` in ``quantization_config`` and ``<attention>.prob_output_scale`` (float32 ``[]``,
  the state-dict key of Quark's probability quantizer); the query projection's ``layer_quant_config`` entry with the
  query spec as ``output_tensors`` and ``<q_proj>.output_scale`` (float32 ``[]``). vLLM maps them to its attention's
  ``prob_scale`` / ``q_scale`` (``get_cache_scale``). Quark quantizes the query on the projection's output; a model
  quantized after RoPE (``kv_cache_post_rope=True``) writes its scale there too, as Quark writes its post-RoPE cache.
- **compressed-tensors** (llm-compressor's layout for attention quantization, read by compressed-tensors' hooked
  attention and by vLLM): a ``config_groups`` entry targeting the attention class with the query spec as
  ``input_activations``, and ``<attention>.q_scale`` (float32 ``[1]``), applied to the query after RoPE; so only a
  model quantized with ``kv_cache_post_rope=True`` is written. compressed-tensors has no probability quantization:
  the probability scale is written as ``<attention>.prob_output_scale``, the name vLLM's loaders map to
  ``prob_scale``; transformers ignores it (an unexpected key).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.hf.kv_scales import attention_tensor_format, quark_output_spec
from quark_brevitas.export.hf.quark import exact_pattern
from quark_brevitas.model_parts.attention import AttentionScales, attention_scales

__all__ = ["add_attention"]


def add_attention(model: nn.Module, format_name: str, tensors: dict[str, torch.Tensor],
                  quantization_config: dict[str, Any], prefix: str = "") -> int:
    """Add ``model``'s attention scales to ``tensors`` and ``quantization_config`` in ``format_name``'s layout (see
    the module docstring); returns how many attention layers have them (0: nothing changed)."""
    scales = attention_scales(model)
    if not scales:
        return 0
    probs = {entry.prob_fmt for entry in scales}
    queries = {entry.query_fmt for entry in scales}
    if len(probs) > 1 or len(queries) > 1:
        raise ExportError(f"{format_name} holds one attention format; the model mixes probabilities in "
                          f"{sorted(probs)} and queries in {sorted(map(str, queries))}")
    if format_name == "compressed-tensors":
        _compressed_tensors(model, scales, tensors, quantization_config, prefix)
    else:
        _quark(scales, tensors, quantization_config, prefix)
    return len(scales)


def _quark(scales: list[AttentionScales], tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any],
           prefix: str) -> None:
    quantization_config["softmax_quant_spec"] = quark_output_spec(attention_tensor_format(scales[0].prob_fmt))
    layers = quantization_config["layer_quant_config"]
    for entry in scales:
        tensors[f"{prefix}{entry.attention}.prob_output_scale"] = entry.prob.float().reshape(()).contiguous()
        if entry.query is None:
            continue
        name = f"{prefix}{entry.query_target}"
        pattern = exact_pattern(name)
        if pattern in quantization_config["exclude"]:
            raise ExportError(f"{name}: a float query projection with a quantized query cannot be written in the "
                              "Quark format (its output_scale needs a layer entry); quantize the projection's weights")
        base = layers.get(pattern, quantization_config["global_quant_config"])
        layers[pattern] = {**base, "output_tensors": quark_output_spec(attention_tensor_format(entry.query_fmt))}
        tensors[f"{name}.output_scale"] = entry.query.float().reshape(()).contiguous()


def _compressed_tensors(model: nn.Module, scales: list[AttentionScales], tensors: dict[str, torch.Tensor],
                        quantization_config: dict[str, Any], prefix: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    with_query = [entry for entry in scales if entry.query is not None]
    if any(not entry.post_rope for entry in with_query):
        raise ExportError("compressed-tensors' consumers (compressed-tensors' hooked attention, vLLM) apply q_scale "
                          "to the query after RoPE, but this model's query was quantized on the q_proj output, "
                          "before RoPE (kv_cache_post_rope=False, Quark's default); quantize with "
                          "kv_cache_post_rope=True, or export format='quark'")
    for entry in scales:
        tensors[f"{prefix}{entry.attention}.prob_output_scale"] = entry.prob.float().reshape(()).contiguous()
    if not with_query:
        return
    classes = sorted({type(model.get_submodule(entry.attention)).__name__ for entry in with_query})
    query = attention_tensor_format(with_query[0].query_fmt)
    scheme = QuantizationScheme(targets=classes, input_activations=QuantizationArgs(**query.args()))
    quantization_config["config_groups"]["attention"] = scheme.model_dump()
    for entry in with_query:
        tensors[f"{prefix}{entry.attention}.q_scale"] = entry.query.float().reshape(1).contiguous()
