"""Quark 0.13's documented LLM flow, with only the imports changed: template -> quantize -> evaluate -> export.

Quark 0.13's LLM PTQ example (``quark-cli torch-llm-ptq``) does ``template = LLMTemplate.get(model_type)``,
``quant_config = template.get_config(scheme=..., algorithm=..., exclude_layers=...)``,
``model = ModelQuantizer(quant_config).quantize_model(model, calib_dataloader)``, evaluates perplexity and exports.
Here the models are tiny (64 wide) Llama, Qwen2 and OPT built from transformers configs, so the group size is 32
(``int4_wo_32``; 128 does not divide the MLP inputs of every family), and the export is ONNX QCDQ (verified
against the PyTorch model by the exporter; its example input carries an attention mask, as Hugging Face's
tokenizers give it). The template's result also equals the same recipe written by hand
in the reference's style (explicit scaling layers and decoder layers), so the template changes nothing but
the typing.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.llm_models import LLAMA_SCALING_LAYERS, VOCAB, logits, tiny_llama, tiny_opt, token_batches, with_outliers  # noqa: E402

from quark_brevitas import LLMTemplate, ModelExporter, ModelQuantizer  # noqa: E402  # was: from quark.torch import ...
from quark_brevitas.config import (  # noqa: E402
    AWQConfig,
    Config,
    GPTQConfig,
    QLayerConfig,
    QTensorConfig,
    SmoothQuantConfig,
)
from quark_brevitas.export import run_onnx  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ScaleType  # noqa: E402


def tiny_qwen2(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    return with_outliers(transformers.Qwen2ForCausalLM(config).eval())


def perplexity(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """exp(mean next-token cross entropy) over ``batches`` (Quark's ppl_eval, on token batches)."""
    losses = []
    for tokens in batches:
        predicted = logits(model, tokens)[:, :-1].reshape(-1, VOCAB)
        losses.append(torch.nn.functional.cross_entropy(predicted, tokens[:, 1:].reshape(-1)))
    return math.exp(float(torch.stack(losses).mean()))


FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "opt": tiny_opt}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_quark_013_llm_flow_template_quantize_evaluate_export(model_type: str, tmp_path: Path) -> None:
    model = FAMILIES[model_type]()
    reference = copy.deepcopy(model)
    calib_dataloader = token_batches(count=2, batch=2, length=16)
    held_out = token_batches(count=2, batch=2, length=16, seed=1)

    # ---------------------------------------------------------------- Quark 0.13 example code from here on
    template = LLMTemplate.get(model.config.model_type)
    quant_config = template.get_config(scheme="int4_wo_32", algorithm="awq", exclude_layers=["lm_head"])
    quantizer = ModelQuantizer(quant_config)
    model = quantizer.quantize_model(model, calib_dataloader)
    ppl = perplexity(model, held_out)
    example = {"input_ids": held_out[0], "attention_mask": torch.ones_like(held_out[0])}
    report = ModelExporter(tmp_path / f"{model_type}.onnx").export_onnx_model(model, example)
    # ---------------------------------------------------------------- checks

    float_ppl = perplexity(reference, held_out)
    assert abs(ppl - float_ppl) / float_ppl < 0.02, (ppl, float_ppl)
    assert ppl != float_ppl  # the weights are quantized
    assert type(model.get_submodule("lm_head")) is torch.nn.Linear  # excluded
    onnx_logits = torch.from_numpy(run_onnx(report.path, example)[0])
    assert torch.allclose(onnx_logits, logits(model, held_out[0]), atol=1e-3, rtol=1e-3)


OPT_SCALING_LAYERS = [
    {"prev_op": "self_attn_layer_norm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
     "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.out_proj"], "inp": "self_attn.out_proj"},
    {"prev_op": "final_layer_norm", "layers": ["fc1"], "inp": "fc1"},
    {"prev_op": "fc1", "layers": ["fc2"], "inp": "fc2"},
]
#: model type -> (the reference's scaling layers, its decoder layers), spelled out.
BY_HAND = {"llama": (LLAMA_SCALING_LAYERS, "model.layers"), "qwen2": (LLAMA_SCALING_LAYERS, "model.layers"),
           "opt": (OPT_SCALING_LAYERS, "model.decoder.layers")}


def by_hand(model_type: str, algorithm: str | list[str]) -> Config:
    """The template's recipe written in the reference's style (reference 002): explicit specs, restated
    bit/sym/group_size, explicit scaling and decoder layers, SmoothQuant in pre_quant_opt_config."""
    scaling, decoder_layers = BY_HAND[model_type]
    spec = QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, symmetric=True, scale_type=ScaleType.float,
                         round_method=RoundType.half_even, ch_axis=1, is_dynamic=False, group_size=32)
    pre_quant = [SmoothQuantConfig(alpha=1.0, scaling_layers=scaling, model_decoder_layers=decoder_layers)] \
        if "smoothquant" in algorithm else []
    algos = {"awq": AWQConfig(bit=4, sym=True, group_size=32, scaling_layers=scaling,
                              model_decoder_layers=decoder_layers),
             "gptq": GPTQConfig(bit=4, sym=True, group_size=32, damp_percent=0.01, desc_act=True, static_groups=True,
                                model_decoder_layers=decoder_layers)}
    names = [algorithm] if isinstance(algorithm, str) else algorithm
    return Config(global_quant_config=QLayerConfig(weight=spec), pre_quant_opt_config=pre_quant,
                  algo_config=[algos[name] for name in names if name in algos], exclude=["lm_head"])


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "algorithm"), [("llama", "awq"), ("qwen2", "awq"), ("opt", "awq"),
                                                       ("opt", ["smoothquant", "gptq"]),
                                                       ("llama", ["smoothquant", "gptq"])])
def test_the_template_equals_the_recipe_written_in_the_references_style(model_type: str,
                                                                        algorithm: str | list[str]) -> None:
    """LLMTemplate's int4_wo_32 with AWQ, or SmoothQuant then GPTQ (Quark 0.13's style: every algorithm in
    algo_config, fields left None, ch_axis=-1), gives the same model as the recipe spelled out the reference's way."""
    batches = token_batches(count=2, batch=2, length=16)
    from_template = LLMTemplate.get(model_type).get_config(scheme="int4_wo_32", algorithm=algorithm,
                                                           exclude_layers=["lm_head"])
    one = ModelQuantizer(from_template).quantize_model(FAMILIES[model_type](), batches)
    two = ModelQuantizer(by_hand(model_type, algorithm)).quantize_model(FAMILIES[model_type](), batches)
    for tokens in batches:
        assert torch.equal(logits(one, tokens), logits(two, tokens))
    assert not torch.equal(logits(one, batches[0]), logits(FAMILIES[model_type](), batches[0]))  # quantized
