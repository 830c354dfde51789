"""The BERT part of a GGUF file: llama.cpp's ``bert`` architecture (sentence-embedding encoders such as
all-MiniLM-L6-v2), written as llama.cpp's converter (``convert_hf_to_gguf.py``, ``BertModel``) writes it.

Why its own module: a BERT file differs from a decoder's in three things that do not depend on how the weights are
packed, so they live beside :mod:`quark_brevitas.export.gguf.writer`, which packs the tensors:

- hyperparameters: ``bert.*`` context / embedding / feed-forward lengths, head count, LayerNorm epsilon,
  ``bert.attention.causal = false`` and ``bert.pooling_type`` (how llama.cpp turns token states into one
  sentence embedding), read from the sentence-transformers ``modules.json`` / ``1_Pooling/config.json`` beside the
  model (``mean``, ``cls`` or ``last``; none there: no pooling key, llama.cpp's default);
- the WordPiece vocabulary (``tokenizer.ggml.model = "bert"``): tokens in llama.cpp's "phantom space" form (a word
  start ``w`` as ``"\\u2581w"``, a continuation ``##w`` as ``w``, bracketed specials kept), the number of token
  types (``type_vocab_size``) and the special ids (cls / sep / pad / unk / mask, plus bos = cls and eos = sep) as
  the ``gguf`` package's :class:`gguf.SpecialVocab` reads them from the tokenizer files;
- the pooler (``pooler.dense``) is not written: llama.cpp pools by ``pooling_type`` and has no such tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.gguf.tokenizer import WORDPIECE_HOLDS, read_tokenizer_json

__all__ = ["BERT_DROPPED", "add_bert_architecture", "add_wordpiece_tokenizer", "pooling_type"]

#: Parameters of a Hugging Face ``BertModel`` that llama.cpp's converter leaves out (llama.cpp pools itself).
BERT_DROPPED = ("pooler.",)
#: sentence-transformers Pooling flags -> llama.cpp's pooling type name (``gguf.PoolingType``), in the converter's
#: order of preference.
_POOLING_FLAGS = (("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
                  ("pooling_mode_lasttoken", "LAST"))


def pooling_type(folder: Path | None) -> str | None:
    """The pooling of the sentence-transformers model in ``folder`` (``"MEAN"``, ``"CLS"``, ``"LAST"``), ``None``
    when the folder has no ``modules.json`` with a Pooling module; ExportError for a pooling llama.cpp lacks."""
    modules = None if folder is None else folder / "modules.json"
    if modules is None or not modules.is_file():
        return None
    entries = json.loads(modules.read_text(encoding="utf-8"))
    pooling = next((entry for entry in entries if entry.get("type") == "sentence_transformers.models.Pooling"), None)
    if pooling is None:
        return None
    settings = json.loads((folder / pooling["path"] / "config.json").read_text(encoding="utf-8"))
    for flag, name in _POOLING_FLAGS:
        if settings.get(flag):
            return name
    raise ExportError(f"{str(folder / pooling['path'] / 'config.json')!r}: llama.cpp pools sentence embeddings by "
                      "the mean, the CLS token or the last token only; this model pools otherwise")


def add_bert_architecture(writer: Any, gguf: Any, config: Any, name: str, folder: Path | None) -> None:
    """BERT's hyperparameters as llama.cpp's ``bert`` architecture reads them, and its pooling."""
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ExportError(f"BERT with position_embedding_type={config.position_embedding_type!r}: llama.cpp's bert "
                          "architecture has learned absolute positions only")
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_layer_norm_eps(float(config.layer_norm_eps))
    writer.add_causal_attention(False)
    pooling = pooling_type(folder)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType[pooling])


def _phantom(token: str) -> str:
    """llama.cpp's WordPiece spelling: word starts carry a leading U+2581, ``##`` continuations lose the ``##``."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def add_wordpiece_tokenizer(writer: Any, gguf: Any, path: Path, config: Any) -> None:
    """``tokenizer.json``'s WordPiece vocabulary as llama.cpp's ``bert`` tokenizer (ids beyond the vocabulary up
    to ``vocab_size`` as unused ``[PAD<id>]`` tokens; added special tokens as control tokens)."""
    _, vocab, special = read_tokenizer_json(path, "WordPiece", WORDPIECE_HOLDS)
    count = max(max(vocab.values()) + 1, int(getattr(config, "vocab_size", 0) or 0))
    if count > int(config.vocab_size):
        raise ExportError(f"tokenizer {str(path / 'tokenizer.json')!r} has ids up to {count - 1}, beyond the model's "
                          f"embedding ({config.vocab_size} rows, config.vocab_size)")
    tokens: list[str | None] = [None] * count
    for token, index in vocab.items():
        tokens[index] = token
    writer.add_token_type_count(int(getattr(config, "type_vocab_size", 1) or 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"[PAD{i}]" if token is None else _phantom(token) for i, token in enumerate(tokens)])
    writer.add_token_types([gguf.TokenType.UNUSED if token is None else gguf.TokenType.CONTROL if i in special
                            else gguf.TokenType.NORMAL for i, token in enumerate(tokens)])
    roles = [role for role in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
             if hasattr(writer, f"add_{role}_token_id")]  # the ones this gguf version's writer has a key for
    gguf.SpecialVocab(path, special_token_types=roles, n_vocab=count).add_to_gguf(writer, quiet=True)
