"""Attention quantization in a Config: Quark 0.13's ``softmax_quant_spec`` and the query spec its ``LLMTemplate``
writes for ``attention_scheme`` (the query projection's ``output_tensors``), checked here.

Quark 0.13's ``get_config(attention_scheme="fp8")`` sets ``softmax_quant_spec`` (static FP8 E4M3 per tensor, min-max)
and gives the query projections (``q_layer_name``) an ``output_tensors`` spec in ``layer_quant_config``. quark_brevitas
reads the same two things: with ``softmax_quant_spec`` set, each attention's probabilities (the softmax output, in
eager attention) and its query are quantized by quantizers of the attention
(:mod:`quark_brevitas.model_parts.attention`), the query with its projection's ``output_tensors`` spec, which is then
not applied a second time as the projection's output quantizer. The query is quantized where the keys are: after
RoPE with ``kv_cache_post_rope=True`` (where vLLM applies ``q_scale``), else on the projection's output (where Quark
applies it). Without ``softmax_quant_spec`` an ``output_tensors`` spec on a query projection stays what it is
everywhere: the layer's output quantizer.

Allowed specs (:func:`attention_format`): static, symmetric, FP8 E4M3 or int8, per tensor (one scale, what vLLM's
``q_scale`` / ``prob_scale`` hold). Plain data: nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from quark_brevitas.config.enums import Backend, QSchemeType
from quark_brevitas.config.kv_cache import kv_format
from quark_brevitas.config.specs import QuantizationSpec
from quark_brevitas.errors import ConfigError

__all__ = ["attention_format", "verify_attention"]

_ALLOWED = "a static, symmetric FP8 E4M3 or int8 spec, per tensor (one scale, as vLLM's q_scale / prob_scale)"


def attention_format(spec: QuantizationSpec, path: str) -> str:
    """The format name (``fp8_e4m3`` / ``int8``) of a query or probability spec; ConfigError naming ``path`` for
    one the attention quantizers cannot honour exactly."""
    if not isinstance(spec, QuantizationSpec):
        raise ConfigError(path, f"must be a QTensorConfig, got {type(spec).__name__}; allowed: {_ALLOWED}")
    resolved = spec.resolved(path)
    if resolved.qscheme is not QSchemeType.per_tensor:
        raise ConfigError(f"{path}.qscheme", f"{resolved.qscheme.name}; allowed: {_ALLOWED}")
    if resolved.is_dynamic:
        raise ConfigError(f"{path}.is_dynamic", f"True: the attention keeps one calibrated scale; allowed: {_ALLOWED}")
    fmt, _ = kv_format(spec, path, post_rope=False)  # the cache's formats: symmetric FP8 E4M3 or int8
    return fmt


def verify_attention(config: Any) -> None:
    """``softmax_quant_spec`` of ``config`` (a Config): a spec the probability quantizer executes exactly, and
    the layerwise backend (the quantizers sit in Hugging Face attention modules)."""
    spec = config.softmax_quant_spec
    if spec is None:
        return
    attention_format(spec, "softmax_quant_spec")
    if config.backend is not Backend.layerwise:
        raise ConfigError("softmax_quant_spec", f"needs Backend.layerwise (the attention's quantizers sit in the "
                                                f"model's attention modules), got Backend.{config.backend.name}")
