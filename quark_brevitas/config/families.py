"""The transformer families the project knows, as plain data: one row per family.

Three readers need the same facts about a family and must not disagree: the structure inference
(:mod:`quark_brevitas.algorithms.structure`: which scaling groups a decoder layer has), the block-stack finder
(:mod:`quark_brevitas.blocks.stack`: where the repeated blocks live) and the LLM templates
(:mod:`quark_brevitas.config.template`: what to exclude, which layers hold the KV cache). They need torch to
look at a model; this table does not, so it lives in the config package (importable without torch) and the
two torch modules import it from here.

A scaling group (:class:`ScalingCandidate`) is a family's *natural* group; whether it is exact in one model
is decided by the inference, which reads ``condition`` (a name, not code, so that the table stays data):

- ``None``: exact whenever the shapes match;
- ``"pre_norm"``: exact only in a pre-norm block (OPT's ``do_layer_norm_before``);
- ``"post_norm"``: never exact (the norm's output also feeds the residual connection);
- ``"homogeneous:<attr>"``: exact only if the activation at ``<attr>`` (a dotted attribute path from the
  block) is positively homogeneous (ReLU);
- ``"not_homogeneous"``: never exact (a GELU sits between the two layers).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BLOCK_STACK_PATHS",
    "CONDITIONS",
    "FAMILIES",
    "Family",
    "RotationRoles",
    "ScalingCandidate",
    "scaling_candidates",
]

#: The condition names a :class:`ScalingCandidate` may carry (``homogeneous:`` takes an attribute path).
CONDITIONS = ("pre_norm", "post_norm", "homogeneous:", "not_homogeneous", "fused_v", "fused_up")


@dataclass(frozen=True)
class ScalingCandidate:
    """One natural scaling group of a family: ``prev_op``'s output channels scale the input channels of
    ``layers`` (names relative to a block); AWQ measures ``module2inspect`` (``None``: the layers)."""

    prev_op: str
    layers: tuple[str, ...]
    module2inspect: str | None = None
    condition: str | None = None

    def __str__(self) -> str:
        return f"{self.prev_op} -> {', '.join(self.layers)}"


@dataclass(frozen=True)
class RotationRoles:
    """Where a family's blocks take Hadamard rotations (RotationConfig; names relative to a block).

    - ``heads``: the attention module whose ``head_dim`` (or ``attention_head_size``) gives R2's size;
    - ``v_proj`` / ``o_proj``: the value and output projections R2 is folded into, per head;
    - ``down_proj``: the layer R4 puts behind an online Hadamard;
    - ``readers``: the layers that read a norm's output (online R1 puts a Hadamard on their inputs);
    - ``writers``: the layers that add into the residual stream (folded R1 rotates their outputs);
    - ``no_r1``: why folded R1 is not exact in this family (``None``: it is, given RMSNorms, checked per model).
    """

    heads: str
    v_proj: str
    o_proj: str
    down_proj: str
    readers: tuple[str, ...] = ()
    writers: tuple[str, ...] = ()
    no_r1: str | None = None


@dataclass(frozen=True)
class Family:
    """What the project knows of one model family.

    - ``decoder_layers``: where the family's usual Hugging Face class keeps its blocks (the block-stack
      finder tries these paths first for models that are not Hugging Face models).
    - ``exclude``: the layers Quark's templates keep in float (the output head).
    - ``kv_layers`` / ``q_layers``: the patterns of the key/value and query projections (Quark's template
      fields ``kv_layers_name`` and ``q_layer_name``).
    - ``gate_up_layers``: the gate and up projections of a gated MLP (``gate_up_layers_name``).
    - ``scaling``: the natural scaling groups of a block.
    - ``rotation``: where the blocks take Hadamard rotations (``None``: RotationConfig does not know the family).
    """

    name: str
    decoder_layers: str
    exclude: tuple[str, ...]
    kv_layers: tuple[str, ...]
    q_layers: tuple[str, ...]
    gate_up_layers: tuple[str, ...]
    scaling: tuple[ScalingCandidate, ...]
    rotation: RotationRoles | None = None


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

#: Llama, Mistral, Qwen2: pre-norm RMSNorm, gated MLP.
_LLAMA_SCALING = (
    ScalingCandidate("input_layernorm", _QKV, "self_attn"),
    ScalingCandidate("self_attn.v_proj", ("self_attn.o_proj",)),
    ScalingCandidate("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScalingCandidate("mlp.up_proj", ("mlp.down_proj",)),
)
#: OPT: pre-norm unless ``do_layer_norm_before=False`` (OPT-350m), ReLU MLP.
_OPT_SCALING = (
    ScalingCandidate("self_attn_layer_norm", _QKV, "self_attn", "pre_norm"),
    ScalingCandidate("self_attn.v_proj", ("self_attn.out_proj",)),
    ScalingCandidate("final_layer_norm", ("fc1",), None, "pre_norm"),
    ScalingCandidate("fc1", ("fc2",), None, "homogeneous:activation_fn"),
)
#: GPT-2: pre-norm LayerNorm, fused q/k/v Conv1D, GELU MLP.
_GPT2_SCALING = (
    ScalingCandidate("ln_1", ("attn.c_attn",), "attn"),
    ScalingCandidate("ln_2", ("mlp.c_fc",), "mlp"),
    ScalingCandidate("mlp.c_fc", ("mlp.c_proj",), None, "homogeneous:mlp.act"),
)
#: BERT: post-norm, so only the value/output pair is exact.
_BERT_SCALING = (
    ScalingCandidate("attention.self.value", ("attention.output.dense",)),
    ScalingCandidate("attention.output.LayerNorm", ("intermediate.dense",), None, "post_norm"),
    ScalingCandidate("intermediate.dense", ("output.dense",), None, "not_homogeneous"),
)

#: Pre-norm RMSNorm decoders: R1 folds through every norm, R2 into v/o, R4 on down_proj.
_LLAMA_ROTATION = RotationRoles("self_attn", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj",
                                (*_QKV, "mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"))
#: Post-norm BERT: R2 (v/o per head), R4 (online, on output.dense) and online R1 are exact; folded R1 is not.
_BERT_ROTATION = RotationRoles("attention.self", "attention.self.value", "attention.output.dense", "output.dense",
                               ("attention.self.query", "attention.self.key", "attention.self.value",
                                "intermediate.dense"),
                               no_r1="post-norm LayerNorm: the residual stream goes through each LayerNorm, whose "
                                     "mean subtraction and bias do not commute with a rotation")

#: Phi-3: fused q/k/v and gate/up projections. The norms fold into the fused layers exactly (their input is the
#: norm's output); v -> o and up -> down do not (v and up are slices of a fused layer's outputs).
_PHI3_SCALING = (
    ScalingCandidate("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
    ScalingCandidate("self_attn.qkv_proj", ("self_attn.o_proj",), None, "fused_v"),
    ScalingCandidate("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ScalingCandidate("mlp.gate_up_proj", ("mlp.down_proj",), None, "fused_up"),
)
#: Gemma 2 / 3: sandwich norms (the MLP reads pre_feedforward_layernorm); every norm multiplies by (1 + weight),
#: which the structure inference refuses to fold into (quark_brevitas.algorithms.structure), so v -> o (without
#: grouped-query attention) and up -> down are the exact groups.
_GEMMA_SCALING = (
    ScalingCandidate("input_layernorm", _QKV, "self_attn"),
    ScalingCandidate("self_attn.v_proj", ("self_attn.o_proj",)),
    ScalingCandidate("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScalingCandidate("mlp.up_proj", ("mlp.down_proj",)),
)

#: Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): only the attention groups. The MLP's norm also
#: feeds the router (and Qwen2-MoE's shared expert and its gate), so a scale folded into it would have to divide
#: every expert's and the router's inputs alike: not a group the inference offers.
_MOE_SCALING = _LLAMA_SCALING[:2]

_HEAD = ("lm_head",)
_KV = ("*k_proj", "*v_proj")
_GATE_UP = ("gate_proj", "up_proj")

#: The families, by Hugging Face ``model_type`` (what ``LLMTemplate.get`` takes), in inference order.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _LLAMA_SCALING, _LLAMA_ROTATION),
    "mistral": Family("mistral", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _LLAMA_SCALING, _LLAMA_ROTATION),
    "qwen2": Family("qwen2", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _LLAMA_SCALING, _LLAMA_ROTATION),
    "qwen3": Family("qwen3", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _LLAMA_SCALING, _LLAMA_ROTATION),
    "gemma2": Family("gemma2", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _GEMMA_SCALING),
    "gemma3_text": Family("gemma3_text", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _GEMMA_SCALING),
    "phi3": Family("phi3", "model.layers", _HEAD, (), ("*qkv_proj",), ("gate_up_proj",), _PHI3_SCALING),
    # MoE: experts unfused into Linear layers (quark_brevitas.model_parts.moe); routers stay in float (Mixtral's and the
    # Qwen MoEs' are not Linear layers; Qwen2-MoE's shared-expert gate is one, excluded like the head).
    "mixtral": Family("mixtral", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _MOE_SCALING),
    "qwen2_moe": Family("qwen2_moe", "model.layers", (*_HEAD, "*shared_expert_gate"), _KV, ("*q_proj",), _GATE_UP,
                        _MOE_SCALING),
    "qwen3_moe": Family("qwen3_moe", "model.layers", _HEAD, _KV, ("*q_proj",), _GATE_UP, _MOE_SCALING),
    "opt": Family("opt", "model.decoder.layers", _HEAD, _KV, ("*q_proj",), (), _OPT_SCALING),
    "gpt2": Family("gpt2", "transformer.h", _HEAD, ("*c_attn",), ("*c_attn",), (), _GPT2_SCALING),
    "bert": Family("bert", "encoder.layer", (), ("*attention.self.key", "*attention.self.value"),
                   ("*attention.self.query",), (), _BERT_SCALING, _BERT_ROTATION),
}

#: Where model families keep their blocks, then generic spellings of a stack (``decoder.layers``, ``layers``,
#: ``h``): the paths the block-stack finder tries, in order, for a model that is not a Hugging Face model.
BLOCK_STACK_PATHS: tuple[str, ...] = tuple(dict.fromkeys(
    [family.decoder_layers for family in FAMILIES.values()] + ["decoder.layers", "layers", "h"]))


def scaling_candidates() -> tuple[ScalingCandidate, ...]:
    """Every family's scaling groups, each once, in table order (the inference tries them all: a block has
    the module names of one family only)."""
    return tuple(dict.fromkeys(candidate for family in FAMILIES.values() for candidate in family.scaling))
