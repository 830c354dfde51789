"""What llama.cpp's converter (``convert_hf_to_gguf.py``) writes for a family beyond the common Llama-style
hyperparameters, so that our files read like its own (issue 30's families).

- ``qwen3``, ``qwen3_moe``, ``gemma2``, ``gemma3``: ``attention.key_length`` / ``attention.value_length`` (the head
  size, which these configs give apart from ``hidden_size / heads``).
- ``gemma2``: the attention and final logit soft-capping, the sliding window; ``gemma3``: the sliding window and
  the global attention's RoPE base (its config keeps two bases; llama.cpp's ``rope.freq_base`` is the full
  attention's). Their RMSNorms multiply by ``(1 + weight)``: llama.cpp stores ``1 + weight``
  (:attr:`~quark_brevitas.export.gguf.writer.GGUFFamily.norm_offset`), transformers' GGUF loader subtracts the 1 again.
- ``phi3``: ``rope.scaling.original_context_length``, the sliding window.
- Llama 3.x (``rope_type: llama3``): the per-frequency RoPE factors as the ``rope_freqs`` tensor
  (:func:`rope_freqs`), which llama.cpp multiplies into the rotary wavelengths. transformers' GGUF loader does not
  read that tensor back (it rebuilds a Llama without rope scaling): llama.cpp is the consumer of such a file.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["add_family_metadata", "rope_freqs"]


def _rope_parameters(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(rope) if isinstance(rope, dict) else {}


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(config.num_attention_heads)


def rope_theta(config: Any, family_name: str, default: float) -> float:
    """The RoPE base llama.cpp writes as ``rope.freq_base`` (Gemma 3: the full attention's)."""
    rope = _rope_parameters(config)
    if family_name == "gemma3_text" and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    value = getattr(config, "rope_theta", None) or rope.get("rope_theta")
    return float(value) if value is not None else default


def add_family_metadata(writer: Any, config: Any, family_name: str) -> None:
    """The family's own keys (see the module docstring); nothing for Llama, Mistral and Qwen2."""
    if family_name in ("qwen3", "qwen3_moe", "gemma2", "gemma3_text"):
        writer.add_key_length(_head_dim(config))
        writer.add_value_length(_head_dim(config))
    if family_name == "gemma2":
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if getattr(config, key, None) is not None:
                add(float(getattr(config, key)))
    if family_name in ("gemma2", "gemma3_text", "phi3") and getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
    if family_name == "phi3":
        original = getattr(config, "original_max_position_embeddings", None)
        writer.add_rope_scaling_orig_ctx_len(int(original or config.max_position_embeddings))


def rope_freqs(config: Any, family_name: str) -> np.ndarray | None:
    """Llama 3.x's RoPE factors (one per frequency, float32) as llama.cpp's converter computes them for
    ``rope_type: llama3``; ``None`` for any other model."""
    rope = _rope_parameters(config)
    if family_name != "llama" or str(rope.get("rope_type", rope.get("type", ""))).lower() != "llama3":
        return None
    base, dim = rope_theta(config, family_name, 10000.0), _head_dim(config)
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    context = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = context / low, context / high
    frequencies = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factors = []
    for frequency in frequencies:
        wavelen = 2 * math.pi / float(frequency)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)
