"""GGUF files of issue 30's families (Qwen3, Gemma 2, Gemma 3, Phi-3, Llama 3.x), with the architecture metadata
llama.cpp's converter writes for them (quark_brevitas.export.gguf.families): transformers' GGUF loader and
llama.cpp (where llama-cpp-python is installed) load them with the quantized model's logits."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers.families import FAMILIES, build_family  # noqa: E402
from helpers.llama_cpp_runs import llama_cpp_logits  # noqa: E402
from helpers.llm_models import bpe_tokenizer, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import ExportError, export_gguf  # noqa: E402
from quark_brevitas.export.gguf.families import rope_freqs, rope_theta  # noqa: E402

ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "llama": "llama"}


def _quantize(family: str, exclude_head: bool = True, head_dim: int = 16, query_scalar: int | None = None
              ) -> torch.nn.Module:
    config = get_preset("gguf_q4_0")
    if exclude_head:
        config.exclude = ["lm_head"]
    return ModelQuantizer(config).quantize_model(build_family(family, head_dim, query_scalar))


def _fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_metadata_is_llama_cpps(family: str, tmp_path: Path) -> None:
    quant = _quantize(family)
    path = export_gguf(quant, tmp_path / "out")
    fields, arch, config = _fields(path), ARCH[family], quant.config
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.attention.head_count_kv"] == 2 and fields[f"{arch}.block_count"] == 2
    if family in ("qwen3", "gemma2", "gemma3_text"):
        assert fields[f"{arch}.attention.key_length"] == fields[f"{arch}.attention.value_length"] == 16
    if family == "gemma2":
        assert fields["gemma2.attn_logit_softcapping"] == pytest.approx(config.attn_logit_softcapping)
        assert fields["gemma2.final_logit_softcapping"] == pytest.approx(config.final_logit_softcapping)
    if family.startswith("gemma"):
        assert fields[f"{arch}.attention.sliding_window"] == config.sliding_window
        tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
        norm = quant.model.layers[0].input_layernorm.weight.detach().numpy()
        assert np.array_equal(tensors["blk.0.attn_norm.weight"], norm + np.float32(1))  # llama.cpp's 1 + weight
    if family == "gemma3_text":  # the full attention's base, not the sliding window's
        assert fields["gemma3.rope.freq_base"] == pytest.approx(
            config.rope_parameters["full_attention"]["rope_theta"])
    if family == "phi3":
        assert fields["phi3.rope.scaling.original_context_length"] == config.original_max_position_embeddings
    if family == "llama":  # Llama 3.x: the llama3 rope factors as llama.cpp's rope_freqs tensor
        tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
        factors = tensors["rope_freqs.weight"]
        assert np.array_equal(factors, rope_freqs(config, "llama"))
        assert factors[0] == 1.0 and factors[-1] == 8.0 and factors.shape == (8,)


def test_llama3_rope_factors_follow_the_wavelengths() -> None:
    """rope_freqs against the formula computed here: 1 for wavelengths under original/high_freq_factor, factor
    over original/low_freq_factor, the smooth interpolation in between."""
    config = build_family("llama").config
    base, dim, context = 10000.0, 16, 32.0
    expected = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * base ** (i / dim)
        if wavelen < context / 4:
            expected.append(1.0)
        elif wavelen > context:
            expected.append(8.0)
        else:
            smooth = (context / wavelen - 1) / 3
            expected.append(1 / ((1 - smooth) / 8 + smooth))
    assert np.allclose(rope_freqs(config, "llama"), expected, rtol=1e-5)
    assert rope_freqs(build_family("qwen3").config, "qwen3") is None


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_transformers_loads_the_family_with_the_quantized_models_logits(family: str, tmp_path: Path) -> None:
    """transformers' GGUF loader rebuilds the family (Gemma's norms shifted back) with our logits. (It drops Llama
    3.x's rope_freqs, so that family's consumer is llama.cpp: below. Its qwen3 mapping reads no key_length, so
    the head size is Qwen3Config's default, 128, here, and none of Gemma's query_pre_attn_scalar, so it is the
    default, 256, here; Phi-3 takes its pad id from the file's tokenizer.)"""
    quant = _quantize(family, head_dim=128 if family == "qwen3" else 16,
                      query_scalar=256 if family.startswith("gemma") else None)
    bpe_tokenizer(tmp_path / "tok", pad=True)
    export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    assert loaded.config.model_type == quant.config.model_type
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-4, rtol=0)


def test_gemma2_refuses_a_quantized_head_it_has_no_tensor_for(tmp_path: Path) -> None:
    """llama.cpp's gemma2 architecture has no output tensor (the head is the embedding): a quantized head is
    refused by name; a float tied head is left to token_embd (above)."""
    with pytest.raises(ExportError, match="lm_head.*gemma2"):
        export_gguf(_quantize("gemma2", exclude_head=False), tmp_path / "out")


#: llama.cpp's Phi-3 vocabulary loader fails on the byte-level BPE tokenizer of these tests ("unordered_map::at";
#: Phi-3's own tokenizer is SentencePiece, which export_gguf does not write), so Phi-3 is checked by transformers only.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phi3"])
def test_llama_cpp_computes_the_quantized_family(family: str, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, optional) runs each family's file with the quantized model's logits, up to its
    8-bit activations in quantized products; for Llama 3.x this checks the rope_freqs tensor (without it, llama.cpp
    computes the unscaled RoPE)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    quant = _quantize(family)
    theirs, tokens = llama_cpp_logits(llama_cpp, quant, tmp_path)
    with torch.no_grad():
        ours = quant(tokens[None]).logits[0]
    error = float((theirs - ours).norm() / ours.norm())
    assert error < 0.05, (family, error)
    if family == "llama":  # llama.cpp follows the scaled RoPE, not the plain one (a file without rope_freqs does)
        with torch.no_grad(), _unscaled_rope(quant):
            unscaled = quant(tokens[None]).logits[0]
        assert error < 0.8 * float((theirs - unscaled).norm() / unscaled.norm())


@contextlib.contextmanager
def _unscaled_rope(model: torch.nn.Module) -> Iterator[None]:
    """``model`` (a Llama) with plain RoPE in place of its llama3-scaled one."""
    scaled = model.model.rotary_emb
    config = copy.deepcopy(model.config)
    config.rope_scaling = None
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta(model.config, "llama", 10000.0)}
    model.model.rotary_emb = type(scaled)(config)
    try:
        yield
    finally:
        model.model.rotary_emb = scaled
