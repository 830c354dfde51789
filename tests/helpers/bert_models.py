"""Tiny random-weight BERTs with a word-level WordPiece tokenizer, for the ONNX export tests of Hugging Face
encoders (``tests/export/onnx/test_hf_export.py``, ``test_bert_presets.py``): real tokenizer dicts (padding,
attention masks, token types) on a model small enough to export in a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

#: The tokenizer's words (after BERT's five special tokens): the test sentences use only these.
WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "quick", "brown", "fox", "jumps", "over",
         "river", "slowly", "green", "house", "under", "bridge"]


def word_tokenizer(folder: Path) -> Any:
    """A ``BertTokenizerFast`` over ``[PAD] [UNK] [CLS] [SEP] [MASK]`` and :data:`WORDS` (``folder/vocab.txt``)."""
    transformers = pytest.importorskip("transformers")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


def bert_for(tokenizer: Any, attn: str | None = None, layers: int = 2) -> nn.Module:
    """A seeded ``BertModel`` 32 wide over ``tokenizer``'s vocabulary, with weights initialised wider than BERT's
    default (``initializer_range=0.2``: activations with a range worth quantizing); ``attn`` picks the attention
    implementation (``"sdpa"``, ``"eager"``; transformers' default when None)."""
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                     initializer_range=0.2, **({"attn_implementation": attn} if attn else {}))
    return transformers.BertModel(config).eval()
