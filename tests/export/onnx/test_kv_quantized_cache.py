"""ONNX decoders whose KV cache is stored quantized between steps (issue 30, ``past_key_values=True`` on a model with
``kv_cache_quant_config``): int8 and FP8 E4M3 codes with the calibrated static scale.

The reference is independent of the export: PyTorch's own incremental decoding of the quantized model with its
``DynamicCache`` (which holds the fake-quantized keys/values). The file is decoded greedily in onnxruntime (prompt step
on empty pasts, then one token a step, the presents fed back as codes). Logits must agree within float32 noise
(``1e-4 * max(1, max |logits|)``: the graph computes attention on the very same grid values, only in another
operation order) and the tokens exactly; the final ONNX cache, decoded with its scale, equals PyTorch's cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.llm_models import VOCAB, tiny_llama, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.calibration.data import output_cache  # noqa: E402
from quark_brevitas.config import Config, LLMTemplate, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.export import ExportError, export_onnx_qcdq  # noqa: E402
from quark_brevitas.export.onnx.decode import greedy_decode, torch_greedy_decode  # noqa: E402
from quark_brevitas.model_parts.attention import attention_quantization_disabled  # noqa: E402
from quark_brevitas.model_parts.kv_cache import kv_scales  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
CODES = {"int8": onnx.TensorProto.INT8, "fp8": onnx.TensorProto.FLOAT8E4M3FN}
STEPS = 6


def _config(dtype: Dtype, *, per_head: bool = False, post_rope: bool = True,
            weights: QLayerConfig | None = None) -> Config:
    spec = QTensorConfig(dtype=dtype, is_dynamic=False,
                         **({"qscheme": QSchemeType.per_channel, "ch_axis": 1} if per_head else {}))
    return Config(weights or QLayerConfig(), pre_quant_opt_config=[],
                  kv_cache_quant_config={"*k_proj": QLayerConfig(output_tensors=spec),
                                         "*v_proj": QLayerConfig(output_tensors=spec)},
                  kv_cache_group=[] if per_head else ["*k_proj", "*v_proj"], kv_cache_post_rope=post_rope)


def _quantized(config: Config) -> torch.nn.Module:
    return ModelQuantizer(config).quantize_model(tiny_llama(layers=LAYERS, kv_heads=KV_HEADS), token_batches(2))


def _prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _export(model: torch.nn.Module, path, **kwargs):  # noqa: ANN001, ANN202
    ids = _prompt(2, 6, 1)
    return export_onnx_qcdq(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path,
                            past_key_values=True, **kwargs)


def _template_fp8() -> Config:
    """Quark 0.13's LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8"): FP8 weights and
    inputs too, the cache after RoPE."""
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8")
    config.kv_cache_post_rope = True
    return config


def _template_attention(fmt: str) -> Callable[[], Config]:
    """int8 weights and inputs; ``fmt`` cache, query and attention probabilities (``attention_scheme``), after
    RoPE."""
    def build() -> Config:
        config = LLMTemplate.get("llama").get_config(scheme="int8", kv_cache_scheme=fmt, attention_scheme=fmt)
        config.kv_cache_post_rope = True
        return config
    return build


CASES = {
    "int8": lambda: _config(Dtype.int8),
    "int8_attention": _template_attention("int8"),
    "fp8_attention": _template_attention("fp8"),
    "fp8": lambda: _config(Dtype.fp8_e4m3),
    "int8_per_head": lambda: _config(Dtype.int8, per_head=True),
    "fp8_template": _template_fp8,
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    model = _quantized(CASES[request.param]())
    path = tmp_path_factory.mktemp(request.param) / "decoder.onnx"
    return request.param, model, _export(model, path)


@pytest.mark.slow
def test_cache_inputs_and_outputs_are_codes_with_the_calibrated_scales(exported) -> None:  # noqa: ANN001
    case, model, report = exported
    graph = onnx.load(str(report.path)).graph
    element = CODES[case.split("_")[0]]
    cache = [v for v in (*graph.input, *graph.output) if v.name.startswith(("past_key_values.", "present."))]
    assert len(cache) == 4 * LAYERS
    assert {v.type.tensor_type.elem_type for v in cache} == {element}
    consumers = {i: n.op_type for n in graph.node for i in n.input}
    producers = {o: n.op_type for n in graph.node for o in n.output}
    for i in range(LAYERS):
        for kind in ("key", "value"):
            assert consumers[f"past_key_values.{i}.{kind}"] in ("DequantizeLinear", "Concat")
            # int8: the new codes are concatenated to the past codes; FP8: the float present is quantized
            assert producers[f"present.{i}.{kind}"] == ("Concat" if case.startswith("int8") else "QuantizeLinear")
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for i, scales in enumerate(kv_scales(model)):
        np.testing.assert_array_equal(initializers[f"kv_cache.{i}.key.scale"], scales.key.numpy())
        np.testing.assert_array_equal(initializers[f"kv_cache.{i}.value.scale"], scales.value.numpy())
    assert report.opset >= (19 if case.startswith("fp8") else 13)
    assert report.cache_dtypes == (onnx.TensorProto.DataType.Name(element),)


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
def test_greedy_decoding_in_onnxruntime_matches_pytorch_step_by_step(exported, padded: bool) -> None:  # noqa: ANN001
    case, model, report = exported
    prompt = _prompt(3, 5, 2)  # another batch size and prompt length than the export's example
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :2] = 0
    result = greedy_decode(report.path, prompt, mask, steps=STEPS)
    ref_tokens, ref_logits = torch_greedy_decode(model, prompt, mask, steps=STEPS)
    for step, (got, want) in enumerate(zip(result.logits, (x[:, -1].float() for x in ref_logits))):
        tolerance = 1e-4 * max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= tolerance, f"{case}: step {step}"
    assert torch.equal(result.tokens, ref_tokens)
    # one byte per element: keys and values of every layer for the prompt + steps tokens fed
    tokens = prompt.shape[1] + STEPS
    assert result.cache_bytes == 2 * LAYERS * prompt.shape[0] * KV_HEADS * tokens * HEAD_DIM


@pytest.mark.slow
def test_the_final_onnx_cache_decodes_to_pytorchs_cache(exported) -> None:  # noqa: ANN001
    """The codes between steps are the quantized model's cache: decoded with their scale they equal the values
    PyTorch's DynamicCache holds (fed back through the file's presents after the last step)."""
    from quark_brevitas.export.onnx.kv_quant import run_session, to_torch
    from quark_brevitas.export.onnx.runtime import create_ort_session

    case, model, report = exported
    prompt = _prompt(2, 4, 3)
    session = create_ort_session(report.path)
    feed = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    codes = torch.float8_e4m3fn if case.startswith("fp8") else torch.int8
    for i in range(LAYERS):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = torch.zeros((2, KV_HEADS, 0, HEAD_DIM), dtype=codes)
    outputs = run_session(session, feed)
    with torch.no_grad():
        out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True)
    for i, (layer, scales) in enumerate(zip(output_cache(out).layers, kv_scales(model))):
        for kind, values, scale in (("key", layer.keys, scales.key), ("value", layer.values, scales.value)):
            stored = to_torch(outputs[f"present.{i}.{kind}"])
            assert stored.dtype == codes
            view = scale.view(1, -1, 1, 1) if scale.ndim else scale
            torch.testing.assert_close(stored.float() * view, values, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_quantized_cache_false_keeps_a_float_cache(tmp_path) -> None:  # noqa: ANN001
    model = _quantized(_config(Dtype.int8))
    report = _export(model, tmp_path / "float.onnx", quantized_cache=False)
    graph = onnx.load(str(report.path)).graph
    assert {v.type.tensor_type.elem_type for v in graph.input if v.name.startswith("past_")} == {
        onnx.TensorProto.FLOAT}
    assert report.cache_dtypes == ("FLOAT",)
    result = greedy_decode(report.path, _prompt(2, 4, 5), steps=3)
    assert result.cache_bytes == 2 * LAYERS * 2 * KV_HEADS * (4 + 3) * HEAD_DIM * 4


@pytest.mark.slow
def test_a_cache_quantized_before_rope_is_refused_or_kept_float(tmp_path, caplog) -> None:  # noqa: ANN001
    model = _quantized(_config(Dtype.int8, post_rope=False))
    with pytest.raises(ExportError, match="kv_cache_post_rope"):
        _export(model, tmp_path / "pre.onnx", quantized_cache=True)
    assert not (tmp_path / "pre.onnx").exists()
    with caplog.at_level("INFO", logger="quark_brevitas.export.onnx.kv_quant"):
        report = _export(model, tmp_path / "pre.onnx")
    assert "before RoPE" in caplog.text
    graph = onnx.load(str(report.path)).graph
    assert graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_what_cannot_be_stored_quantized_is_refused(tmp_path) -> None:  # noqa: ANN001
    model = _quantized(_config(Dtype.fp8_e4m3))
    ids = _prompt(1, 5, 0)
    with pytest.raises(ExportError, match="quantized_cache=True needs past_key_values=True"):
        export_onnx_qcdq(model, {"input_ids": ids}, tmp_path / "x.onnx", quantized_cache=True)
    with pytest.raises(ExportError, match=r"KV cache \(kv_cache_quant_config\) needs opset >= 19"):
        _export(model, tmp_path / "x.onnx", opset=14)
    with pytest.raises(ExportError, match="quantized_cache must be"):
        _export(model, tmp_path / "x.onnx", quantized_cache="int8")
    float_model = tiny_llama(layers=LAYERS, kv_heads=KV_HEADS)
    with pytest.raises(ExportError, match="no calibrated, enabled KV-cache quantizer"):
        _export(float_model, tmp_path / "x.onnx", quantized_cache=True)
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow
def test_verify_onnx_feeds_the_codes_of_a_float_past(exported) -> None:  # noqa: ANN001
    """verify_onnx on a quantized-cache file: the example's float pasts (here off the grid) are rounded to the cache's
    grid for the reference and fed as codes; the float model (no KV quantizers) cannot say what the codes mean."""
    from quark_brevitas.export import verify_onnx

    _, model, report = exported
    ids = _prompt(2, 3, 7)
    example = {"input_ids": ids, "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    generator = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        for kind in ("key", "value"):
            example[f"past_key_values.{i}.{kind}"] = torch.randn((2, KV_HEADS, 4, HEAD_DIM), generator=generator)
    result = verify_onnx(model, example, report.path)
    assert result.max_abs_diff <= result.tolerance
    with pytest.raises(ExportError, match="no calibrated, enabled KV-cache quantizer"):
        verify_onnx(tiny_llama(layers=LAYERS, kv_heads=KV_HEADS), example, report.path)


@pytest.mark.slow
def test_fp8_cache_model_exports_without_a_past_too(tmp_path) -> None:  # noqa: ANN001
    """The FP8 fake quantization of the new keys/values traces as standard ops (opset 19); before, the exporter
    failed on torch.float8_e4m3fn ("24 is not a valid JitScalarType")."""
    model = _quantized(_config(Dtype.fp8_e4m3))
    ids = _prompt(2, 6, 4)
    report = export_onnx_qcdq(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "m.onnx")
    assert report.opset >= 19 and report.cache_dtypes == ()
    casts = [n for n in onnx.load(str(report.path)).graph.node if n.op_type == "Cast"
             and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT8E4M3FN for a in n.attribute)]
    assert len(casts) == 2 * LAYERS


@pytest.mark.slow
def test_model_exporter_passes_quantized_cache(tmp_path) -> None:  # noqa: ANN001
    from quark_brevitas import ModelExporter

    model = _quantized(_config(Dtype.int8))
    ids = _prompt(2, 6, 1)
    args = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    coded = ModelExporter(tmp_path / "coded.onnx").export_onnx_model(model, args, past_key_values=True)
    plain = ModelExporter(tmp_path / "plain.onnx").export_onnx_model(model, args, past_key_values=True,
                                                                      quantized_cache=False)
    assert (coded.cache_dtypes, plain.cache_dtypes) == (("INT8",), ("FLOAT",))


@pytest.mark.slow
def test_quantized_attention_is_in_the_file(exported) -> None:  # noqa: ANN001
    """The query and probability quantizers are traced into the decoder (FP8 ones as the FP8 cache's, opset 19):
    onnxruntime's logits are the quantized attention's, not those of the same model with its attention quantizers
    off."""
    case, model, report = exported
    if not case.endswith("_attention"):
        pytest.skip("a model without attention quantizers")
    prompt = _prompt(2, 5, 4)
    result = greedy_decode(report.path, prompt, torch.ones_like(prompt), steps=0)
    with torch.no_grad(), attention_quantization_disabled(model):
        off = model(input_ids=prompt, attention_mask=torch.ones_like(prompt)).logits[:, -1]
    with torch.no_grad():
        on = model(input_ids=prompt, attention_mask=torch.ones_like(prompt)).logits[:, -1]
    tolerance = 1e-4 * max(1.0, float(on.abs().max()))
    assert float((result.logits[0] - on).abs().max()) <= tolerance
    assert float((on - off).abs().max()) > 100 * tolerance
