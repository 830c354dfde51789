"""Test helper: tiny models of issue 30's families (Qwen3, Gemma 2, Gemma 3, Phi-3, Llama 3.x with llama3 rope
scaling and tied embeddings), each built from its transformers config with a fixed seed."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
FAMILIES = ["qwen3", "gemma2", "gemma3_text", "phi3", "llama"]
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_family(family: str, head_dim: int = 16, query_pre_attn_scalar: int | None = None) -> torch.nn.Module:
    """The tiny model of ``family`` (a name of :data:`FAMILIES`), in eval mode; ``head_dim`` where the config
    takes one apart from ``hidden_size / heads`` (Qwen3, Gemma). Gemma scales queries by
    ``query_pre_attn_scalar ** -0.5``: ``head_dim`` by default, as its released sizes do and llama.cpp assumes
    (transformers' GGUF loader reads none and takes the config default, 256)."""
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON, head_dim=head_dim))
    elif family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **_COMMON, head_dim=head_dim, query_pre_attn_scalar=query_pre_attn_scalar or head_dim))
    elif family == "gemma3_text":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **_COMMON, head_dim=head_dim, query_pre_attn_scalar=query_pre_attn_scalar or head_dim))
    elif family == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**_COMMON))
    elif family == "llama":  # Llama 3.x: llama3 rope scaling, tied embeddings
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **_COMMON, tie_word_embeddings=True, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}))
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return model.eval()


#: Mixture-of-experts families (issue 30), built by :func:`build_moe`.
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
_MOE_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   num_experts_per_tok=2, max_position_embeddings=64)


def build_moe(family: str, **overrides: object) -> torch.nn.Module:
    """The tiny model of a MoE family (4 experts, top-2; fused experts as transformers builds them), in eval mode;
    ``overrides`` replace config values (expert widths, ``norm_topk_prob``). Qwen3-MoE's router starts at zero
    (every token ties), so it is given a preference."""
    torch.manual_seed(0)
    if family == "mixtral":
        values = dict(_MOE_COMMON, intermediate_size=128, num_local_experts=4) | overrides
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**values)).eval()
    values = dict(_MOE_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4)
    if family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**(values | overrides))).eval()
        for block in model.model.layers:
            torch.nn.init.normal_(block.mlp.gate.weight, std=0.5)
        return model
    if family == "qwen2_moe":
        values = dict(values, shared_expert_intermediate_size=64) | overrides
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**values)).eval()
    raise ValueError(f"unknown MoE family {family!r}; known: {MOE_FAMILIES}")
