"""Asymmetric K-quant grids (``scale_type=gguf_k``, ``symmetric=False``): llama.cpp's own Q4_K / Q5_K / Q2_K form
``d * sc * q - dmin * m``, written exactly and used by the K-quant mixes (issue 31)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers.gguf_files import same_tensors  # noqa: E402
from helpers.llm_models import VOCAB, token_batches  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, algos  # noqa: E402
from quark_brevitas.config.gguf_mixes import gguf_kquant_layer  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import export_gguf  # noqa: E402
from quark_brevitas.export.intweights import integer_weights  # noqa: E402

_WIDE = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _llama(layers: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_WIDE, "num_hidden_layers": layers})).eval()


def _every_linear(qtype: str, algo: object | None = None) -> Config:
    config = Config(QLayerConfig(), layer_type_quant_config={torch.nn.Linear: gguf_kquant_layer(qtype)})
    config.algo_config = [algo] if algo is not None else []
    return config


def _q4_k_by_hand(block: np.ndarray) -> np.ndarray:
    """One ``block_q4_K`` (144 bytes) decoded from llama.cpp's layout, written out bit by bit here: float16 ``d``,
    ``dmin``; 12 bytes of 6-bit sub-scales / sub-minimums; 128 bytes of 4-bit codes (element ``64 h + 32 k + l`` in
    nibble ``k`` of byte ``32 h + l``); ``w = d * sc[j] * q - dmin * m[j]`` for sub-block ``j = element // 32``."""
    d, dmin = (float(np.frombuffer(block[i:i + 2].tobytes(), dtype=np.float16)[0]) for i in (0, 2))
    raw = [int(b) for b in block[4:16]]
    sc, m = [0] * 8, [0] * 8
    for j in range(8):
        if j < 4:
            sc[j], m[j] = raw[j] & 63, raw[j + 4] & 63
        else:
            sc[j] = (raw[j + 4] & 0x0F) | ((raw[j - 4] >> 6) << 4)
            m[j] = (raw[j + 4] >> 4) | ((raw[j] >> 6) << 4)
    assert all(0 <= value <= 63 for value in sc + m)  # 6-bit fields
    codes = np.zeros(256, dtype=np.int64)
    for h in range(4):
        for lane in range(32):
            byte = int(block[16 + 32 * h + lane])
            codes[64 * h + lane], codes[64 * h + 32 + lane] = byte & 0x0F, byte >> 4
    out = np.zeros(256, dtype=np.float32)
    for element in range(256):
        j = element // 32
        scale = np.float32(d) * np.float32(sc[j])  # exact: 11 x 6 significant bits
        minimum = np.float32(dmin) * np.float32(m[j])
        out[element] = scale * np.float32(codes[element]) - minimum
    return out


def test_asymmetric_q4_k_decodes_to_the_quantized_weight_exactly_by_hand_and_by_the_gguf_package(
        tmp_path: Path) -> None:
    quant = ModelQuantizer(_every_linear("Q4_K")).quantize_model(_llama(), token_batches(2))
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    tensor = tensors["blk.0.ffn_down.weight"]
    assert tensor.tensor_type.name == "Q4_K"
    expected = quant.get_submodule("model.layers.0.mlp.down_proj").quant_weight().value.detach().numpy()
    blocks = np.asarray(tensor.data).reshape(-1, 144)
    by_hand = np.concatenate([_q4_k_by_hand(block) for block in blocks]).reshape(expected.shape)
    assert np.abs(by_hand - expected).max() == 0.0
    decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert np.abs(decoded - expected).max() == 0.0
    entry = integer_weights(quant)["model.layers.0.mlp.down_proj"]
    assert entry.format == "uint4" and entry.offset_dequantization
    assert bool((entry.zero_point.float() != entry.zero_point.float().round()).any())  # a float minimum


@pytest.mark.slow
@pytest.mark.parametrize(("qtype", "algo"), [("Q5_K", None), ("Q2_K", None), ("Q4_K", "gptq"),
                                             ("Q4_K", "autoround"), ("Q2_K", "qronos")])
def test_every_asymmetric_k_tensor_decodes_exactly_whatever_rounds_on_the_grid(qtype: str, algo: str | None,
                                                                               tmp_path: Path) -> None:
    """RTN, GPTQ, AutoRound and Qronos round on the snapped grid; the file's every tensor is the quantized weight."""
    chosen = {"gptq": algos.GPTQ(), "autoround": algos.AutoRoundConfig(iters=8, batch_size=1),
              "qronos": algos.QronosConfig(), None: None}[algo]
    quant = ModelQuantizer(_every_linear(qtype, chosen)).quantize_model(_llama(), token_batches(2))
    path = export_gguf(quant, tmp_path / "out")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    weights = integer_weights(quant)
    assert len(weights) == 8
    down = tensors["blk.0.ffn_down.weight"]
    assert down.tensor_type.name == qtype
    decoded = gguf.quants.dequantize(down.data, down.tensor_type)
    layer = quant.get_submodule("model.layers.0.mlp.down_proj")
    assert np.abs(decoded - layer.quant_weight().value.detach().numpy()).max() == 0.0
    if algo is not None:
        rtn = integer_weights(ModelQuantizer(_every_linear(qtype)).quantize_model(_llama(), token_batches(2)))
        assert any(not torch.equal(entry.int_weight, rtn[name].int_weight) for name, entry in weights.items())


def _hand_asymmetric_q4_k_error(weight: torch.Tensor) -> float:
    """The weight error of a plain asymmetric Q4_K computed by hand: per sub-block of 32 min-max (the range widened
    to contain 0), scale = range / 15 and minimum quantized per super-block to 6-bit multiples of float16 ``d`` /
    ``dmin`` (the largest over 63), codes rounded to nearest on that grid."""
    w = weight.double().reshape(-1, 8, 32)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale, offset = (high - low) / 15, -low
    d = (scale.amax(-1, keepdim=True) / 63).half().double()
    dmin = (offset.amax(-1, keepdim=True) / 63).half().double()
    sc, m = torch.clamp(torch.round(scale / d), 1, 63), torch.clamp(torch.round(offset / dmin), 0, 63)
    step, minimum = (d * sc)[..., None], (dmin * m)[..., None]
    codes = torch.clamp(torch.round((w + minimum) / step), 0, 15)
    return float(((codes * step - minimum - w) ** 2).mean())


def test_a_skewed_weight_has_at_most_a_hand_computed_asymmetric_q4_k_error() -> None:
    """A weight whose rows are mostly positive (skewed): llama.cpp's asymmetric form spends all 16 codes on each
    sub-block's range, a signed code on the sub-block's scale about half of them; the mix's Q4_K grid must reach at
    least the hand-computed min-max asymmetric Q4_K's error (its scale/minimum search does better)."""
    torch.manual_seed(1)
    linear = torch.nn.Sequential(torch.nn.Linear(512, 64, bias=False))
    with torch.no_grad():
        linear[0].weight.copy_(torch.rand(64, 512) ** 2 * 0.1 - 0.01)
    reference = _hand_asymmetric_q4_k_error(linear[0].weight.detach())
    quant = ModelQuantizer(_every_linear("Q4_K")).quantize_model(linear)
    ours = float(((quant.get_submodule("0").quant_weight().value.double() - linear[0].weight.double()) ** 2).mean())
    assert ours <= reference, (ours, reference)


def test_the_k_quant_mixes_use_the_asymmetric_grid_and_the_plain_presets_stay_symmetric() -> None:
    model = _llama(8)
    mix = get_preset("gguf_q4_k_m", model.config).layer_type_quant_config
    weight = (mix.get(torch.nn.Linear) or mix["Linear"]).weight
    assert weight.symmetric is False and weight.bit_width == 4
    assert get_preset("gguf_q4_k").layer_type_quant_config["Linear"].weight.symmetric is not False


def test_llama_cpp_runs_our_asymmetric_q4_k_m_file_like_the_quantized_model(tmp_path: Path) -> None:
    """llama.cpp (the extra [llamacpp]) loads the Q4_K_M file and its logits follow the quantized model's (its
    K-quant products quantize the activations to 8 bits, so not bit for bit) far closer than the float model's."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    from helpers.llm_folders import bpe_tokenizer

    bpe_tokenizer(tmp_path / "tok")
    model = _llama(2)
    quant = ModelQuantizer(get_preset("gguf_q4_k_m", model.config)).quantize_model(model, token_batches(2))
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    assert "Q4_K" in {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    tokens = token_batches(1, seed=3)[0][0]
    runner = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens), logits_all=True, n_threads=1, verbose=False)
    runner.eval(tokens.tolist())
    theirs = torch.tensor(np.asarray(runner.scores[:len(tokens)]), dtype=torch.float32)
    with torch.no_grad():
        ours, float_logits = quant(tokens[None]).logits[0], _llama(2)(tokens[None]).logits[0]
    error, float_error = (float((logits - ours).norm() / ours.norm()) for logits in (theirs, float_logits))
    assert error < 0.05 and error < 0.25 * float_error, (error, float_error)


@pytest.mark.slow
def test_a_checkpoint_of_an_asymmetric_k_grid_reloads_to_the_same_weights_and_file(tmp_path: Path) -> None:
    """The checkpoint keeps the unsnapped scale and minimum parameters; the snapping is a pure function of them,
    so the reloaded model has the same quantized weights, and its GGUF file the same bytes."""
    from quark_brevitas.checkpoint import load_quantized, save_quantized

    config = _every_linear("Q4_K", algos.GPTQ())
    quant = ModelQuantizer(config).quantize_model(_llama(), token_batches(2))
    save_quantized(quant, tmp_path / "ckpt")
    loaded = load_quantized(_llama(), tmp_path / "ckpt")
    ours, theirs = integer_weights(quant), integer_weights(loaded)
    for name, entry in ours.items():
        assert torch.equal(entry.dequantize(), theirs[name].dequantize()), name
    first, second = export_gguf(quant, tmp_path / "a"), export_gguf(loaded, tmp_path / "b")
    assert Path(first).read_bytes() == Path(second).read_bytes()


@pytest.mark.slow
def test_a_streamed_q4_k_m_checkpoint_writes_the_same_asymmetric_file(tmp_path: Path) -> None:
    """A gguf_q4_k_m checkpoint quantized block by block is written block by block with the tensors (types and
    bytes) export_gguf writes for the loaded model; its Q4_K tensors are the asymmetric ones."""
    from quark_brevitas.hf.export_streamed import export_gguf_streamed
    from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained

    float_dir = tmp_path / "float"
    model = _llama(2)
    model.save_pretrained(float_dir)
    checkpoint = quantize_pretrained(float_dir, get_preset("gguf_q4_k_m", model.config),
                                     [{"input_ids": t} for t in token_batches(1)], tmp_path / "ckpt")
    streamed = export_gguf_streamed(checkpoint, tmp_path / "streamed")
    loaded = load_pretrained_quantized(checkpoint)
    whole = export_gguf(loaded, tmp_path / "whole")
    written = same_tensors(streamed, whole)
    assert integer_weights(loaded)["model.layers.0.mlp.up_proj"].offset_dequantization
    assert sum(t.tensor_type.name == "Q4_K" for t in written.values()) > 0
