"""The KV-cache scales in the Hugging Face folders :func:`~quark_brevitas.export.export_safetensors` writes, under
the names their consumers read (the scales come from :func:`quark_brevitas.model_parts.kv_cache.kv_scales`).

- **compressed-tensors** (transformers with compressed-tensors, vLLM; llm-compressor's layout): ``kv_cache_scheme``
  in ``quantization_config`` (``QuantizationArgs``: 8-bit ``float`` or ``int``, ``tensor`` strategy, symmetric,
  static) and ``<attention>.k_scale`` / ``<attention>.v_scale`` (float32 ``[1]``). The consumer quantizes the keys
  after RoPE and the values as they enter the cache, so only a model quantized with ``kv_cache_post_rope=True`` is
  written: scales calibrated on the projections' outputs (before RoPE) would be applied to other tensors.
- **Quark** (amd-quark's importer, vLLM's Quark loader): ``<k_proj>.output_scale`` / ``<v_proj>.output_scale``
  (float32 ``[]``), as Quark 0.13 writes a cache scale before and after RoPE alike; ``kv_cache_quant_config`` and
  the projections' ``layer_quant_config`` entries carry the cache spec as ``output_tensors`` (what Quark's template
  writes), with ``kv_cache_post_rope`` and the ``export`` section's ``kv_cache_group`` / ``min_kv_scale``.

Per-head scales (``kv_cache_post_rope=True`` with a per-channel ``ch_axis=1`` cache spec): compressed-tensors holds
them as llm-compressor's ``attn_head`` strategy (``k_scale`` / ``v_scale`` shaped ``[kv_heads, 1, 1]``, applied to
``[batch, kv_heads, sequence, head_dim]``); Quark's ``output_scale`` of a projection output has no per-head layout,
so the Quark format refuses them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.hf.folder import TensorFormat
from quark_brevitas.export.hf.quark import exact_pattern, tensor_config
from quark_brevitas.model_parts.kv_cache import KVScales, kv_scales

__all__ = ["add_kv_cache", "attention_tensor_format", "quark_output_spec"]

_CONFIG_ATTRIBUTE = "quark_brevitas_config"  # pipeline.CONFIG_ATTRIBUTE (the export layer does not import it)


def attention_tensor_format(fmt: str, per_head: bool = False) -> TensorFormat:
    """The static symmetric 8-bit format of an attention tensor (cache, query, probabilities) in ``fmt`` (a
    :data:`~quark_brevitas.config.kv_cache.KV_FORMATS` name): one scale per tensor or per head."""
    return TensorFormat("float" if fmt == "fp8_e4m3" else "int", 8, True, "attn_head" if per_head else "tensor")


def quark_output_spec(fmt: TensorFormat) -> dict[str, Any]:
    """Quark's ``QTensorConfig`` dict of an attention tensor's format, its short ``dtype`` spelled as Quark's
    template writes it (``fp8_e4m3`` / ``int8``)."""
    spec = tensor_config(fmt, weight=False)
    spec["dtype"] = "fp8_e4m3" if fmt.type == "float" else "int8"
    return spec


def _qualified(name: str, prefix: str) -> str:
    return f"{prefix}{name}"


def add_kv_cache(model: nn.Module, format_name: str, tensors: dict[str, torch.Tensor],
                 quantization_config: dict[str, Any], prefix: str = "") -> int:
    """Add ``model``'s KV-cache scales to ``tensors`` and ``quantization_config`` in ``format_name``'s layout (see
    the module docstring); returns how many attention layers have them (0: nothing changed)."""
    scales = kv_scales(model)
    if not scales:
        return 0
    config = getattr(model, _CONFIG_ATTRIBUTE, None)
    post_rope = bool(getattr(config, "kv_cache_post_rope", False))
    formats = {entry.fmt for entry in scales}
    per_head = {bool(entry.key.dim() or entry.value.dim()) for entry in scales}
    if len(formats) > 1 or len(per_head) > 1:
        raise ExportError(f"{format_name} holds one KV-cache format; the model mixes {sorted(formats)} "
                          f"{'per head and per tensor' if len(per_head) > 1 else ''}".rstrip())
    if per_head == {True} and format_name != "compressed-tensors":
        raise ExportError(f"{scales[0].attention or 'attention'}: per-head KV-cache scales cannot be written in "
                          f"{format_name} (one output_scale per projection); quantize the cache per tensor, or "
                          "export format='compressed-tensors' (its attn_head strategy)")
    fmt = attention_tensor_format(formats.pop(), per_head.pop())
    if format_name == "compressed-tensors":
        _compressed_tensors(scales, fmt, post_rope, tensors, quantization_config, prefix)
    else:
        _quark(scales, fmt, post_rope, config, tensors, quantization_config, prefix)
    return len(scales)


def _compressed_tensors(scales: list[KVScales], fmt: TensorFormat, post_rope: bool, tensors: dict[str, torch.Tensor],
                        quantization_config: dict[str, Any], prefix: str) -> None:
    if not post_rope:
        raise ExportError("compressed-tensors' consumers (transformers, vLLM) apply k_scale to the keys after RoPE, "
                          "but this model's cache was quantized before RoPE (kv_cache_post_rope=False, Quark's "
                          "default); quantize with kv_cache_post_rope=True, or export format='quark'")
    quantization_config["kv_cache_scheme"] = {**fmt.args(), "observer": "minmax"}
    for entry in scales:
        attention = _qualified(entry.attention, prefix)
        shape = (-1, 1, 1) if fmt.strategy == "attn_head" else (1,)
        tensors[f"{attention}.k_scale"] = entry.key.float().reshape(shape).contiguous()
        tensors[f"{attention}.v_scale"] = entry.value.float().reshape(shape).contiguous()


def _quark(scales: list[KVScales], fmt: TensorFormat, post_rope: bool, config: Any, tensors: dict[str, torch.Tensor],
           quantization_config: dict[str, Any], prefix: str) -> None:
    output = quark_output_spec(fmt)
    layers = quantization_config["layer_quant_config"]
    kv_configs: dict[str, Any] = {}
    for entry in scales:
        for target, scale in ((entry.key_target, entry.key), (entry.value_target, entry.value)):
            name = _qualified(target, prefix)
            pattern = exact_pattern(name)
            if pattern in quantization_config["exclude"]:
                base = {"input_tensors": None, "weight": None, "bias": None, "target_device": None}
            else:
                base = layers.get(pattern, quantization_config["global_quant_config"])
            kv_configs[pattern] = {**base, "output_tensors": output}
            tensors[f"{name}.output_scale"] = scale.float().reshape(()).contiguous()
    # Quark's template writes the cache spec into both (its importer gives a module the kv entry that matches it).
    layers.update({pattern: dict(layer) for pattern, layer in kv_configs.items() if
                   pattern not in quantization_config["exclude"]})
    quantization_config["kv_cache_quant_config"] = kv_configs
    quantization_config["kv_cache_post_rope"] = post_rope
    export = quantization_config.setdefault("export", {})
    export["kv_cache_group"] = list(getattr(config, "kv_cache_group", []) or [])
    export["min_kv_scale"] = float(getattr(config, "min_kv_scale", 0.0) or 0.0)
