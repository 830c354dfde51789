"""The tokenizer part of a GGUF file: where the model's tokenizer is, whether its ids fit the embedding, and the
``tokenizer.ggml.*`` metadata llama.cpp reads (byte-level BPE vocabulary, merges, special ids, padding to the
model's ``vocab_size`` with unused ``[PAD<id>]`` tokens as llama.cpp's converter writes them).

Why its own module: it is one concept (the vocabulary), checked before calibration by
:func:`quark_brevitas.hf.plan_checks.check_gguf_plan` and written by :mod:`quark_brevitas.export.gguf.writer`, and it
does not depend on how the weights are packed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.export.errors import ExportError

__all__ = ["add_tokenizer", "check_tokenizer_fits", "read_tokenizer_json", "tokenizer_dir_of"]

logger = logging.getLogger("quark_brevitas.export.gguf.writer")


def tokenizer_dir_of(model: nn.Module, tokenizer_path: str | os.PathLike[str] | None) -> Path | None:
    if tokenizer_path is not None:
        path = Path(tokenizer_path)
        if not (path / "tokenizer.json").is_file():
            raise ExportError(f"tokenizer_path {str(path)!r} has no tokenizer.json (a Hugging Face fast tokenizer); "
                              "GGUF export reads its vocabulary and merges from that file")
        return path
    source = Path(str(getattr(getattr(model, "config", None), "name_or_path", "") or ""))
    if str(source) and (source / "tokenizer.json").is_file():
        return source
    logger.warning("export_gguf: no tokenizer given (tokenizer_path) or beside the model; the file has no "
                   "tokenizer, which llama.cpp needs to run it")
    return None


def _special_ids(path: Path, vocab: dict[str, int]) -> dict[str, int]:
    """bos/eos/unk/pad ids from tokenizer_config.json (token strings or added-token dicts)."""
    config_file = path / "tokenizer_config.json"
    settings = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    found: dict[str, int] = {}
    for role in ("bos", "eos", "unk", "pad"):
        token = settings.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in vocab:
            found[role] = vocab[token]
    return found


def read_tokenizer_json(path: Path, model_type: str, holds: str) -> tuple[dict[str, Any], dict[str, int], set[int]]:
    """``tokenizer.json``'s model (which must be of ``model_type``, else an :class:`ExportError` ending in
    ``holds``: what the GGUF file can hold), its vocabulary with the added tokens (token -> id) and the special
    ids. The BPE writer here and the WordPiece one of :mod:`~quark_brevitas.export.gguf.bert` both read it."""
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != model_type:
        raise ExportError(f"tokenizer {str(path / 'tokenizer.json')!r} is a {model.get('type')} model; {holds}")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in data.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
        if added.get("special"):
            special.add(added["id"])
    return model, vocab, special


#: What a BERT GGUF file's tokenizer is (the end of the error for another tokenizer model).
WORDPIECE_HOLDS = "a BERT GGUF holds a WordPiece tokenizer (llama.cpp's 'bert' tokenizer)"


def _read_bpe_tokenizer(path: Path) -> tuple[dict[str, Any], dict[str, int], set[int]]:
    return read_tokenizer_json(path, "BPE", "GGUF export writes byte-level BPE tokenizers (llama.cpp's 'gpt2' "
                                            "tokenizer)")


def check_tokenizer_fits(path: str | os.PathLike[str], vocab_size: int | None, *, wordpiece: bool = False) -> int:
    """The number of ids the tokenizer in ``path`` (``tokenizer.json``) uses, or the :class:`ExportError` that
    names each id beyond the model's embedding (``vocab_size`` rows), its token, and where it came from (the
    BPE vocabulary, or the ``added_tokens`` list, which is where a tokenizer re-saved by transformers gets
    tokens such as Qwen2's ``<|endoftext|>`` that its vocabulary lacked). Called by ``plan`` before any
    calibration and again when the file is written. ``wordpiece``: the model is a BERT, whose GGUF file holds
    a WordPiece tokenizer (llama.cpp's ``bert``) rather than a byte-level BPE."""
    path = Path(path)
    model, vocab, _ = (read_tokenizer_json(path, "WordPiece", WORDPIECE_HOLDS) if wordpiece
                       else _read_bpe_tokenizer(path))
    used = max(vocab.values()) + 1
    if vocab_size is None or used <= vocab_size:
        return used
    base = dict(model["vocab"])
    beyond = sorted((index, token) for token, index in vocab.items() if index >= vocab_size)
    shown = ", ".join(f"{index} {token!r} ({'the vocabulary' if base.get(token) == index else 'added_tokens'})"
                      for index, token in beyond[:5]) + (f" and {len(beyond) - 5} more" if len(beyond) > 5 else "")
    raise ExportError(f"tokenizer {str(path / 'tokenizer.json')!r} has {len(beyond)} token id(s) that the model's "
                      f"embedding ({vocab_size} rows, config.vocab_size) does not have: {shown}. A tokenizer re-saved "
                      "by transformers (save_pretrained) may add special tokens its vocabulary lacks as new ids; give "
                      "the tokenizer files the model was trained with (quark-brevitas keeps them as given)")


def add_tokenizer(writer: Any, gguf: Any, path: Path, pre: str, vocab_size: int | None) -> None:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's ``gpt2`` tokenizer: tokens by id, their
    types (added special tokens are control tokens), merges and the special token ids.

    llama.cpp sizes the embedding from the token list and refuses a file whose table has another number of rows,
    so ids the tokenizer does not use, up to the model's ``vocab_size`` (models pad their vocabulary: Qwen2's
    151,936 rows for 151,665 tokens), are written as unused ``[PAD<id>]`` tokens, as llama.cpp's own converter
    writes them."""
    model, vocab, special = _read_bpe_tokenizer(path)
    used = check_tokenizer_fits(path, vocab_size)
    count = max(used, vocab_size or 0)
    tokens: list[str | None] = [None] * count
    for token, index in vocab.items():
        tokens[index] = token
    types = [gguf.TokenType.UNUSED if token is None else gguf.TokenType.CONTROL if i in special
             else gguf.TokenType.NORMAL for i, token in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([f"[PAD{i}]" if token is None else token for i, token in enumerate(tokens)])
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = _special_ids(path, vocab)
    for role, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if role in ids:
            add(ids[role])


