"""Tiny Hugging Face LLM folders with real tokenizers, shared by the command-line, export and read-back tests.

One place builds them so that the tests which run ``quark-brevitas quantize --model DIR`` on "a tiny Llama with a
byte-level BPE tokenizer" all mean the same folder; each test module still builds its own copy under its own
temporary folder (module-scoped fixtures), so no test sees another's outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.llm_models import bpe_tokenizer

SENTENCE = ("the quick brown fox jumps over a lazy dog while seven small cats sleep near the warm red house and "
            "every bird sings softly in morning light")
WORDS = tuple(dict.fromkeys(SENTENCE.split(" ")))

# Command-line options that keep an LLM run to a few forward passes of a tiny model.
FAST = ["--seq-len", "16", "--batch-size", "2", "--calib-sequences", "4", "--eval-sequences", "2"]


def text(lines: int, seed: int) -> str:
    """``lines`` lines of 12 words drawn from :data:`WORDS` (seeded): calibration/evaluation text a word-level
    or BPE tokenizer trained on the same words tokenizes without unknown tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(lines):
        picks = torch.randint(0, len(WORDS), (12,), generator=generator).tolist()
        rows.append(" ".join(WORDS[i] for i in picks))
    return "\n".join(rows) + "\n"


def word_tokenizer(kind: str):
    """A word-level tokenizer over :data:`WORDS`; ``kind="encoder"`` adds BERT's ``[CLS] ... [SEP]`` template."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if kind == "encoder":
        tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def tiny_llama_folder(root: Path) -> Path:
    """``root/llama``: a 2-block Llama (hidden 32: one GGUF block per row) with a byte-level BPE tokenizer, and
    ``root/calib.txt`` (40 lines of :func:`text`) to calibrate it with. Returns the model folder."""
    transformers = pytest.importorskip("transformers")
    folder = root / "llama"
    tokenizer = bpe_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    (root / "calib.txt").write_text(text(40, seed=1))
    return folder


def saved_llama(folder: Path, *, vocab: int, hidden: int, heads: int, positions: int, layers: int = 3) -> Path:
    """A random-weight Llama (seeded; intermediate size twice ``hidden``, no grouped-query attention) saved in
    ``folder`` without a tokenizer: the float folder the streamed-checkpoint tests quantize one block at a time."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=positions)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder
