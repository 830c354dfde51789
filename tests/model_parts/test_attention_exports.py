"""Attention scales (issue 30, ``attention_scheme``) in the exported folders, read back from disk, and loaded by their
consumers in a fresh process without quark_brevitas.

- Quark format: ``softmax_quant_spec``, ``<attention>.prob_output_scale``, ``<q_proj>.output_scale`` (what Quark 0.13
  writes; vLLM maps them to ``prob_scale`` / ``q_scale``). amd-quark 0.13's ``import_model_from_safetensors`` computes
  our logits exactly once two of its own limits are worked around in the consumer, each the smallest change: on a
  machine without CUDA its probability quantizer is built on ``device="cuda"`` (``get_real_quantizer``'s default), and
  its key fix-up renames every ``*output_scale`` key, its own ``prob_output_scale`` included, to
  ``*output_quantizer.scale``, then finds ``prob_output_scale`` missing (so it cannot reload its own real_quantized
  attention exports). transformers' Quark loader (``from_pretrained``) applies the query scale but has no probability
  quantization: its logits are ours with the probability quantizer off.
- compressed-tensors: llm-compressor's attention group (``input_activations`` on the attention class) and
  ``<attention>.q_scale``; ``<attention>.prob_output_scale`` for vLLM. compressed-tensors 0.20 hooks only attention
  modules whose forward takes ``past_key_values`` (as for the KV cache, see test_kv_cache_consumers.py): under
  transformers 5.24 (``cache``) it applies neither the cache nor the query scales; taught the new keyword it applies
  both, and its logits are ours with the probability quantizer off (it has no probability quantization).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.consumer import quark_interpreter, run_consumer  # noqa: E402
from helpers.llm_models import logits, tiny_llama, token_batches  # noqa: E402
from model_parts.test_kv_cache_consumers import _CT_LOAD, _CT_TAUGHT_CACHE, SITE_PACKAGES  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import Config  # noqa: E402
from quark_brevitas.config.template import LLMTemplate  # noqa: E402
from quark_brevitas.export import ExportError, export_safetensors  # noqa: E402
from quark_brevitas.model_parts.attention import (  # noqa: E402
    attention_quantization_disabled,
    attention_scales,
    attentions,
)
from quark_brevitas.model_parts.kv_cache import kv_quantization_disabled  # noqa: E402


def _quantized(post_rope: bool) -> torch.nn.Module:
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")
    config.kv_cache_post_rope = post_rope
    return ModelQuantizer(config).quantize_model(tiny_llama(kv_heads=2), token_batches(2))


def _tokens() -> torch.Tensor:
    return token_batches(1, batch=2, length=16, seed=7)[0]


def _without_probabilities(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s logits with its probability quantizers off (query, cache and layers still quantized)."""
    quantizers = [attention.prob_quantizer for _, attention in attentions(model)]
    for quantizer in quantizers:
        quantizer.enabled = False
    try:
        return logits(model, tokens)
    finally:
        for quantizer in quantizers:
            quantizer.enabled = True


# ===================================================================== Quark format
@pytest.mark.parametrize("post_rope", [False, True])
def test_quark_folder_carries_the_attention_scales_as_quark_writes_them(tmp_path: Path, post_rope: bool) -> None:
    quant = _quantized(post_rope)
    folder = export_safetensors(quant, tmp_path / "quark", format="quark")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["softmax_quant_spec"]["dtype"] == "fp8_e4m3"
    assert quantization["softmax_quant_spec"]["qscheme"] == "per_tensor"
    assert quantization["softmax_quant_spec"]["is_dynamic"] is False
    tensors = load_file(folder / "model.safetensors")
    scales = attention_scales(quant)
    assert len(scales) == 2
    for entry in scales:
        assert torch.equal(tensors[f"{entry.attention}.prob_output_scale"], entry.prob.reshape(()))
        assert torch.equal(tensors[f"{entry.query_target}.output_scale"], entry.query.reshape(()))
        layer = quantization["layer_quant_config"][entry.query_target]
        assert layer["output_tensors"]["dtype"] == "fp8_e4m3" and layer["weight"]["dtype"] == "fp8_e4m3"
    # the file's recipe reads back as a config that quantizes attention again
    assert Config.from_dict(quantization).softmax_quant_spec is not None


_QUARK_IMPORT = """
    import functools
    from quark.torch import import_model_from_safetensors
    from quark.torch.export import api as quark_api, utils as quark_utils
    from transformers import AutoConfig

    # amd-quark 0.13 builds its probability quantizer on device="cuda" by default
    quark_utils.get_real_quantizer = functools.partial(quark_utils.get_real_quantizer, device=torch.device("cpu"))
    renaming = quark_api._fix_loaded_weights_key_mismatch

    def key_fix(weights, **kwargs):  # keep the prob_output_scale key its own state dict asks for
        weights = renaming(weights, **kwargs)
        for key in [k for k in weights if k.endswith(".prob_output_quantizer.scale")]:
            weights[key.replace(".prob_output_quantizer.scale", ".prob_output_scale")] = weights.pop(key)
        return weights

    quark_api._fix_loaded_weights_key_mismatch = key_fix
    for folder in sys.argv[3:]:
        loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            result["from_pretrained"] = loaded(tokens).logits.float()
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), attn_implementation="eager")
        imported = import_model_from_safetensors(model.eval(), folder).eval()
        result["prob_quantizer"] = hasattr(imported.model.layers[0].self_attn, "prob_quantizer")
        with torch.no_grad():
            result["import"] = imported(tokens).logits.float()
"""


@pytest.mark.slow
def test_amd_quark_computes_our_logits_with_quantized_queries_and_probabilities(tmp_path: Path) -> None:
    found = quark_interpreter()
    if found is None:
        pytest.skip("amd-quark is not importable (set QUARK_PYTHON to an interpreter with amd-quark==0.13)")
    quant = _quantized(post_rope=False)  # Quark quantizes the query and the cache on the projections' outputs
    folder = export_safetensors(quant, tmp_path / "quark", format="quark")
    tokens = _tokens()
    theirs = run_consumer(_QUARK_IMPORT, [folder], tokens, tmp_path, python=found[0], pythonpath=found[1],
                          timeout=1200)
    ours = logits(quant, tokens)
    assert theirs["prob_quantizer"] and torch.equal(theirs["import"], ours)
    assert torch.equal(theirs["from_pretrained"], _without_probabilities(quant, tokens))
    with attention_quantization_disabled(quant):
        assert not torch.allclose(theirs["import"], logits(quant, tokens), atol=1e-3)


# ===================================================================== compressed-tensors
def test_compressed_tensors_folder_carries_q_scale_and_the_attention_group(tmp_path: Path) -> None:
    ct = pytest.importorskip("compressed_tensors.quantization")
    with pytest.raises(ExportError, match="before RoPE"):
        export_safetensors(_quantized(post_rope=False), tmp_path / "pre")
    assert not (tmp_path / "pre").exists()
    quant = _quantized(post_rope=True)
    folder = export_safetensors(quant, tmp_path / "ct")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(quantization)
    group = parsed.config_groups["attention"]
    assert group.targets == ["LlamaAttention"] and group.weights is None
    assert group.input_activations.type == "float" and group.input_activations.strategy == "tensor"
    assert group.input_activations.dynamic is False
    tensors = load_file(folder / "model.safetensors")
    for entry in attention_scales(quant):
        assert torch.equal(tensors[f"{entry.attention}.q_scale"], entry.query.reshape(1))
        assert torch.equal(tensors[f"{entry.attention}.prob_output_scale"], entry.prob.reshape(()))
        assert f"{entry.query_target}.output_scale" not in tensors


@pytest.mark.slow
def test_transformers_applies_q_scale_where_compressed_tensors_hooks_the_attention(tmp_path: Path) -> None:
    quant = _quantized(post_rope=True)
    folder = export_safetensors(quant, tmp_path / "ct")
    tokens = _tokens()
    probe = "\n    result['q_hooked'] = hasattr(attention, 'impl') and hasattr(attention, 'q_scale')\n"
    plain = run_consumer(_CT_LOAD + probe, [folder], tokens, tmp_path, python=sys.executable,
                         pythonpath=SITE_PACKAGES)
    without_probabilities = _without_probabilities(quant, tokens)
    with attention_quantization_disabled(quant), kv_quantization_disabled(quant):
        float_attention = logits(quant, tokens)
    if not plain["hooked"]:  # transformers >= 5.24: compressed-tensors 0.20 leaves `cache` attention unhooked
        assert not plain["q_hooked"] and torch.allclose(plain["logits"], float_attention, atol=1e-5)
        taught = run_consumer(_CT_TAUGHT_CACHE + probe, [folder], tokens, tmp_path, python=sys.executable,
                              pythonpath=SITE_PACKAGES)
    else:
        taught = plain
    assert taught["q_hooked"] and torch.equal(taught["logits"], without_probabilities), taught["version"]
    assert not torch.allclose(without_probabilities, logits(quant, tokens), atol=1e-4)  # probabilities are felt
