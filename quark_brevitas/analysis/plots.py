"""Pictures of the analysis: per-layer SQNR along the depth of the model, the sensitivity ranking, and a
metric-versus-bits (Pareto) chart.

matplotlib is an optional extra (``pip install 'quark_brevitas[plot]'``), imported when a plot is drawn, with
the non-interactive Agg backend (files only, no display needed). Exact values (``inf`` SQNR) are drawn at the
top of the axis, marked "exact".
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quark_brevitas.analysis.report import most_harmful_layer, rows_as_dicts
from quark_brevitas.extras import require
from quark_brevitas.outputs import write_file

__all__ = ["plot_layer_sqnr", "plot_pareto", "plot_sensitivity"]

_HIGHLIGHT = "#d62728"
_NORMAL = "#1f77b4"


def _pyplot() -> Any:
    require("matplotlib", "plots").use("Agg", force=True)  # before pyplot: files only, no display
    return require("matplotlib.pyplot", "plots")


def _finite_cap(values: Sequence[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return (max(finite) if finite else 0.0) + 10.0


def plot_layer_sqnr(rows: Sequence[Any], path: str | Path, title: str | None = None) -> Path:
    """Each layer's SQNR in the order the layers run: the weight (top panel) and the input and output in the
    model's execution and the output of the layer alone (bottom panel); the layer that hurts most (lowest SQNR
    alone) is marked in red."""
    plt = _pyplot()
    data = rows_as_dicts(rows)
    panels = [[("weight_sqnr_db", "weight", "s")],
              [("input_sqnr_db", "input (model)", "^"), ("output_sqnr_db", "output (model)", "o"),
               ("output_sqnr_isolated_db", "output (layer alone)", "D")]]
    width = max(6.5, 0.55 * len(data) + 2.5)
    fig, axes = plt.subplots(2, 1, figsize=(width, 6.4), dpi=110, sharex=True, height_ratios=[1, 2])
    xs = list(range(len(data)))
    worst = most_harmful_layer(data)
    worst_index = next((i for i, row in enumerate(data) if worst and row["name"] == worst["name"]), None)
    for ax, series in zip(axes, panels):
        cap = _finite_cap([row.get(key) for row in data for key, _, _ in series])
        exact = False
        for key, label, marker in series:
            ys = [row.get(key) for row in data]
            exact = exact or any(y is not None and math.isinf(y) for y in ys)
            ax.plot(xs, [cap if y is not None and math.isinf(y) else (math.nan if y is None else y) for y in ys],
                    marker=marker, label=label)
        if exact:
            ax.axhline(cap, color="grey", linewidth=0.6, linestyle=":")
            ax.text(xs[-1], cap, "exact ", va="bottom", ha="right", fontsize=8, color="grey")
        if worst_index is not None:
            ax.axvline(worst_index, color=_HIGHLIGHT, alpha=0.25, linewidth=6)
        ax.set_ylabel("SQNR (dB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[0].set_title(title or "Quantization error per layer, higher is better (red: hurts most)")
    axes[1].set_xticks(xs)
    rotate = len(data) > 4
    axes[1].set_xticklabels([row["name"] for row in data], rotation=45 if rotate else 0,
                            ha="right" if rotate else "center", fontsize=8)
    if worst_index is not None:
        axes[1].get_xticklabels()[worst_index].set_color(_HIGHLIGHT)
        axes[1].get_xticklabels()[worst_index].set_fontweight("bold")
    axes[1].set_xlabel("layer (in execution order)")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_sensitivity(rows: Sequence[Any], path: str | Path, title: str | None = None) -> Path:
    """Horizontal bars, most sensitive layer on top (red): the metric with every layer but this one quantized
    and with only this one, next to the fully quantized and float values."""
    plt = _pyplot()
    data = rows_as_dicts(rows)
    summary: Mapping[str, Any] = getattr(rows, "summary", {})
    panels = [(key, label) for key, label in (("all_but", "all layers but this one quantized"),
                                             ("only", "only this layer quantized"))
              if any(row.get(key) is not None for row in data)]
    height = max(3.0, 0.38 * len(data) + 1.6)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), height), dpi=110, squeeze=False)
    names = [row["name"] for row in data]
    ys = list(range(len(data)))[::-1]
    cap = _finite_cap([row.get(key) for row in data for key, _ in panels]
                      + [summary.get("float_metric"), summary.get("quantized_metric")])
    for ax, (key, label) in zip(axes[0], panels):
        values = [row.get(key) for row in data]
        shown = [cap if v is not None and math.isinf(v) else (0.0 if v is None else v) for v in values]
        colors = [_HIGHLIGHT if i == 0 else _NORMAL for i in range(len(data))]
        ax.barh(ys, shown, color=colors)
        ax.set_yticks(ys)
        ax.set_yticklabels(names, fontsize=8)
        for y, v, s in zip(ys, values, shown):
            ax.text(s, y, f" {v:.2f}" if v is not None and math.isfinite(v) else " exact", va="center", fontsize=7)
        quantized = summary.get("quantized_metric")
        if quantized is not None and math.isfinite(quantized):
            ax.axvline(quantized, color="black", linestyle="--", linewidth=1, label="every layer quantized")
        floating = summary.get("float_metric")
        if floating is not None and math.isfinite(floating):
            ax.axvline(floating, color="green", linestyle=":", linewidth=1, label="float model")
        finite = [v for v in shown if math.isfinite(v)] + [q for q in (quantized, floating)
                                                           if q is not None and math.isfinite(q)]
        low, high = min(finite), max(finite)
        margin = (high - low) * 0.25 or 1.0
        ax.set_xlim(low - margin if low - margin > 0 or low < 0 else 0.0, high + margin)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(summary.get("metric", "metric"))
        ax.grid(axis="x", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(title or "Sensitivity per layer (red: most sensitive)", fontsize=11)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_pareto(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, metric: str = "metric",
                title: str | None = None, lines: Sequence[str] = ()) -> Path:
    """Metric against average weight bits: one marker style per series (``name -> [(bits, metric), ...]``);
    series named in ``lines`` are joined by a line in bits order (a frontier)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.8), dpi=110)
    markers = ["o", "s", "^", "D", "v", "x", "*"]
    for index, (name, points) in enumerate(series.items()):
        pts = sorted(points)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        style = "-" if name in lines else ""
        ax.plot(xs, ys, style, marker=markers[index % len(markers)], label=name, alpha=0.85,
                linestyle="-" if name in lines else "none")
    ax.set_xlabel("average weight bits (scales included)")
    ax.set_ylabel(metric)
    ax.set_title("\n".join(textwrap.wrap(title or f"{metric} against size", 80)), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # matplotlib picks the format from the file name's suffix; the temporary name must end like the target
        write_file(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip(".") or None))
    finally:
        plt.close(fig)
    return path
