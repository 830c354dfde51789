"""Quantize a Hugging Face transformer (a tiny, randomly initialised BERT) to W8A8.

Nothing is downloaded: the model is built from a ``BertConfig`` with random weights, and a real
WordPiece tokenizer is built from a vocabulary file this script writes to a temporary directory.
Calibration batches are the tokenizer's outputs (dicts of ``input_ids``, ``token_type_ids``,
``attention_mask``), which the quantizer passes to the model as keyword arguments. Every
``nn.Linear`` (attention projections, feed-forward layers, pooler, classifier) becomes a Brevitas
``QuantLinear``; embeddings, LayerNorm and softmax stay in float.

Transformers cannot be FX-traced, so the default ``Preprocess`` step logs one warning and leaves
the model as it is; that is expected.

Run: ``python examples/huggingface_bert.py`` (offline, < 1 minute; needs ``transformers``).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from quark_brevitas import ModelQuantizer
from quark_brevitas.presets import get_preset

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
torch.manual_seed(0)

# A toy corpus and the vocabulary it needs (BERT's special tokens first).
SENTENCES = [
    "the movie was great", "i loved the acting", "the plot was terrible", "what a boring film",
    "the music was good and the story was great", "i hated every minute", "a truly wonderful cast",
    "the ending was bad", "great film with a good plot", "the acting was not good",
    "i would watch it again", "the story made no sense", "a fun and moving film",
    "the dialogue was awful", "one of the best movies", "too long and too slow",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = sorted({word for sentence in SENTENCES for word in sentence.split()})

with tempfile.TemporaryDirectory() as tmp:
    # A directory holding vocab.txt is a complete local BERT tokenizer: from_pretrained reads it
    # without network access (this works in transformers 4.x and 5.x alike).
    (Path(tmp) / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    tokenizer = BertTokenizerFast.from_pretrained(tmp)
assert tokenizer.unk_token_id not in tokenizer("the movie was great")["input_ids"], "vocabulary not loaded"

# A tiny BERT with random weights: 2 layers, hidden size 32. The initialisation is wider than BERT's
# 0.02 so that the untrained model's logits differ visibly between sentences.
config = BertConfig(
    vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=64, num_labels=2, initializer_range=0.2,
)
float_model = BertForSequenceClassification(config).eval()


def encode(sentences: list[str]) -> dict[str, torch.Tensor]:
    """Tokenize to fixed-length tensors; a plain dict of keyword arguments for the model."""
    return dict(tokenizer(sentences, padding="max_length", max_length=16, truncation=True, return_tensors="pt"))


# Calibration "loader": any re-iterable of batches works, here a list of 4 tokenizer outputs.
calib_loader = [encode(SENTENCES[i:i + 4]) for i in range(0, 16, 4)]
test_batch = encode(["the film was wonderful", "i hated the story", "a great cast and a bad plot"])

# Quantize with the default W8A8 preset: int8 weights and inputs of every Linear, int32 biases.
quant_model = ModelQuantizer(get_preset("w8a8")).quantize_model(float_model, calib_loader)

n_quant = sum(type(m).__name__ == "QuantLinear" for m in quant_model.modules())
n_linear = sum(isinstance(m, torch.nn.Linear) for m in float_model.modules())
print(f"quantized {n_quant} of {n_linear} Linear layers")

with torch.no_grad():
    float_logits = float_model(**test_batch).logits
    quant_logits = quant_model(**test_batch).logits
error = (quant_logits - float_logits).abs().max().item()
relative = ((quant_logits - float_logits).norm() / float_logits.norm()).item()
print("float logits:    ", [[round(v, 4) for v in row] for row in float_logits.tolist()])
print("quantized logits:", [[round(v, 4) for v in row] for row in quant_logits.tolist()])
print(f"max |difference| {error:.4f}, relative error {100 * relative:.2f} %, same predicted class: "
      f"{(float_logits.argmax(-1) == quant_logits.argmax(-1)).tolist()}")
