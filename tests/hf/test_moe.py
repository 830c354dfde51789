"""Mixture-of-experts decoders (issue 30): transformers 5.x's fused experts unfused into Linear layers exactly,
every expert's projections quantized with scales of their own, block by block, and the token routings per expert
logged."""

from __future__ import annotations

import copy
import logging

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.llm_models import INT4_G32, logits, token_batches, weight_only_config  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config.algorithms import GPTQConfig  # noqa: E402
from quark_brevitas.hf.moe import UnfusedExperts, unfuse_experts  # noqa: E402

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, max_position_embeddings=64)


def _build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**_COMMON, intermediate_size=128, num_local_experts=4)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.Qwen2MoeConfig(**_COMMON, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4)
    return transformers.Qwen2MoeForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_unfused_experts_compute_the_fused_output(family: str) -> None:
    model = _build(family)
    tokens = token_batches(1, seed=3)[0]
    reference = logits(model, tokens)
    unfused = copy.deepcopy(model)
    assert unfuse_experts(unfused) == 2
    experts = unfused.model.layers[0].mlp.experts
    assert isinstance(experts, UnfusedExperts) and len(experts) == 4
    assert torch.equal(experts[2].down_proj.weight, model.model.layers[0].mlp.experts.down_proj[2])
    assert torch.equal(logits(unfused, tokens), reference)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_every_expert_is_quantized_block_by_block_and_coverage_is_logged(family: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    model = _build(family)
    unfuse_experts(model)
    # Routers stay in float (Mixtral's is not a Linear layer; Qwen2-MoE's shared-expert gate is, so it is excluded).
    exclude = ("lm_head", "*shared_expert_gate") if family == "qwen2_moe" else ("lm_head",)
    config = weight_only_config(INT4_G32, GPTQConfig(), exclude=exclude)
    with caplog.at_level(logging.INFO, logger="quark_brevitas.hf.moe"):
        quant = ModelQuantizer(config).quantize_model(model, token_batches(4), blocks=True)
    lines = [r.getMessage() for r in caplog.records if "token routings per expert" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for block in quant.model.layers:
        scales = []
        for expert in block.mlp.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                layer = getattr(expert, name)
                assert type(layer).__name__ == "QuantLinear", (name, type(layer))
            scales.append(expert.down_proj.quant_weight().scale.detach().flatten())
        assert all(not torch.equal(scales[0], other) for other in scales[1:])  # each expert has its own scales
        assert type(block.mlp.gate).__name__.endswith("Router")
        if family == "qwen2_moe":
            assert type(block.mlp.shared_expert_gate) is torch.nn.Linear
            assert type(block.mlp.shared_expert.down_proj).__name__ == "QuantLinear"
    tokens = token_batches(1, seed=3)[0]
    reference = logits(model, tokens)
    assert float((logits(quant, tokens) - reference).norm() / reference.norm()) < 0.3
