"""The current model families (issue 30): Qwen3, Gemma 2, Gemma 3, Phi-3 and Llama 3.x (rope scaling, tied
embeddings), each built from a tiny transformers config: its template, block-by-block quantization with the
algorithms (each runs or is refused with the reason), generation, and a compressed-tensors folder that
transformers reloads with our logits."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.families import FAMILIES, build_family  # noqa: E402
from helpers.llm_models import INT4_G32, logits, token_batches, weight_only_config  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.algorithms import describe_algorithms  # noqa: E402
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.config.algorithms import AWQConfig, GPTQConfig, SmoothQuantConfig  # noqa: E402
from quark_brevitas.config.rotation import RotationConfig  # noqa: E402
from quark_brevitas.config.rounding import AutoRoundConfig, QronosConfig  # noqa: E402
from quark_brevitas.config.template import LLMTemplate  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.export import export_safetensors  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

W8A8 = QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(is_dynamic=False))

#: What is refused for each family, and the reason's words (everything else runs).
REFUSED = {
    "phi3": {"rotation": "match no family RotationConfig knows"},
}
#: The scaling groups the structure inference keeps for each family (the others are listed with the reason).
GROUPS = {
    "qwen3": ["input_layernorm -> self_attn.q_proj", "post_attention_layernorm -> mlp.gate_proj", "mlp.up_proj"],
    "llama": ["input_layernorm -> self_attn.q_proj", "post_attention_layernorm -> mlp.gate_proj", "mlp.up_proj"],
    "phi3": ["input_layernorm -> self_attn.qkv_proj", "post_attention_layernorm -> mlp.gate_up_proj"],
    "gemma2": ["mlp.up_proj -> mlp.down_proj"],
    "gemma3_text": ["mlp.up_proj -> mlp.down_proj"],
}


def _algorithms() -> dict[str, Config]:
    return {"awq": weight_only_config(INT4_G32, AWQConfig()), "gptq": weight_only_config(INT4_G32, GPTQConfig()),
            "qronos": weight_only_config(INT4_G32, QronosConfig()),
            "autoround": weight_only_config(INT4_G32, AutoRoundConfig(iters=4, batch_size=2)),
            "smoothquant": Config(W8A8, pre_quant_opt_config=[], algo_config=[SmoothQuantConfig(alpha=0.5)],
                                  exclude=["lm_head"]),
            "rotation": Config(QLayerConfig(weight=INT4_G32), pre_quant_opt_config=[],
                               algo_config=[RotationConfig(r1=True, r2=True, r4=False)], exclude=["lm_head"])}


@pytest.mark.parametrize("family", FAMILIES)
def test_scaling_groups_fold_only_where_exact(family: str) -> None:
    described = "\n".join(describe_algorithms(weight_only_config(INT4_G32, AWQConfig()), build_family(family)))
    used = [line.strip() for line in described.splitlines() if "->" in line and "not used" not in line]
    assert [any(group in line for line in used) for group in GROUPS[family]] == [True] * len(GROUPS[family])
    assert len(used) == len(GROUPS[family]), used
    if family.startswith("gemma"):
        assert "input_layernorm multiplies by (1 + weight) (Gemma's RMSNorm)" in described
    if family == "phi3":
        assert "v is a slice of the fused qkv_proj" in described and "up is a slice of the fused gate_up" in described


def test_gemma_smoothquant_keeps_the_model_it_scales() -> None:
    """The regression the (1 + weight) check fixes: folding a scale into Gemma's norms changed the model (the
    norm's output was not divided, the next layers' weights were multiplied). SmoothQuant on int8 per-channel
    weights must stay as close to the float model as plain int8 weights are."""
    model = build_family("gemma2")
    weights = QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel))
    plain = ModelQuantizer(Config(weights, pre_quant_opt_config=[], exclude=["lm_head"])).quantize_model(model)
    smoothed = ModelQuantizer(Config(weights, pre_quant_opt_config=[], algo_config=[SmoothQuantConfig(alpha=0.5)],
                                     exclude=["lm_head"])).quantize_model(model, token_batches(2), blocks=True)
    tokens = token_batches(1, seed=4)[0]
    reference = logits(model, tokens)

    def error(quant: torch.nn.Module) -> float:
        return float((logits(quant, tokens) - reference).norm() / reference.norm())

    assert error(smoothed) < 2 * error(plain) + 1e-3, (error(smoothed), error(plain))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_algorithm_runs_or_is_refused_with_the_reason(family: str) -> None:
    model, batches = build_family(family), token_batches(2)
    tokens = token_batches(1, batch=1, length=16, seed=9)[0]
    reference = logits(model, tokens)
    for name, config in _algorithms().items():
        refused = REFUSED.get(family, {}).get(name)
        if refused is not None:
            with pytest.raises(ConfigError, match=refused):
                ModelQuantizer(config).quantize_model(model, batches, blocks=True)
            continue
        quant = ModelQuantizer(config).quantize_model(model, batches, blocks=True)
        error = float((logits(quant, tokens) - reference).norm() / reference.norm())
        assert error < 0.5, (family, name, error)


@pytest.mark.parametrize("family", FAMILIES)
def test_template_quantize_generate_export_reload(family: str, tmp_path: Path) -> None:
    """LLMTemplate.get(model_type) with AWQ, block by block; generation; compressed-tensors folder reloaded by
    transformers with our logits; the KV cache where the family has key/value projections."""
    model = build_family(family)
    template = LLMTemplate.get(model.config.model_type)
    kv = "fp8" if template.kv_layers_name else None
    config = template.get_config(scheme="int4_wo_32", algorithm="awq", kv_cache_scheme=kv)
    config.kv_cache_post_rope = True
    quant = ModelQuantizer(config).quantize_model(model, token_batches(2), blocks=True)
    prompt = token_batches(1, batch=1, length=6, seed=2)[0]
    out = quant.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    folder = export_safetensors(quant, tmp_path / family)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = token_batches(1, batch=1, length=16, seed=9)[0]
    from quark_brevitas.model_parts.kv_cache import kv_quantization_disabled

    with kv_quantization_disabled(quant):  # compressed-tensors 0.20 runs a float cache under transformers 5.24
        ours = logits(quant, tokens)
    assert torch.allclose(logits(loaded, tokens), ours, atol=1e-4)
