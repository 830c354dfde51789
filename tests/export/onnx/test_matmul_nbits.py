"""Weight-only Linear layers exported as onnxruntime's ``MatMulNBits`` (com.microsoft), exactly.

The rewrite (:mod:`quark_brevitas.export.onnx.passes.nbits`) must hold the model's own codes, scales and zero points:
the weights are unpacked from the file here, independently of the exporter's packing, and compared with the
quantized PyTorch weights bit for bit; the file's outputs in a *default* onnxruntime session are compared with
the opset-21 ``DequantizeLinear`` form (``int4_kernel="dequantize"``) run with onnxruntime's optimizations off
(what that file says) and with PyTorch. Tiny models only; BERT and the Llama decoder are built from configs.
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.onnx_check import assert_decodes_like_pytorch
from onnx import numpy_helper
from torch import nn

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.export import ExportError, export_onnx_qcdq, run_onnx
from quark_brevitas.export.onnx.passes.kernels import WEIGHT_ONLY_KERNEL_REWRITES
from quark_brevitas.export.onnx.passes.nbits import NBITS_REWRITE, matmul_nbits
from quark_brevitas.types import Dtype, QSchemeType

PG = QSchemeType.per_group
#: pad_groups: these tests give layers whose input channels are no multiple of the group (the kernel's padding)
SPECS = {
    "int4 sym": lambda g: QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=g, pad_groups=True),
    "uint4 asym": lambda g: QTensorConfig(dtype=Dtype.uint4, symmetric=False, qscheme=PG, group_size=g,
                                          pad_groups=True),
}


def _quantize(model: nn.Module, spec: QTensorConfig, x: torch.Tensor) -> nn.Module:
    config = Config(QLayerConfig(weight=spec), pre_quant_opt_config=[])
    return ModelQuantizer(config).quantize_model(model, [x])


def _nodes(path: pathlib.Path, op: str) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == op]


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _unoptimized(path: pathlib.Path, x: torch.Tensor) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _unpack(node: onnx.NodeProto, inits: dict[str, np.ndarray]) -> np.ndarray:
    """The dequantized weight [N, K] a MatMulNBits node computes with, read as its contrib-op spec says:
    B [N, blocks, block/2] two codes a byte (low nibble first), scales [N, blocks], zero points [N, ceil(blocks/2)]
    packed the same way (default 8)."""
    a = _attrs(node)
    n, k, block, bits = a["N"], a["K"], a["block_size"], a["bits"]
    assert bits == 4
    packed = inits[node.input[1]].reshape(n, -1)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, -1).astype(np.float32)
    blocks = -(-k // block)
    scales = inits[node.input[2]].reshape(n, blocks)
    if len(node.input) > 3 and node.input[3]:
        zp_bytes = inits[node.input[3]].reshape(n, -1)
        zps = np.stack([zp_bytes & 0xF, zp_bytes >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    else:
        zps = np.full((n, blocks), 8.0, np.float32)
    dequantized = (codes.reshape(n, blocks, block) - zps[:, :, None]) * scales[:, :, None]
    return dequantized.reshape(n, -1)[:, :k]


def _mlp(k: int, bias: bool) -> nn.Module:
    torch.manual_seed(18)
    return nn.Sequential(nn.Linear(k, 48, bias=bias), nn.ReLU(), nn.Linear(48, 16, bias=bias)).eval()


# ------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("shape", [(4, 7), (6,)], ids=["tokens", "rows"])
def test_matmulnbits_file_holds_our_codes_and_computes_what_the_dequantize_file_says(
        tmp_path: pathlib.Path, group: int, name: str, shape: tuple[int, ...]) -> None:
    """Token inputs export as MatMul (+ Add), rows as Gemm with its bias; K = 160 is no multiple of 128 and the
    second layer's K = 48 none of 32: the last block is partial."""
    k = 160
    x = torch.randn(*shape, k, generator=torch.Generator().manual_seed(1))
    quant = _quantize(_mlp(k, bias=True), SPECS[name](group), x)
    nbits = export_onnx_qcdq(quant, x, tmp_path / "nbits.onnx")
    dequantize = export_onnx_qcdq(quant, x, tmp_path / "dq.onnx", int4_kernel="dequantize")
    with torch.no_grad():
        reference = quant(x).numpy()

    nodes = _nodes(nbits.path, "MatMulNBits")
    assert len(nodes) == 2 and not _nodes(nbits.path, "DequantizeLinear")
    assert dict(nbits.rewrites)[NBITS_REWRITE] == 2 and nbits.weight_dtypes == ("UINT4",)
    assert {n.domain for n in nodes} == {"com.microsoft"}
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(nbits.path)).graph.initializer}
    layers = [m for m in quant.modules() if hasattr(m, "quant_weight")]
    for node, layer, (k_in, n_out) in zip(nodes, layers, [(k, 48), (48, 16)]):
        attributes = _attrs(node)
        assert (attributes["K"], attributes["N"], attributes["bits"]) == (k_in, n_out, 4)
        assert attributes["block_size"] == group and attributes["accuracy_level"] == 1
        assert (len(node.input) > 3 and bool(node.input[3])) == (name == "uint4 asym")  # zero points iff asym
        with torch.no_grad():
            ours = layer.quant_weight().value.numpy()
        np.testing.assert_array_equal(_unpack(node, inits), ours)  # exactly our weights, not re-quantized
    float_weights = [a for a in inits.values() if a.dtype == np.float32 and a.size >= 16 * 48]
    assert not float_weights  # no float copy of a weight left in the file

    # a default session (what run_onnx opens) computes what the DequantizeLinear file says, and PyTorch's values
    out = run_onnx(nbits.path, x)[0]
    np.testing.assert_allclose(out, _unoptimized(dequantize.path, x), rtol=0, atol=1e-5)
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-5)
    assert nbits.max_abs_diff < 1e-5


def test_linear_without_bias_and_the_gemm_bias_input(tmp_path: pathlib.Path) -> None:
    x = torch.randn(5, 64)
    quant = _quantize(_mlp(64, bias=False), SPECS["int4 sym"](32), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    nodes = _nodes(report.path, "MatMulNBits")
    assert len(nodes) == 2 and all(len(n.input) == 3 for n in nodes)  # no zero points, no bias
    with torch.no_grad():
        np.testing.assert_allclose(run_onnx(report.path, x)[0], quant(x).numpy(), rtol=0, atol=1e-5)
    with_bias = export_onnx_qcdq(_quantize(_mlp(64, bias=True), SPECS["int4 sym"](32), x), x, tmp_path / "b.onnx")
    assert all(len(n.input) == 6 and n.input[5] for n in _nodes(with_bias.path, "MatMulNBits"))  # Gemm's C


def test_the_accuracy_level_in_the_node_is_what_makes_a_default_session_right(tmp_path: pathlib.Path) -> None:
    """onnxruntime's own default for a fused MatMulNBits is level 4 (int8 activations on the fly): the same file
    with that level is off, and so is the DequantizeLinear form that a default session fuses at level 4."""
    x = torch.randn(4, 7, 256, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)).eval()
    quant = _quantize(model, SPECS["uint4 asym"](32), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    with torch.no_grad():
        reference = quant(x).numpy()
    assert np.abs(run_onnx(report.path, x)[0] - reference).max() < 1e-5
    proto = onnx.load(str(report.path))
    for node in proto.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 4
    onnx.save(proto, str(tmp_path / "level4.onnx"))
    assert np.abs(run_onnx(tmp_path / "level4.onnx", x)[0] - reference).max() > 1e-3


def test_weight_only_8bit_per_channel_layers_are_right_in_a_default_session(tmp_path: pathlib.Path) -> None:
    """onnxruntime fuses weight-only per-channel int8 DequantizeLinear -> MatMul at level 4 too (it was right only
    with a session option the verification set): such layers are MatMulNBits with 8 bits now."""
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(3))
    model = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    quant = _quantize(model, QTensorConfig(qscheme=QSchemeType.per_channel), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "w8.onnx")
    nodes = _nodes(report.path, "MatMulNBits")
    assert [(_attrs(n)["bits"], _attrs(n)["K"]) for n in nodes] == [(8, 96), (8, 64)]
    assert report.weight_dtypes == ("UINT8",)
    with torch.no_grad():
        np.testing.assert_allclose(run_onnx(report.path, x)[0], quant(x).numpy(), rtol=0, atol=1e-5)


def test_w8a8_layers_keep_their_integer_kernels(tmp_path: pathlib.Path) -> None:
    x = torch.randn(3, 5, 64)
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=QTensorConfig()),
                    pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(_mlp(64, bias=True), [x])
    report = export_onnx_qcdq(quant, x, tmp_path / "w8a8.onnx")
    assert not _nodes(report.path, "MatMulNBits") and NBITS_REWRITE not in dict(report.rewrites)


@pytest.mark.parametrize("group", [8, 24])
def test_group_sizes_matmulnbits_cannot_take_stay_dequantize_with_an_info_log(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, group: int) -> None:
    x = torch.randn(4, 48)
    quant = _quantize(_mlp(48, bias=True), SPECS["int4 sym"](group), x)
    with caplog.at_level(logging.INFO, logger="quark_brevitas.export.onnx.passes.nbits"):
        report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert not _nodes(report.path, "MatMulNBits") and len(_nodes(report.path, "DequantizeLinear")) == 2
    assert f"group size {group} (MatMulNBits takes powers of two >= 16)" in caplog.text
    assert report.max_abs_diff < 1e-5


def test_int4_kernel_is_checked_and_reaches_the_exporter_through_model_exporter(tmp_path: pathlib.Path) -> None:
    x = torch.randn(4, 64)
    quant = _quantize(_mlp(64, bias=True), SPECS["int4 sym"](32), x)
    with pytest.raises(ExportError, match=r"int4_kernel must be one of 'matmulnbits', 'dequantize'; got 'nbits'"):
        export_onnx_qcdq(quant, x, tmp_path / "m.onnx", int4_kernel="nbits")
    report = ModelExporter(tmp_path / "dq.onnx").export_onnx_model(quant, x, int4_kernel="dequantize")
    assert not _nodes(report.path, "MatMulNBits") and report.weight_dtypes == ("INT4",)
    assert [r.apply for r in WEIGHT_ONLY_KERNEL_REWRITES] == [matmul_nbits]


# ------------------------------------------------------------------------------------- transformers

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_tiny_bert_with_the_bert_w4_g32_preset(tmp_path: pathlib.Path) -> None:
    from quark_brevitas.config.presets import get_preset

    config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    quant = ModelQuantizer(get_preset("bert_w4_g32")).quantize_model(model, [batch])
    report = export_onnx_qcdq(quant, batch, tmp_path / "bert.onnx")
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(_nodes(report.path, "MatMulNBits")) == n_linear
    assert all(_attrs(n)["block_size"] == 32 for n in _nodes(report.path, "MatMulNBits"))
    assert report.max_abs_diff < 1e-4
    other = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    feed = {"input_ids": other, "attention_mask": torch.ones_like(other)}
    with torch.no_grad():
        expected = quant(**feed).last_hidden_state.numpy()
    np.testing.assert_allclose(run_onnx(report.path, feed)[0], expected, rtol=0, atol=1e-4)


def test_tiny_llama_decoder_with_past_key_values_decodes_like_pytorch(tmp_path: pathlib.Path) -> None:
    layers, vocab = 2, 64
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(6))
    quant = _quantize(model, SPECS["int4 sym"](32), ids)
    prompt = ids[:, :6]
    report = export_onnx_qcdq(quant, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                              tmp_path / "llama.onnx", past_key_values=True)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(_nodes(report.path, "MatMulNBits")) == n_linear  # lm_head included
    assert_decodes_like_pytorch(report.path, quant, prompt)  # prompt, then one token a step (M=1)


@pytest.mark.parametrize("int4_kernel", ["matmulnbits", "dequantize"])
def test_lm_head_tied_to_the_embedding_keeps_the_lookup_float(tmp_path: pathlib.Path, int4_kernel: str) -> None:
    """``tie_word_embeddings``: the quantized lm_head and the float embedding share one parameter. The export used to
    write the quantized values into that parameter, so the file's embedding looked up quantized rows (logits off
    by 0.05-0.07, the export refused by its own verification)."""
    vocab = 64
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(6))
    quant = _quantize(model, SPECS["int4 sym"](32), ids)
    assert quant.lm_head.weight is quant.model.embed_tokens.weight and type(quant.lm_head).__name__ == "QuantLinear"
    float_table = quant.model.embed_tokens.weight.detach().clone()
    prompt = ids[:, :6]
    report = export_onnx_qcdq(quant, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                              tmp_path / "tied.onnx", past_key_values=True, int4_kernel=int4_kernel)
    assert torch.equal(quant.model.embed_tokens.weight, float_table)  # the model is as it was
    assert quant.lm_head.weight is quant.model.embed_tokens.weight
    assert_decodes_like_pytorch(report.path, quant, prompt)
