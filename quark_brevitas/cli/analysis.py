"""``quark-brevitas analyze`` / ``autoconfig``: per-layer error, sensitivity and a mixed-precision config for
the built-in example (:mod:`quark_brevitas.analysis`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.cli.options import CLIError, resolve_config
from quark_brevitas.extras import available, install_hint
from quark_brevitas.outputs import write_file

logger = logging.getLogger("quark_brevitas.cli")


@dataclass(frozen=True)
class _Subject:
    """What the analysis commands work on: a float model, calibration batches, a test metric and their label."""

    model: nn.Module
    calib: Any
    evaluate: Any
    label: str


def _analysis_subject(args: argparse.Namespace) -> _Subject:
    """The built-in digits CNN, trained now, with its calibration batches and test accuracy."""
    from quark_brevitas.cli.digits import evaluate, load_digits_data, train_digits_cnn

    data = load_digits_data(seed=args.seed)
    model = train_digits_cnn(data, epochs=args.epochs, seed=args.seed)
    return _Subject(model, data.calib, lambda m: evaluate(m, data.test), "digits CNN")


def cmd_analyze(args: argparse.Namespace) -> int:
    from quark_brevitas import analysis

    config, source = resolve_config(args)
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise CLIError(f"--output {str(output)!r} exists and is not a directory")
    subject = _analysis_subject(args)
    ModelQuantizer(config).plan(subject.model)
    quant = ModelQuantizer(config).quantize_model(subject.model, subject.calib)
    layers = analysis.compare_layers(subject.model, quant, subject.calib, max_batches=args.batches)
    ranking = analysis.sensitivity(subject.model, config, subject.calib, exact=args.exact,
                                   max_batches=None if args.exact else args.batches)
    written = [*analysis.write_rows(layers, output, "layers"), *analysis.write_rows(ranking, output, "sensitivity")]
    if not args.no_plots and not available("matplotlib"):
        # The tables and files are the result; the pictures are optional and need an extra.
        logger.warning("plots skipped: they need matplotlib, which is not installed; install it with %s (or pass "
                       "--no-plots)", install_hint("matplotlib"))
    elif not args.no_plots:
        written.append(analysis.plot_layer_sqnr(layers, output / "layers.png",
                                                title=f"{subject.label}, {source}: error per layer"))
        written.append(analysis.plot_sensitivity(ranking, output / "sensitivity.png",
                                                 title=f"{subject.label}, {source}: sensitivity per layer"))
    print(f"{subject.label}, {source}: float accuracy {subject.evaluate(subject.model):.2f} %, quantized "
          f"{subject.evaluate(quant):.2f} %\n")
    print(analysis.layer_table(layers), end="\n\n")
    print(analysis.sensitivity_table(ranking), end="\n\n")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _candidates(text: str | None) -> list[Any]:
    from quark_brevitas.analysis import CANDIDATES, DEFAULT_CANDIDATES

    names = list(DEFAULT_CANDIDATES) if text is None else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CANDIDATES]
    if unknown or not names:
        raise CLIError(f"--candidates: unknown {unknown or 'empty list'}; allowed: {', '.join(CANDIDATES)}")
    return [CANDIDATES[name] for name in names]


def cmd_autoconfig(args: argparse.Namespace) -> int:
    from quark_brevitas import analysis
    from quark_brevitas.backend import plan_table

    if args.budget_bits is None and args.budget_bytes is None and args.min_metric is None:
        raise CLIError("give a budget: --budget-bits, --budget-bytes or --min-metric")
    candidates = _candidates(args.candidates)
    output = Path(args.output)
    if output.is_dir():
        raise CLIError(f"--output {str(output)!r} is a directory; give a .yaml file name")
    subject = _analysis_subject(args)
    search = analysis.search_mixed_precision(
        subject.model, candidates, subject.calib, budget_bits=args.budget_bits, budget_bytes=args.budget_bytes,
        min_metric=args.min_metric, exact=args.exact, max_batches=None if args.exact else args.batches,
        refine=args.refine)
    output.parent.mkdir(parents=True, exist_ok=True)
    text = search.config.to_yaml()
    write_file(output, lambda tmp: tmp.write_text(text))
    quant = ModelQuantizer(search.config).quantize_model(subject.model, subject.calib)
    size = analysis.model_size(subject.model, search.config)
    print(f"{subject.label}: one format per layer from {','.join(analysis.candidate_label(c) for c in candidates)}")
    print(analysis.format_table(search.rows(), [("name", "layer"), ("module_type", "type"), ("candidate", "format"),
                                                ("average_weight_bits", "weight bits"),
                                                ("alone_sqnr_db", "output SQNR alone (dB)")]))
    print(f"\naverage weight bits {size.average_weight_bits:.3f}, model size {size.total_bytes:.0f} bytes; "
          f"{search.metric_name} {search.metric:.2f} (measured on {len(search.tried)} proposals)")
    print(f"test accuracy: float {subject.evaluate(subject.model):.2f} %, this config {subject.evaluate(quant):.2f} %")
    print(f"\n{plan_table(ModelQuantizer(search.config).plan(subject.model))}\n")
    print(f"wrote {output} (run it: quark-brevitas quantize --config {output})")
    return 0
