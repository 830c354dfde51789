"""Tests of quark_brevitas.export.export_gguf: GGUF files written from our integer codes, read back by the gguf
package and by transformers' GGUF loader.

Done-when checks: for every GGUF type written (Q8_0, Q4_0, Q4_1) the gguf package dequantizes every quantized
tensor to exactly the quantized model's weight (max abs difference 0); the model transformers loads from the file
computes the quantized model's logits (so its perplexity too) on Llama and Qwen2 built from configs; what GGUF
cannot hold is one ExportError naming the layer and the GGUF types that fit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers.llm_models import VOCAB, bpe_tokenizer, tiny_gpt2, tiny_llama, tiny_opt, token_batches  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.export import ExportError, export_gguf  # noqa: E402
from quark_brevitas.outputs import OutputError  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType, ScaleType  # noqa: E402

TYPES = {"gguf_q4_0": "Q4_0", "gguf_q4_1": "Q4_1", "gguf_q8_0": "Q8_0"}


def tiny_qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval()


def _quantize(model: torch.nn.Module, config: Config) -> torch.nn.Module:
    return ModelQuantizer(config).quantize_model(model, token_batches(1))


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of Q/K (as transformers' GGUF loader does)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _perplexity(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.exp(model(tokens, labels=tokens).loss))


@pytest.mark.parametrize("preset", sorted(TYPES))
def test_every_quantized_tensor_dequantizes_exactly(preset: str, tmp_path: Path) -> None:
    quant = _quantize(tiny_llama(), get_preset(preset))
    path = export_gguf(quant, tmp_path / "out")
    assert path == tmp_path / "out" / "model.gguf"
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    layers = {n: m for n, m in quant.named_modules() if hasattr(m, "quant_weight")}
    assert len(layers) == 15  # 7 Linear layers per block, lm_head
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, layer in layers.items():
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == TYPES[preset]
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj" in name or ".k_proj" in name:
            decoded = _unpermute(decoded, 4)  # tiny_llama: 4 heads, 4 key/value heads
        expected = layer.quant_weight().value.detach().numpy()
        assert decoded.shape == expected.shape
        assert np.abs(decoded - expected).max() == 0.0
    assert tensors["token_embd.weight"].tensor_type.name == "F32"


@pytest.mark.parametrize("preset", sorted(TYPES))
def test_transformers_loads_llama_with_the_quantized_models_logits(preset: str, tmp_path: Path) -> None:
    quant = _quantize(tiny_llama(kv_heads=2), get_preset(preset))
    export_gguf(quant, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        ours, theirs = quant(tokens).logits, loaded(tokens).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)
    assert abs(_perplexity(loaded, tokens) / _perplexity(quant, tokens) - 1) < 1e-3


def test_transformers_loads_qwen2_with_the_quantized_models_logits(tmp_path: Path) -> None:
    quant = _quantize(tiny_qwen2(), get_preset("gguf_q4_1"))
    export_gguf(quant, tmp_path / "out")  # model_type inferred: qwen2 (biases on q/k/v, no permutation)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-5, rtol=0)
    assert abs(_perplexity(loaded, tokens) / _perplexity(quant, tokens) - 1) < 1e-3


@pytest.mark.slow
def test_gptq_q4_0_is_written_exactly(tmp_path: Path) -> None:
    config = get_preset("gguf_q4_0")
    config.algo_config = [algos.GPTQ()]
    quant = _quantize(tiny_llama(), config)
    path = export_gguf(quant, tmp_path / "out", model_type="llama")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    decoded = gguf.quants.dequantize(tensors["blk.1.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q4_0)
    assert np.abs(decoded - quant.model.layers[1].mlp.down_proj.quant_weight().value.detach().numpy()).max() == 0.0


def _weight_only(spec: QTensorConfig) -> Config:
    return Config(QLayerConfig(), layer_type_quant_config={torch.nn.Linear: QLayerConfig(weight=spec)},
                  pre_quant_opt_config=[])


G = QSchemeType.per_group
F16 = ScaleType.float16


@pytest.mark.parametrize("spec, found", [
    (QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_channel), "int4 symmetric weights per channel"),
    (QTensorConfig(dtype=Dtype.int4, qscheme=G, group_size=128, scale_type=F16, pad_groups=True),  # 64 wide
     "per group of 128"),
    (QTensorConfig(qscheme=G, group_size=32, scale_type=F16, bit_width=3), "int3"),
    (QTensorConfig(dtype=Dtype.uint8, qscheme=G, group_size=32, scale_type=F16), "uint8 asymmetric"),
])
def test_weights_gguf_cannot_hold_are_refused_with_what_fits(spec: QTensorConfig, found: str, tmp_path: Path) -> None:
    quant = ModelQuantizer(_weight_only(spec)).quantize_model(tiny_llama())
    with pytest.raises(ExportError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj'.*" + found) as info:
        export_gguf(quant, tmp_path / "out")
    assert "Q4_0" in str(info.value) and "Q4_1" in str(info.value) and "Q8_0" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_scales_that_are_not_float16_are_refused(tmp_path: Path) -> None:
    spec = QTensorConfig(dtype=Dtype.int4, qscheme=G, group_size=32)  # float32 scales
    quant = ModelQuantizer(_weight_only(spec)).quantize_model(tiny_llama())
    with pytest.raises(ExportError, match=r"'model\.layers\.0\.self_attn\.q_proj'.*scale_type=float16"):
        export_gguf(quant, tmp_path / "out")


def test_quantized_activations_are_refused(tmp_path: Path) -> None:
    quant = _quantize(tiny_llama(), get_preset("w8a8"))
    with pytest.raises(ExportError, match="input_quant.*weight-only"):
        export_gguf(quant, tmp_path / "out")


def test_unsupported_family_is_refused(tmp_path: Path) -> None:
    quant = ModelQuantizer(get_preset("gguf_q4_0")).quantize_model(tiny_opt())
    with pytest.raises(ExportError, match="'opt'.*llama, mistral, qwen2"):
        export_gguf(quant, tmp_path / "out")


def test_foreign_output_folder_is_never_overwritten(tmp_path: Path) -> None:
    quant = ModelQuantizer(get_preset("gguf_q8_0")).quantize_model(tiny_llama())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError):
        export_gguf(quant, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_float16_scales_are_for_integer_weights_only() -> None:
    spec = QTensorConfig(scale_type=F16)
    with pytest.raises(ConfigError, match="scale_type.*float16"):
        ModelQuantizer(Config(QLayerConfig(weight=QTensorConfig(), input_tensors=spec)))


def _bpe_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerFast:
    return bpe_tokenizer(folder)


@pytest.mark.slow
def test_tokenizer_is_written_and_read_back(tmp_path: Path) -> None:
    fast = _bpe_tokenizer(tmp_path / "tok")
    quant = ModelQuantizer(get_preset("gguf_q8_0")).quantize_model(tiny_llama())
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    fields = gguf.GGUFReader(str(path)).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0]) == fast.bos_token_id
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    text = "the lazy fox jumps"
    assert loaded(text)["input_ids"][-len(fast(text)["input_ids"]):] == fast(text)["input_ids"]


def test_token_list_is_padded_to_the_embedding_rows(tmp_path: Path) -> None:
    """llama.cpp sizes the embedding from the token list and refused our file when the tokenizer had fewer tokens
    than the model's vocab_size (the test tokenizer: 61 of 128; Qwen2: 151,665 of 151,936): unused ids are written
    as ``[PAD<id>]`` tokens of type UNUSED, as llama.cpp's converter does; more tokens than rows is refused."""
    fast = _bpe_tokenizer(tmp_path / "tok")
    assert len(fast) < VOCAB
    quant = ModelQuantizer(get_preset("gguf_q8_0")).quantize_model(tiny_llama())
    fields = gguf.GGUFReader(str(export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok"))).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    assert len(tokens) == len(types) == VOCAB
    assert tokens[len(fast):] == [f"[PAD{i}]" for i in range(len(fast), VOCAB)]
    unused = int(gguf.TokenType.UNUSED)
    assert set(types[len(fast):]) == {unused} and unused not in types[:len(fast)]
    small = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4)
    narrow = ModelQuantizer(get_preset("gguf_q8_0")).quantize_model(transformers.LlamaForCausalLM(small).eval())
    with pytest.raises(ExportError, match=r"embedding \(32 rows, config.vocab_size\) does not have: 32 "):
        export_gguf(narrow, tmp_path / "narrow", tokenizer_path=tmp_path / "tok")


# ===================================================================== GPT-2 and tied heads
def _gpt2_config(exclude: list[str] | None = None) -> Config:
    """The gguf_q4_0 preset's layer config for GPT-2's Conv1D projections too (the preset covers nn.Linear only)."""
    layer = get_preset("gguf_q4_0").layer_type_quant_config["Linear"]
    return Config(QLayerConfig(), layer_type_quant_config={"Linear": layer, "Conv1D": layer}, pre_quant_opt_config=[],
                  exclude=exclude or [])


def test_gpt2_is_written_exactly_and_transformers_loads_it(tmp_path: Path) -> None:
    """GPT-2 (Conv1D weights stored [in, out]; the head tied to the embedding): every quantized tensor dequantizes to
    the quantized weight, a float Conv1D is written transposed, and transformers computes our logits."""
    fast = _bpe_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(fast), n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                     bos_token_id=0, eos_token_id=1)  # transformers' loader assumes 1024 positions
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    batches = [torch.randint(0, len(fast), (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    quant = ModelQuantizer(_gpt2_config(exclude=["transformer.h.1.mlp.c_proj"])).quantize_model(model, batches[:1])
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, 2)
    layers = {n: m for n, m in quant.named_modules() if hasattr(m, "quant_weight") and m.weight_quant.is_quant_enabled}
    assert len(layers) == 8  # 4 Conv1D per block, one kept float, and the head
    for name, layer in layers.items():
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == "Q4_0", name
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.abs(decoded - layer.quant_weight().value.detach().numpy()).max() == 0.0, name
    float_down = tensors["blk.1.ffn_down.weight"]
    assert float_down.tensor_type.name == "F32"
    assert np.array_equal(gguf.quants.dequantize(float_down.data, float_down.tensor_type),
                          quant.transformer.h[1].mlp.c_proj.weight.detach().numpy().T)  # [out, in], as llama.cpp
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        assert torch.allclose(loaded(batches[1]).logits, quant(batches[1]).logits, atol=1e-5, rtol=0)
    assert abs(_perplexity(loaded, batches[1]) / _perplexity(quant, batches[1]) - 1) < 1e-3


def test_gpt2_whose_conv1d_layers_stay_float_is_refused(tmp_path: Path) -> None:
    quant = ModelQuantizer(get_preset("gguf_q4_0")).quantize_model(tiny_gpt2())  # nn.Linear only: the head
    with pytest.raises(ExportError, match=r"GPT-2's Conv1D projections \(transformer\.h\.0\.attn\.c_attn.*not "
                                          r"quantized.*\"Conv1D\": layer"):
        export_gguf(quant, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_head_tied_to_the_embedding_is_written_with_its_quantized_weight(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    quant = _quantize(model, get_preset("gguf_q8_0"))
    export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "out" / "model.gguf")).tensors}
    assert tensors["output.weight"].tensor_type.name == "Q8_0"
    assert tensors["token_embd.weight"].tensor_type.name == "F32"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-5, rtol=0)


# ===================================================================== K-quants
def _wide_llama() -> torch.nn.Module:
    """Q6_K super-blocks are 256 input channels: a Llama whose every Linear input is a multiple of 256."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


INT6_G16 = {"qscheme": G, "group_size": 16, "bit_width": 6}


@pytest.mark.slow
def test_int6_weights_with_power_of_two_scales_are_written_as_q6_k_exactly(tmp_path: Path) -> None:
    quant = ModelQuantizer(_weight_only(QTensorConfig(**INT6_G16, scale_type=ScaleType.pof2))).quantize_model(
        _wide_llama())
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    layers = {n: m for n, m in quant.named_modules() if hasattr(m, "quant_weight")}
    assert len(layers) == 8  # 7 Linear layers and lm_head
    for name, layer in layers.items():
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == "Q6_K"
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj" in name or ".k_proj" in name:
            decoded = _unpermute(decoded, 4 if ".q_proj" in name else 2)
        expected = layer.quant_weight().value.detach().numpy()
        assert np.abs(decoded - expected).max() == 0.0, name
        assert len(np.unique(np.abs(expected))) > 32  # several scales per row: the sub-block scales are used
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-5, rtol=0)


def test_q6_k_refuses_scales_without_a_common_float16_factor(tmp_path: Path) -> None:
    quant = ModelQuantizer(_weight_only(QTensorConfig(**INT6_G16))).quantize_model(_wide_llama())  # float32 scales
    with pytest.raises(ExportError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj': the 16 scales of row 0, "
                                          r"input channels 0\.\.255 are not integer multiples.*scale_type=pof2"):
        export_gguf(quant, tmp_path / "out")


# ===================================================================== from a streamed checkpoint
def test_streamed_checkpoint_gives_the_in_memory_files_tensors(tmp_path: Path) -> None:
    """Written block by block without the float model (its folder is deleted first), the file holds exactly the
    tensors export_gguf writes for the loaded quantized model (names, GGUF types, bytes)."""
    import shutil

    from quark_brevitas.hf.export_streamed import export_gguf_streamed
    from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained

    float_dir = tmp_path / "float"
    tiny_llama(kv_heads=2).save_pretrained(float_dir)
    checkpoint = quantize_pretrained(float_dir, get_preset("gguf_q4_1"), [{"input_ids": t} for t in token_batches(1)],
                                     tmp_path / "ckpt")
    shutil.rmtree(float_dir)
    streamed = export_gguf_streamed(checkpoint, tmp_path / "streamed")
    whole = export_gguf(load_pretrained_quantized(checkpoint), tmp_path / "whole")
    written = {t.name: t for t in gguf.GGUFReader(str(streamed)).tensors}
    expected = {t.name: t for t in gguf.GGUFReader(str(whole)).tensors}
    assert written.keys() == expected.keys() and len(written) == 2 * 9 + 3  # 9 per block; embeddings, norm, output
    for name, tensor in expected.items():
        assert written[name].tensor_type == tensor.tensor_type
        assert np.array_equal(np.asarray(written[name].data), np.asarray(tensor.data)), name
    assert sum(t.tensor_type.name == "Q4_1" for t in written.values()) == 15
    assert not list(tmp_path.glob(".streamed.blocks-*"))  # the spilled blocks are gone


# ===================================================================== optional: llama.cpp itself
@pytest.mark.parametrize("preset", sorted(TYPES))
def test_llama_cpp_loads_our_file_and_computes_the_quantized_model(preset: str, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, the optional extra [llamacpp]) reads the file, tokenizer included, and its logits
    follow the quantized model's: not bit for bit, because llama.cpp's quantized products also quantize the
    activations (8 bits per block of 32), so the check is the relative error and the predicted tokens."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    _bpe_tokenizer(tmp_path / "tok")
    quant = _quantize(tiny_llama(kv_heads=2), get_preset(preset))
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    tokens = token_batches(1, seed=3)[0][0]
    runner = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens), logits_all=True, n_threads=1, verbose=False)
    runner.eval(tokens.tolist())
    theirs = torch.tensor(np.asarray(runner.scores[:len(tokens)]), dtype=torch.float32)
    with torch.no_grad():
        ours, float_logits = quant(tokens[None]).logits[0], tiny_llama(kv_heads=2)(tokens[None]).logits[0]
    error, float_error = (float((logits - ours).norm() / ours.norm()) for logits in (theirs, float_logits))
    assert error < 0.05, error  # tiny_llama's outlier channels make llama.cpp's 8-bit activations cost ~2 %
    if preset != "gguf_q8_0":  # 4-bit weights: far closer to ours than the float model is (Q8_0 is near float)
        assert error < 0.25 * float_error, (error, float_error)
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) >= 0.9
