"""GGUF K-quants with general scales: ``scale_type=gguf_k`` grids (presets ``gguf_q2_k`` .. ``gguf_q6_k`` and
llama.cpp's mixes) written as Q2_K .. Q6_K blocks exactly.

Checks: the grid's scales are, per 256 input channels, integer multiples of one float16 number within the
K-quant's sub-scale range; RTN and GPTQ round on it; the ``gguf`` package dequantizes every quantized tensor of
Llama, Qwen2 and Mistral models built from configs to exactly the quantized model's weight; transformers' GGUF
loader computes the quantized model's logits; a Q3_K block packed here decodes like a hand-computed one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers.gguf_files import same_tensors  # noqa: E402
from helpers.llm_models import VOCAB, token_batches  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos  # noqa: E402
from quark_brevitas.brevitas_adapter.kquant import snap_kquant_scales  # noqa: E402
from quark_brevitas.config.gguf_mixes import gguf_kquant_layer  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.export import export_gguf  # noqa: E402
from quark_brevitas.export.intweights import IntegerWeight, integer_weights  # noqa: E402
from quark_brevitas.types import QSchemeType, ScaleType  # noqa: E402

KQUANTS = {"gguf_q6_k": ("Q6_K", 127, 6, 16), "gguf_q5_k": ("Q5_K", 63, 5, 32), "gguf_q4_k": ("Q4_K", 63, 4, 32),
           "gguf_q3_k": ("Q3_K", 31, 3, 16), "gguf_q2_k": ("Q2_K", 15, 2, 16)}
_WIDE = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _model(family: str, layers: int = 1) -> torch.nn.Module:
    """A decoder whose every Linear input is a multiple of 256 (whole K-quant super-blocks)."""
    torch.manual_seed(0)
    config, model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                     "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    return model(config(**{**_WIDE, "num_hidden_layers": layers})).eval()


#: llama.cpp's asymmetric Q2_K / Q4_K / Q5_K (a minimum per sub-block), as the ``gguf_q*_k_m`` mixes use them.
ASYMMETRIC = {"gguf_q5_k_asymmetric": "Q5_K", "gguf_q4_k_asymmetric": "Q4_K", "gguf_q2_k_asymmetric": "Q2_K"}


def _quantize(model: torch.nn.Module, preset: str, gptq: bool = False) -> torch.nn.Module:
    config = (Config(QLayerConfig(), layer_type_quant_config={torch.nn.Linear: gguf_kquant_layer(ASYMMETRIC[preset])})
              if preset in ASYMMETRIC else get_preset(preset))
    if gptq:
        config.algo_config = [algos.GPTQ()]
    return ModelQuantizer(config).quantize_model(model, token_batches(2))


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def test_snapped_scales_are_small_multiples_of_one_float16_number() -> None:
    scales = torch.rand(3, 32) * 0.05 + 0.05
    snapped = snap_kquant_scales(scales, 16, 31).reshape(3, 2, 16)
    d = snapped.amax(-1, keepdim=True) / 31
    assert torch.equal(d.half().float(), d)  # the largest sub-scale is the largest allowed
    multiples = snapped / d
    assert torch.equal(multiples, multiples.round()) and multiples.min() >= 1 and multiples.max() <= 31
    error = (snapped - scales.reshape(3, 2, 16)).abs()
    assert (error <= d / 2 * (1 + 1e-6)).all()  # the nearest multiple: within half a step


@pytest.mark.parametrize("preset", sorted(KQUANTS))
def test_the_grid_holds_every_scale_as_a_sub_scale_of_a_float16_super_block_scale(preset: str) -> None:
    _, top, bits, group = KQUANTS[preset]
    quant = _quantize(_model("llama"), preset)
    for name, entry in integer_weights(quant).items():
        assert entry.format == f"int{bits}" and entry.group_size == group, name
        scales = entry.scale.double().reshape(-1, 256 // group)
        d = scales.max(dim=1, keepdim=True).values / top
        assert torch.equal(d.half().double(), d), name
        sub = scales / d
        assert torch.equal(sub, sub.round()) and sub.max() <= top, name


@pytest.mark.slow
@pytest.mark.parametrize(("family", "preset", "gptq"), [
    ("llama", "gguf_q6_k", False), ("llama", "gguf_q5_k", True), ("llama", "gguf_q4_k", False),
    ("llama", "gguf_q3_k", True), ("llama", "gguf_q2_k", False), ("qwen2", "gguf_q4_k", True),
    ("qwen2", "gguf_q3_k", False), ("mistral", "gguf_q2_k", True), ("mistral", "gguf_q5_k", False),
    ("qwen2", "gguf_q4_k_asymmetric", True), ("mistral", "gguf_q5_k_asymmetric", False),
    ("llama", "gguf_q2_k_asymmetric", True), ("qwen2", "gguf_q2_k_asymmetric", False)])
def test_every_tensor_dequantizes_exactly_and_transformers_computes_the_same_logits(
        family: str, preset: str, gptq: bool, tmp_path: Path) -> None:
    qtype = ASYMMETRIC[preset] if preset in ASYMMETRIC else KQUANTS[preset][0]
    quant = _quantize(_model(family), preset, gptq)
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    arch = gguf.MODEL_ARCH.QWEN2 if family == "qwen2" else gguf.MODEL_ARCH.LLAMA
    name_map = gguf.get_tensor_name_map(arch, 1)
    layers = {n: m for n, m in quant.named_modules() if hasattr(m, "quant_weight")}
    assert len(layers) == 8
    for name, layer in layers.items():
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == qtype
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if family != "qwen2" and (".q_proj" in name or ".k_proj" in name):
            decoded = _unpermute(decoded, 4 if ".q_proj" in name else 2)
        expected = layer.quant_weight().value.detach().numpy()
        assert np.abs(decoded - expected).max() == 0.0, name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        ours, theirs = quant(tokens, labels=tokens), loaded(tokens, labels=tokens)
    assert torch.allclose(theirs.logits, ours.logits, atol=1e-5, rtol=0)
    assert abs(float(torch.exp(theirs.loss)) / float(torch.exp(ours.loss)) - 1) < 1e-3


def test_gptq_rounds_on_the_k_quant_grid() -> None:
    """GPTQ changes codes (not only RTN's) while keeping the snapped scales: both are exact K-quant weights."""
    rtn, gptq = _quantize(_model("llama"), "gguf_q3_k"), _quantize(_model("llama"), "gguf_q3_k", gptq=True)
    a, b = integer_weights(rtn), integer_weights(gptq)
    name = "model.layers.0.mlp.gate_proj"
    assert not torch.equal(a[name].int_weight, b[name].int_weight)
    assert torch.equal(a[name].scale, b[name].scale)


def test_q3_k_block_decodes_like_hand_computed_weights() -> None:
    """One Q3_K super-block: codes -4..3 in every position, sub-scales 1..16, d = 2**-7; the gguf package's
    decoding of our bytes is d * s * q element by element."""
    from quark_brevitas.export.gguf.kquants import pack_q3_k

    codes = (torch.arange(256) % 8 - 4).reshape(1, 256).to(torch.int8)
    sub = torch.arange(1, 17, dtype=torch.float32)
    scale = (sub * 2.0 ** -7).reshape(1, 16)
    entry = IntegerWeight("w", codes, scale, torch.zeros(()), 3, True, False, 1, "int3", group_size=16)
    decoded = gguf.quants.dequantize(pack_q3_k("w", entry), gguf.GGMLQuantizationType.Q3_K)
    expected = codes.float().numpy() * np.repeat(scale.numpy(), 16, axis=1)
    assert decoded.shape == (1, 256) and np.array_equal(decoded, expected)


def test_gguf_k_refuses_a_layout_no_k_quant_has() -> None:
    from quark_brevitas import Config, QLayerConfig

    spec = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_group, group_size=16, scale_type=ScaleType.gguf_k)
    with pytest.raises(ConfigError, match=r"gguf_k scales are GGUF K-quant.*Q4_K: int4 symmetric or asymmetric "
                                          r"per_group group_size=32"):
        ModelQuantizer(Config(QLayerConfig(weight=spec)))
    q3_asymmetric = QTensorConfig(bit_width=3, symmetric=False, qscheme=QSchemeType.per_group, group_size=16,
                                  scale_type=ScaleType.gguf_k)  # Q3_K stores no sub-minimums
    with pytest.raises(ConfigError, match=r"Q3_K: int3 symmetric per_group group_size=16"):
        ModelQuantizer(Config(QLayerConfig(weight=q3_asymmetric)))


@pytest.mark.parametrize(("preset", "fallback"), [("gguf_q6_k", "Q8_0"), ("gguf_q5_k", "Q8_0"), ("gguf_q4_k", "Q4_0"),
                                                  ("gguf_q3_k", "Q4_0"), ("gguf_q2_k", "Q4_0")])
def test_rows_of_no_whole_super_block_are_written_in_the_32_channel_fallback_type_exactly(
        preset: str, fallback: str, tmp_path: Path) -> None:
    """tiny_llama's Linear layers have 64 or 128 input channels: the grid shares one float16 scale per 32 channels
    there, and the file holds them as Q8_0 (int6 codes) / Q4_0 (int3 codes), still dequantizing exactly."""
    from helpers.llm_models import tiny_llama

    quant = _quantize(tiny_llama(kv_heads=2), preset)
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, layer in ((n, m) for n, m in quant.named_modules() if hasattr(m, "quant_weight")):
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == fallback, name
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj" in name or ".k_proj" in name:
            decoded = _unpermute(decoded, 4 if ".q_proj" in name else 2)
        assert np.abs(decoded - layer.quant_weight().value.detach().numpy()).max() == 0.0, name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-5, rtol=0)


def test_streamed_checkpoint_writes_the_same_k_quant_file(tmp_path: Path) -> None:
    """A gguf_q3_k checkpoint quantized block by block is written block by block with the tensors (types and
    bytes) export_gguf writes for the loaded model."""
    from quark_brevitas.hf.export_streamed import export_gguf_streamed
    from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained

    float_dir = tmp_path / "float"
    _model("llama", layers=2).save_pretrained(float_dir)
    checkpoint = quantize_pretrained(float_dir, get_preset("gguf_q3_k"), [{"input_ids": t} for t in token_batches(1)],
                                     tmp_path / "ckpt")
    streamed = export_gguf_streamed(checkpoint, tmp_path / "streamed")
    whole = export_gguf(load_pretrained_quantized(checkpoint), tmp_path / "whole")
    written = same_tensors(streamed, whole)
    assert sum(t.tensor_type.name == "Q3_K" for t in written.values()) == 15


def test_rows_of_no_multiple_of_32_hold_the_quantized_weight_as_f32(tmp_path: Path) -> None:
    """An MLP of 688 channels (the trained Llama's): down_proj's rows fit no 32-channel type (llama.cpp writes F16
    there); the file holds its quantized weight as F32, exactly, and the other layers as Q6_K."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_WIDE, "intermediate_size": 688})).eval()
    quant = _quantize(model, "gguf_q6_k")
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q6_K"
    down = quant.get_submodule("model.layers.0.mlp.down_proj").quant_weight().value.detach().numpy()
    assert np.array_equal(np.asarray(tensors["blk.0.ffn_down.weight"].data), down)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, quant(tokens).logits, atol=1e-5, rtol=0)


def test_q4_k_m_mix_follows_llama_cpps_per_tensor_rules(tmp_path: Path) -> None:
    """8 layers: use_more_bits picks layers 0, 3, 6, 7 (first and last eighth, every third between) for Q6_K
    attn_v / ffn_down; the head is Q6_K; every other Linear weight Q4_K; all exact."""
    from quark_brevitas.config.gguf_mixes import gguf_mix_types

    assert gguf_mix_types("Q3_K_M", 32, 1)["*layers.1.self_attn.v_proj"] == "Q5_K"
    assert gguf_mix_types("Q3_K_M", 32, 1)["*layers.2.mlp.down_proj"] == "Q4_K"
    assert gguf_mix_types("Q3_K_M", 32, 1)["*layers.1.mlp.down_proj"] == "Q5_K"  # first sixteenth: 0, 1
    assert gguf_mix_types("Q2_K", 4, 4)["*layers.0.self_attn.v_proj"] == "Q4_K"  # 4 query heads per kv head
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_WIDE, "num_hidden_layers": 8})).eval()
    quant = ModelQuantizer(get_preset("gguf_q4_k_m", model.config)).quantize_model(model, token_batches(1))
    path = export_gguf(quant, tmp_path / "out")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    more = {0, 3, 6, 7}
    for layer in range(8):
        for tensor in ("attn_v", "ffn_down"):
            assert types[f"blk.{layer}.{tensor}.weight"] == ("Q6_K" if layer in more else "Q4_K"), (layer, tensor)
        assert types[f"blk.{layer}.attn_q.weight"] == types[f"blk.{layer}.ffn_up.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "F32"


def test_a_mix_without_the_model_says_what_it_needs() -> None:
    with pytest.raises(ConfigError, match="number of layers: give the model"):
        get_preset("gguf_q3_k_m")


# ===================================================================== optional: llama.cpp itself
@pytest.mark.parametrize(("preset", "family"), [("gguf_q6_k", "llama"), ("gguf_q5_k", "llama"), ("gguf_q4_k", "llama"),
                                                ("gguf_q3_k", "llama"), ("gguf_q2_k", "llama"),
                                                ("gguf_q4_k", "mistral")])
def test_llama_cpp_runs_our_k_quant_file_like_the_quantized_model(preset: str, family: str, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, the extra [llamacpp]) loads the K-quant file and its logits follow the quantized
    model's (not bit for bit: its K-quant products quantize the activations to 8 bits too) far closer than the
    float model's do. Mistral is written as llama.cpp's llama architecture, as its converter writes it."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    from helpers.llm_folders import bpe_tokenizer as _bpe_tokenizer

    _bpe_tokenizer(tmp_path / "tok")
    quant = _quantize(_model(family), preset)
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    tokens = token_batches(1, seed=3)[0][0]
    runner = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens), logits_all=True, n_threads=1, verbose=False)
    runner.eval(tokens.tolist())
    theirs = torch.tensor(np.asarray(runner.scores[:len(tokens)]), dtype=torch.float32)
    with torch.no_grad():
        ours, float_logits = quant(tokens[None]).logits[0], _model(family)(tokens[None]).logits[0]
    error, float_error = (float((logits - ours).norm() / ours.norm()) for logits in (theirs, float_logits))
    assert error < 0.05, error
    if preset in ("gguf_q4_k", "gguf_q3_k", "gguf_q2_k"):  # Q5_K / Q6_K weights are near float themselves
        assert error < 0.25 * float_error, (error, float_error)
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("float_type", ["F32", "F16"])
def test_a_float_model_is_written_as_an_f32_or_f16_file(float_type: str, tmp_path: Path) -> None:
    """What llama.cpp's own quantizer starts from: the float model, matrices F32 (exact) or F16, vectors F32."""
    model = _model("llama")
    path = export_gguf(model, tmp_path / "out", float_type=float_type)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_up.weight"] == types["output.weight"] == float_type
    assert types["blk.0.attn_norm.weight"] == "F32"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        reference = model.half().float() if float_type == "F16" else model
        mlp = "model.layers.0.mlp.up_proj"
        assert torch.equal(loaded.get_submodule(mlp).weight, reference.get_submodule(mlp).weight)
        assert torch.allclose(loaded(tokens).logits, reference(tokens).logits, atol=1e-4, rtol=0)


def test_float_type_is_checked(tmp_path: Path) -> None:
    from quark_brevitas.export.errors import ExportArgumentError

    with pytest.raises(ExportArgumentError, match="float_type must be 'F32' or 'F16'"):
        export_gguf(_model("llama"), tmp_path / "out", float_type="BF16")


@pytest.mark.parametrize(("preset", "algo"), [("gguf_q4_k", "qronos"), ("gguf_q4_k", "autoround"),
                                              ("gguf_q3_k", "autoround")])
def test_qronos_and_autoround_round_on_the_k_quant_grid_and_the_file_decodes_exactly(preset: str, algo: str,
                                                                                      tmp_path: Path) -> None:
    """Qronos and AutoRound (learned offsets and clipping) choose other codes than RTN, their scales stay K-quant
    sub-scales of one float16 number per super-block, and the ``gguf`` package decodes every tensor exactly."""
    qtype, sub_max, _, group = KQUANTS[preset]
    config = get_preset(preset)
    config.algo_config = [algos.QronosConfig() if algo == "qronos" else algos.AutoRoundConfig(iters=8, batch_size=1)]
    quant = ModelQuantizer(config).quantize_model(_model("llama"), token_batches(2))
    rtn = integer_weights(_quantize(_model("llama"), preset))
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    weights = integer_weights(quant)
    assert len(weights) == 8  # 7 in the block and the head
    for name, entry in weights.items():
        scales = entry.scale.reshape(entry.scale.shape[0], -1)
        assert torch.equal(snap_kquant_scales(scales, 256 // group, sub_max), scales), name
        tensor = tensors[name_map.get_name(name) + ".weight"]
        assert tensor.tensor_type.name == qtype
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj" in name or ".k_proj" in name:
            decoded = _unpermute(decoded, 4 if ".q_proj" in name else 2)
        assert np.abs(decoded - entry.dequantize().numpy()).max() == 0.0, name
    assert any(not torch.equal(entry.int_weight, rtn[name].int_weight) for name, entry in weights.items())
