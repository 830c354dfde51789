"""Mixture-of-experts decoders (issue 30): transformers 5.x's fused experts unfused into Linear layers exactly,
every expert's projections quantized with scales of their own, block by block, and the token routings per expert
logged."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.families import build_moe  # noqa: E402
from helpers.llm_models import INT4_G32, logits, token_batches, weight_only_config  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec, verify_config  # noqa: E402
from quark_brevitas.config.algorithms import GPTQConfig  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.model_parts.moe import UnfusedExperts, unfuse_experts  # noqa: E402


def _build(family: str) -> torch.nn.Module:
    return build_moe(family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_unfused_experts_compute_the_fused_output(family: str) -> None:
    model = _build(family)
    tokens = token_batches(1, seed=3)[0]
    reference = logits(model, tokens)
    unfused = copy.deepcopy(model)
    assert unfuse_experts(unfused) == 2
    experts = unfused.model.layers[0].mlp.experts
    assert isinstance(experts, UnfusedExperts) and len(experts) == 4
    assert torch.equal(experts[2].down_proj.weight, model.model.layers[0].mlp.experts.down_proj[2])
    # Qwen3-MoE's fused module computes gate and up in one product (float rounding apart, the same arithmetic).
    torch.testing.assert_close(logits(unfused, tokens), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_every_expert_is_quantized_block_by_block_and_coverage_is_logged(family: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    model = _build(family)
    unfuse_experts(model)
    # Routers stay in float (Mixtral's is not a Linear layer; Qwen2-MoE's shared-expert gate is, so it is excluded).
    exclude = ("lm_head", "*shared_expert_gate") if family == "qwen2_moe" else ("lm_head",)
    config = weight_only_config(INT4_G32, GPTQConfig(), exclude=exclude)
    with caplog.at_level(logging.INFO, logger="quark_brevitas.model_parts.moe"):
        quant = ModelQuantizer(config).quantize_model(model, token_batches(4), blocks=True)
    lines = [r.getMessage() for r in caplog.records if "token routings per expert" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for line in lines:  # one routing pass over the block's 4 x 16 x 8 calibration tokens, top-2
        assert ": 512 calibration tokens, token routings per expert" in line, line
        assert sum(eval(line.split("per expert ")[1].split(";")[0])) == 1024, line
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


class _RouterSkipping(torch.nn.Module):
    """Mixtral's router that never picks expert ``skip`` (its logit is -inf): routing leaves it unseen."""

    def __init__(self, router: torch.nn.Module, skip: int) -> None:
        super().__init__()
        self.router, self.skip = router, skip

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.router.hidden_dim), self.router.weight)
        logits[:, self.skip] = float("-inf")
        top, index = torch.topk(torch.softmax(logits.float(), dim=-1), self.router.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


def _mixtral_never_routing_to(skip: int) -> torch.nn.Module:
    model = _build("mixtral")
    for block in model.model.layers:
        block.mlp.gate = _RouterSkipping(block.mlp.gate, skip)
    unfuse_experts(model)
    return model


def _coverage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "token routings per expert" in r.getMessage()]


def test_all_expert_calibration_gives_an_unrouted_expert_gptq_weights(caplog: pytest.LogCaptureFixture) -> None:
    """Routing sends no token to expert 3: all-expert calibration feeds it every token of the block, so GPTQ
    finds its Hessians (without it GPTQ has none to work from) and its weights leave the round-to-nearest grid
    point GPTQ starts from; the coverage line says so. Routed outputs are unchanged: the quantized model's logits
    stay close to the float model's."""
    model = _mixtral_never_routing_to(3)
    batches = token_batches(4)
    tokens_per_block = sum(int(b.numel()) for b in batches)
    config = weight_only_config(INT4_G32, GPTQConfig(), exclude=("lm_head",))
    with caplog.at_level(logging.INFO, logger="quark_brevitas.model_parts.moe"):
        quant = ModelQuantizer(config).quantize_model(model, batches, blocks=True)
    lines = _coverage_lines(caplog)
    assert len(lines) == 2
    for line in lines:
        routed = eval(line.split("per expert ")[1].split(";")[0])  # the logged list of routings per expert
        assert routed[3] == 0 and sum(routed) == 2 * tokens_per_block, line  # top-2: two routings per token
        assert f": {tokens_per_block} calibration tokens," in line, line
        assert f"all-expert calibration fed experts [3] all {tokens_per_block} tokens (fewer than 1 routed)" \
            in line, line
    rtn = ModelQuantizer(weight_only_config(INT4_G32)).quantize_model(model)
    for block, rtn_block, float_block in zip(quant.model.layers, rtn.model.layers, model.model.layers, strict=True):
        for name in ("gate_proj", "up_proj", "down_proj"):
            gptq = getattr(block.mlp.experts[3], name).quant_weight().value
            nearest = getattr(rtn_block.mlp.experts[3], name).quant_weight().value
            assert not torch.equal(gptq, nearest), name  # GPTQ moved the unrouted expert's weights
            reference = getattr(float_block.mlp.experts[3], name).weight.detach()
            assert float((gptq.detach() - reference).norm() / reference.norm()) < 0.2
    tokens = token_batches(1, seed=3)[0]
    reference = logits(model, tokens)
    assert float((logits(quant, tokens) - reference).norm() / reference.norm()) < 0.3
    assert all(not block.mlp.experts.fill for block in quant.model.layers)  # inference routes as the model does


def test_all_expert_calibration_calibrates_an_unrouted_experts_input_range(caplog: pytest.LogCaptureFixture) -> None:
    """Static int8 inputs: the unrouted expert's input quantizer is calibrated on every token, so its range
    covers each routed expert's (each token reaches two of experts 0-2, expert 3 sees them all); turned off
    (``moe_calibrate_all_experts=False``) the warning names the expert left uncalibrated."""
    model = _mixtral_never_routing_to(3)
    spec = QuantizationConfig(weight=INT4_G32, input_tensors=QuantizationSpec(is_dynamic=False))
    config = Config(spec, pre_quant_opt_config=[], exclude=["lm_head"])
    quant = ModelQuantizer(config).quantize_model(model, token_batches(4), blocks=True)
    for block in quant.model.layers:
        scales = [float(expert.gate_proj.input_quant.scale()) for expert in block.mlp.experts]
        assert scales[3] >= max(scales[:3]) * 0.999, scales
        assert scales[3] == float(block.mlp.experts[3].up_proj.input_quant.scale())
    off = Config(spec, pre_quant_opt_config=[], exclude=["lm_head"], moe_calibrate_all_experts=False)
    with caplog.at_level(logging.INFO, logger="quark_brevitas.model_parts.moe"):
        ModelQuantizer(off).quantize_model(model, token_batches(4), blocks=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("experts [3] saw no calibration token" in w for w in warnings), warnings


@pytest.mark.parametrize(("field", "value"), [("moe_min_expert_tokens", 0), ("moe_min_expert_tokens", 1.5),
                                              ("moe_calibrate_all_experts", "yes")])
def test_moe_calibration_fields_are_checked(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        verify_config(Config(QuantizationConfig(weight=INT4_G32), **{field: value}))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_family_templates_quantize_generate_and_reload_from_compressed_tensors(family: str,
                                                                                   tmp_path: Path) -> None:
    """The family rows: ``LLMTemplate.get(model_type)`` keeps the head (and Qwen2-MoE's shared-expert gate, a
    router) in float; its int4 GPTQ config runs block by block on the unfused model, which then generates; its
    compressed-tensors folder (Mixtral's experts under its checkpoints' ``w1``/``w3``/``w2`` names) loads in
    transformers, in a fresh process that cannot import quark_brevitas, into the fused experts modules with our
    logits."""
    from helpers.consumer import MOE_LOGITS, run_consumer

    from quark_brevitas.config.template import LLMTemplate
    from quark_brevitas.export import export_safetensors

    model = _build(family)
    unfuse_experts(model)
    template = LLMTemplate.get(family)
    expected = ["lm_head", "*shared_expert_gate"] if family == "qwen2_moe" else ["lm_head"]
    assert template.exclude_layers_name == expected
    config = template.get_config(scheme="int4_wo_32", algorithm="gptq")
    quant = ModelQuantizer(config).quantize_model(model, token_batches(4), blocks=True)
    assert type(quant.model.layers[1].mlp.experts[3].up_proj).__name__ == "QuantLinear"
    prompt = token_batches(1, batch=1, length=8, seed=5)[0]
    with torch.no_grad():
        out = quant.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 14)
    folder = export_safetensors(quant, tmp_path / family)
    tokens = token_batches(1, batch=1, length=16, seed=9)[0]
    site_packages = str(Path(transformers.__file__).resolve().parents[1])
    theirs = run_consumer(MOE_LOGITS, [folder], tokens, tmp_path, python=sys.executable, pythonpath=site_packages)
    assert theirs["experts"].endswith("Experts")  # transformers' fused module, filled from the per-expert tensors
    ours = logits(quant, tokens)
    torch.testing.assert_close(theirs["logits"], ours, rtol=0, atol=1e-5)
    assert float((ours - logits(model, tokens)).abs().max()) > 1e-3  # the quantization is felt in the logits
