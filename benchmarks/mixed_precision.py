"""Automatic mixed precision against uniform and random assignments at the same average weight bits, on the
digits CNN and a small transformer, printed as a table; the metric-vs-bits (Pareto) chart as PNG.

Run: ``python -m benchmarks.mixed_precision [--output DIR]`` (a few minutes on 2 cores). Both models are trained
here on scikit-learn's digits (the transformer is ``formats.DigitsTransformer``: each 8x8 image as 8 tokens of 8
pixels, two encoder blocks). Candidates per layer: W8A8, W4A8, W3A8, W2A8 (int weights per output channel, int8
per-tensor inputs, int32 bias). The automatic assignment is chosen on the *calibration* batches only (output SQNR
against the float model, :func:`quark_brevitas.analysis.search_mixed_precision`); every number in the table is
accuracy on the held-out test split (450 images). Random assignments: 10 drawn uniformly (seeded) from all
assignments whose average weight bits lie within [0.9 x budget, budget] (0.8 or 0.7 x if that window is empty).

Uniform W4A8 per-channel loses nothing on either digits model, so a third model shows a budget that uniform W4
misses: the same CNN with an outlier feature (:func:`with_outlier_feature`, 8x; the float function is unchanged),
quantized without graph equalization (which would undo it).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import pathlib
import random
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

from benchmarks.formats import DigitsTransformer, train_transformer
from benchmarks.tables import format_table
from quark_brevitas import Config, ModelQuantizer, QLayerConfig, algos
from quark_brevitas.analysis import (
    CANDIDATES,
    CandidateMeasurements,
    measure_candidates,
    mixed_precision_config,
    plot_pareto,
    search_mixed_precision,
)
from quark_brevitas.cli.digits import evaluate, load_digits_data, train_digits_cnn

CANDIDATE_NAMES = ("w8a8", "w4a8", "w3a8", "w2a8")
RANDOM_DRAWS = 10
OUTLIER_SCALE = 8.0


def with_outlier_feature(model: nn.Module, scale: float = OUTLIER_SCALE) -> nn.Module:
    """The same function with an outlier feature, as large language models have: the most used hidden feature of
    fc1 scaled down ``scale`` times and fc2's matching input column scaled up as much (ReLU commutes with positive
    scales), so per-output-channel weight scales of fc2 must span that column."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        k = int(model.fc2.weight.abs().sum(dim=0).argmax())
        model.fc1.weight[k] /= scale
        model.fc1.bias[k] /= scale
        model.fc2.weight[:, k] *= scale
    return model


def _accuracy(model: nn.Module, config: Config, data) -> float:
    return evaluate(ModelQuantizer(config).quantize_model(model, data.calib), data.test)


def _random_assignments(m: CandidateMeasurements, budget: float, rng: random.Random) -> tuple[list[list[int]], float]:
    """Up to 10 assignments drawn from those within [low x budget, budget], low = 0.9 (0.8, 0.7 if that window
    is empty), and the low end used."""
    every = [list(a) for a in itertools.product(range(len(m.candidates)), repeat=len(m.names))]
    for low in (0.9, 0.8, 0.7):
        window = [a for a in every if low * budget <= m.average_bits(a) <= budget]
        if window:
            return rng.sample(window, min(RANDOM_DRAWS, len(window))), low
    return [], low


def _run(label: str, model: nn.Module, base: Config, data, output: pathlib.Path) -> list[tuple[str, ...]]:
    candidates = [CANDIDATES[name] for name in CANDIDATE_NAMES]
    start = time.perf_counter()
    m = measure_candidates(model, candidates, data.calib, base_config=base)
    measure_s = time.perf_counter() - start

    def config_of(assignment: list[int]) -> Config:
        return mixed_precision_config(model, m.layer_configs(assignment), base)

    uniform = {name: [j] * len(m.names) for j, name in enumerate(CANDIDATE_NAMES)}
    uniform_acc = {name: _accuracy(model, config_of(a), data) for name, a in uniform.items()}
    w8a8 = uniform_acc["w8a8"]
    float_acc = evaluate(model, data.test)
    rng = random.Random(0)
    rows, checks = [], []
    series: dict[str, list[tuple[float, float]]] = {"automatic": [], "uniform": [], "random": []}
    for name in CANDIDATE_NAMES:
        series["uniform"].append((m.average_bits(uniform[name]), uniform_acc[name]))
    budgets = [(f"uniform {name}", m.average_bits(uniform[name])) for name in ("w4a8", "w3a8")]
    budgets += [("between w2 and w3", (m.average_bits(uniform["w2a8"]) + m.average_bits(uniform["w3a8"])) / 2),
                ("between w4 and w8", (m.average_bits(uniform["w4a8"]) + m.average_bits(uniform["w8a8"])) / 2)]
    for title, budget in budgets:
        start = time.perf_counter()
        search = search_mixed_precision(model, candidates, data.calib, budget_bits=budget, base_config=base,
                                        measurements=m)
        search_s = time.perf_counter() - start
        auto_acc = evaluate(ModelQuantizer(search.config).quantize_model(model, data.calib), data.test)
        auto_bits = m.average_bits(search.assignment)
        series["automatic"].append((auto_bits, auto_acc))
        drawn, low = _random_assignments(m, budget, rng)
        randoms = [(m.average_bits(a), _accuracy(model, config_of(a), data)) for a in drawn]
        series["random"].extend(randoms)
        median = statistics.median(acc for _, acc in randoms) if randoms else float("nan")
        uniform_here = title.removeprefix("uniform ") if title.startswith("uniform") else None
        rows.append((label, title, f"{budget:.3f}", f"{uniform_acc[uniform_here]:.2f}" if uniform_here else "-",
                     f"{auto_acc:.2f} ({auto_bits:.3f} b)", f"{median:.2f}",
                     f"{min(a for _, a in randoms):.2f}-{max(a for _, a in randoms):.2f}"
                     + (f" (n={len(randoms)}, >= {low:.1f} x budget)" if len(randoms) < RANDOM_DRAWS or low < 0.9
                        else "") if randoms else "-",
                     f"{w8a8:.2f}", " ".join(CANDIDATE_NAMES[c].removesuffix("a8") for c in search.assignment),
                     f"{search_s:.1f}"))
        if uniform_here == "w4a8" and not label.endswith("feature"):
            checks.append((f"{label}: auto >= uniform W4A8 at its budget", auto_acc >= uniform_acc["w4a8"],
                           f"{auto_acc:.2f} vs {uniform_acc['w4a8']:.2f}"))
            checks.append((f"{label}: auto > median of {len(randoms)} random at that budget", auto_acc > median,
                           f"{auto_acc:.2f} vs {median:.2f}"))
        if uniform_here and w8a8 - uniform_acc[uniform_here] > 1.0:
            checks.append((f"{label}: at the budget uniform {uniform_here} misses W8A8 by > 1 point, auto within 0.5 "
                           "point of W8A8", w8a8 - auto_acc <= 0.5,
                           f"uniform {uniform_acc[uniform_here]:.2f}, auto {auto_acc:.2f}, W8A8 {w8a8:.2f}"))
    low_bits, high_bits = m.average_bits(uniform["w2a8"]), m.average_bits(uniform["w8a8"])
    for budget in [low_bits + (high_bits - low_bits) * i / 8 for i in range(1, 9)]:  # more points for the curve
        search = search_mixed_precision(model, candidates, data.calib, budget_bits=budget, base_config=base,
                                        measurements=m)
        auto = evaluate(ModelQuantizer(search.config).quantize_model(model, data.calib), data.test)
        series["automatic"].append((m.average_bits(search.assignment), auto))
    stem = "".join(ch if ch.isalnum() else "_" for ch in label).replace("__", "_")
    png = plot_pareto(series, output / f"mixed_precision_{stem}.png", metric="test accuracy (%)",
                      title=f"{label}: accuracy against average weight bits (float {float_acc:.2f} %)",
                      lines=["automatic", "uniform"])
    print(f"{label}: float {float_acc:.2f} %, uniform " + ", ".join(f"{n} {a:.2f} %" for n, a in uniform_acc.items())
          + f"; per-layer measurements {measure_s:.1f} s ({len(m.names)} layers x {len(candidates)} candidates); "
          f"chart {png}")
    return rows, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None,
                        help="directory for the PNG charts (default: a new folder in the system's temporary directory)")
    args = parser.parse_args()
    logging.getLogger("quark_brevitas").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    output = pathlib.Path(args.output) if args.output else pathlib.Path(tempfile.mkdtemp(prefix="mixed_precision_"))
    print(f"charts go to {output}")
    data = load_digits_data()
    all_rows, all_checks = [], []
    # The transformer's forward is not FX-traceable as Preprocess wants it: no pre-quantization steps.
    # Graph equalization would undo the outlier feature (it rescales exactly such channels): off for that model.
    cnn = train_digits_cnn(data)
    no_equalization = Config(QLayerConfig(), pre_quant_opt_config=[algos.Preprocess(equalize_iterations=0)])
    transformer: DigitsTransformer = train_transformer(data)
    for label, model, base in (("digits CNN", cnn, Config(QLayerConfig())),
                               ("digits transformer", transformer, Config(QLayerConfig(), pre_quant_opt_config=[])),
                               ("digits CNN, outlier feature", with_outlier_feature(cnn), no_equalization)):
        rows, checks = _run(label, model, base, data, output)
        all_rows += rows
        all_checks += checks
    header = ("model", "budget", "avg weight bits", "uniform %", "automatic %", "random median %", "random range %",
              "W8A8 %", "automatic assignment (layer order)", "search s")
    print(f"\ntest accuracy on {len(data.test.dataset)} digits images; automatic chosen on calibration data only")
    print(format_table(header, all_rows))
    print()
    for name, ok, detail in all_checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
