"""Decoder LMs exported with their key/value cache as graph inputs and outputs (``past_key_values=True``).

Each file is run in onnxruntime the way a user decodes: a prompt step with empty pasts, then greedy steps of one
token feeding the presents back as pasts. The reference is independent of the export: PyTorch's own incremental
decoding of the quantized model with its ``DynamicCache``. Tiny W8A8 (per-channel weights) GPT-2, Llama (grouped-query
attention, 4 query heads on 2 key/value heads) and OPT built from transformers configs.
"""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.calibration.data import cache_keyword, output_cache  # noqa: E402
from quark_brevitas.export import ExportError, export_onnx_qcdq, run_onnx, verify_onnx  # noqa: E402
from quark_brevitas.export.args import normalize_example  # noqa: E402
from quark_brevitas.export.onnx.decode import torch_greedy_decode  # noqa: E402
from quark_brevitas.export.onnx.kv import TOTAL, export_module, with_past  # noqa: E402
from quark_brevitas.export.onnx.pinned import check_pinned  # noqa: E402
from quark_brevitas.export.onnx.runtime import run_model_proto  # noqa: E402
from quark_brevitas.export.onnx.verify import compute_reference, exported_module  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

VOCAB = 50
LAYERS = 2


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).eval()


def _opt() -> torch.nn.Module:
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=LAYERS,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32)
    return transformers.OPTForCausalLM(config).eval()


def _tokens(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _w8a8() -> Config:
    return Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel),
                               input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)))


@pytest.fixture(scope="module", params=[_gpt2, _llama, _opt], ids=["gpt2", "llama", "opt"])
def kv_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module,
                                                                                                   object]:
    torch.manual_seed(0)
    model = request.param()
    ids = _tokens((3, 10), 0)
    quant = ModelQuantizer(_w8a8()).quantize_model(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    prompt = _tokens((2, 6), 1)
    path = tmp_path_factory.mktemp(request.param.__name__.strip("_")) / "decoder.onnx"
    report = export_onnx_qcdq(quant, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, path,
                              past_key_values=True)
    return quant, report


def _pasts(feed: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    for i in range(LAYERS):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = outputs[f"present.{i}.{kind}"]


def _decode_onnx(path: pathlib.Path, prompt: torch.Tensor, mask: torch.Tensor, kv_heads: int, head_dim: int,
                 steps: int) -> tuple[list[np.ndarray], list[int], list[dict[str, np.ndarray]]]:
    """Greedy decoding in onnxruntime: prompt step with pasts of length 0, then one token a step."""
    batch = prompt.shape[0]
    feed = {"input_ids": prompt.numpy(), "attention_mask": mask.numpy()}
    for name in (f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")):
        feed[name] = np.zeros((batch, kv_heads, 0, head_dim), np.float32)
    logits, tokens, all_outputs = [], [], []
    names = [o.name for o in onnx.load(str(path)).graph.output]
    for _ in range(steps + 1):
        outputs = dict(zip(names, run_onnx(path, feed)))
        all_outputs.append(outputs)
        logits.append(outputs["logits"])
        nxt = outputs["logits"][:, -1].argmax(-1)
        tokens.append(nxt.tolist())
        _pasts(feed, outputs)
        feed["input_ids"] = nxt[:, None].astype(np.int64)
        feed["attention_mask"] = np.concatenate([feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1)
    return logits, tokens, all_outputs


def _kv_shape(model: torch.nn.Module) -> tuple[int, int]:
    config = model.config
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", heads) or heads, config.hidden_size // heads


def test_graph_names_and_symbolic_axes(kv_export: tuple[torch.nn.Module, object]) -> None:
    _, report = kv_export
    pasts = tuple(f"past_key_values.{i}.{k}" for i in range(LAYERS) for k in ("key", "value"))
    presents = tuple(f"present.{i}.{k}" for i in range(LAYERS) for k in ("key", "value"))
    assert report.input_names == ("input_ids", "attention_mask", *pasts)
    assert report.output_names == ("logits", *presents)
    graph = onnx.load(str(report.path)).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*graph.input, *graph.output)}
    assert dims["input_ids"] == ["batch", "sequence"]
    assert dims["attention_mask"] == ["batch", TOTAL]
    assert dims["past_key_values.1.value"][0] == "batch" and dims["past_key_values.1.value"][2] == "past_sequence"
    assert dims["present.0.key"][0] == "batch" and dims["present.0.key"][2] == TOTAL
    assert dims["logits"][:2] == ["batch", "sequence"]
    assert report.weight_dtypes == ("INT8",)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
def test_incremental_decoding_in_onnxruntime_matches_pytorch(kv_export: tuple[torch.nn.Module, object],
                                                             padded: bool) -> None:
    model, report = kv_export
    prompt = _tokens((3, 5), 2)  # another batch size and prompt length than the export's example
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :2] = 0  # left padding of the second row
    kv_heads, head_dim = _kv_shape(model)
    onnx_logits, onnx_tokens, outputs = _decode_onnx(report.path, prompt, mask, kv_heads, head_dim, steps=2)
    ref_tokens, ref_logits = torch_greedy_decode(model, prompt, mask, steps=2)
    ref_tokens, ref_logits = ref_tokens.T.tolist(), [x.numpy() for x in ref_logits]
    assert [o["present.1.value"].shape[2] for o in outputs] == [5, 6, 7]  # the cache grows by the tokens fed
    assert [x.shape for x in onnx_logits] == [(3, 5, VOCAB), (3, 1, VOCAB), (3, 1, VOCAB)]
    for step, (ours, ref) in enumerate(zip(onnx_logits, ref_logits)):
        rows = slice(None) if not padded or step else [0, 2]  # padded query positions are meaningless
        diff = float(np.abs(ours[rows] - ref[rows]).max())
        assert diff <= report.tolerance, (step, diff, report.tolerance)
    assert onnx_tokens == ref_tokens


def test_pinned_check_matches_the_quantizers_through_the_cache_wrapper(kv_export: tuple[torch.nn.Module,
                                                                                         object]) -> None:
    """The pinned verification (used when rounding flips exceed the output tolerance) finds the file's quantizers
    under the wrapper's module paths and accepts the file; run directly here, the outputs being within tolerance."""
    model, report = kv_export
    prompt = _tokens((2, 6), 1)
    example = with_past(model, normalize_example({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}))
    called = export_module(model, example)
    reference = compute_reference(called, example.tensors)
    summary = check_pinned(onnx.load(str(report.path)), exported_module(called, reference), example.tensors,
                           example.names, reference.outputs, report.tolerance, report.path, run_model_proto)
    quantized_inputs = sum(1 for m in model.modules() if type(m).__name__ in ("QuantLinear", "QuantConv1D"))
    assert summary.pinned >= quantized_inputs - 1 and not summary.unpinned  # lm_head's input may share a tensor


def test_user_given_past_exports_and_verify_onnx_takes_it(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = _llama()
    ids = _tokens((2, 8), 0)
    quant = ModelQuantizer(_w8a8()).quantize_model(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    with torch.no_grad():
        past = output_cache(quant(input_ids=ids[:, :4], use_cache=True))
    example = {"input_ids": ids[:, 4:], "attention_mask": torch.ones_like(ids)}
    for i, layer in enumerate(past.layers):
        example[f"past_key_values.{i}.value"] = layer.values  # values before keys: reordered in the graph
        example[f"past_key_values.{i}.key"] = layer.keys
    report = ModelExporter(tmp_path / "given.onnx").export_onnx_model(quant, example, past_key_values=True)
    assert report.input_names[:4] == ("input_ids", "attention_mask", "past_key_values.0.key",
                                      "past_key_values.0.value")
    other = _tokens((3, 9), 5)  # an independent check on another batch: PyTorch on a past of 7 tokens
    with torch.no_grad():
        other_past = output_cache(quant(input_ids=other[:, :7], use_cache=True))
    feed = {"input_ids": other[:, 7:], "attention_mask": torch.ones_like(other)}
    for i, layer in enumerate(other_past.layers):
        feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = layer.keys, layer.values
    result = verify_onnx(quant, feed, report.path)
    assert result.max_abs_diff <= result.tolerance or result.pinned is not None


def test_encoder_asking_for_past_key_values_gets_a_clear_error(tmp_path: pathlib.Path) -> None:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    bert = transformers.BertModel(config).eval()  # its forward takes past_key_values, but it keeps no cache
    ids = _tokens((2, 6), 0)
    with pytest.raises(ExportError, match="BertModel called with use_cache=True returned no key/value cache.*"
                                          "past_key_values=True exports decoder language models"):
        export_onnx_qcdq(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "b.onnx",
                         past_key_values=True)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ExportError, match="Sequential.forward takes no cache / past_key_values / use_cache"):
        export_onnx_qcdq(mlp, torch.randn(1, 4), tmp_path / "m.onnx", past_key_values=True)
    assert not list(tmp_path.iterdir())


def test_examples_a_cached_export_cannot_use(kv_export: tuple[torch.nn.Module, object],
                                             tmp_path: pathlib.Path) -> None:
    model, _ = kv_export
    ids = _tokens((2, 2), 0)
    with pytest.raises(ExportError, match="at least 3 tokens"):
        export_onnx_qcdq(model, {"input_ids": ids}, tmp_path / "short.onnx", past_key_values=True)
    with pytest.raises(ExportError, match="dict of keyword tensors"):
        export_onnx_qcdq(model, (ids,), tmp_path / "positional.onnx", past_key_values=True)
    with pytest.raises(ExportError, match=r"missing: past_key_values\.1\.key"):
        export_onnx_qcdq(model, {"input_ids": ids, "past_key_values.0.key": torch.zeros(2, 2, 1, 16),
                                 "past_key_values.0.value": torch.zeros(2, 2, 1, 16)}, tmp_path / "half.onnx")


class _Renamed(torch.nn.Module):
    """A decoder whose forward names its cache ``name`` and returns it under that key, whatever the installed
    transformers calls it: ``cache`` (transformers >= 5.24) or ``past_key_values`` (earlier releases and remote
    code written for them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def _call(self, name: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: object,
              use_cache: bool | None) -> dict[str, object]:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache,
                         **{cache_keyword(self.model): cache})
        return {"logits": out.logits, name: output_cache(out)}


class _NewNaming(_Renamed):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: object = None,
                use_cache: bool | None = None) -> dict[str, object]:
        return self._call("cache", input_ids, attention_mask, cache, use_cache)


class _OldNaming(_Renamed):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: object = None, use_cache: bool | None = None) -> dict[str, object]:
        return self._call("past_key_values", input_ids, attention_mask, past_key_values, use_cache)


@pytest.mark.parametrize("naming", [_NewNaming, _OldNaming], ids=["cache", "past_key_values"])
def test_cached_export_follows_the_models_cache_argument_name(naming: type[_Renamed], tmp_path: pathlib.Path) -> None:
    """transformers 5.24 renamed forward's past_key_values to cache (and the output field with it): the export finds
    the name in the model's signature, so decoders of either naming export, whatever transformers is installed."""
    torch.manual_seed(0)
    model = naming(_llama())
    assert cache_keyword(model) == ("cache" if naming is _NewNaming else "past_key_values")
    prompt = _tokens((2, 6), 1)
    report = export_onnx_qcdq(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                              tmp_path / "renamed.onnx", past_key_values=True)
    assert report.input_names[2:] == tuple(f"past_key_values.{i}.{k}" for i in range(LAYERS) for k in ("key", "value"))
    assert report.output_names == ("logits", *(f"present.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")))
    assert report.max_abs_diff <= 1e-4
