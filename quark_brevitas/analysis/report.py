"""Printing and writing analysis rows: aligned text tables, JSON and CSV.

Rows may be dataclasses or dicts (:func:`rows_as_dicts`). In JSON and CSV an exact SQNR (``inf``) is written as
the string ``"inf"`` (JSON has no infinity) and an unmeasured value as ``null`` / an empty cell.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from quark_brevitas.outputs import write_file

__all__ = ["format_table", "layer_table", "most_harmful_layer", "rows_as_dicts", "sensitivity_table",
           "write_csv", "write_json", "write_rows"]

_LAYER_COLUMNS = [("name", "layer"), ("module_type", "type"), ("weight_sqnr_db", "weight"),
                  ("input_sqnr_db", "input"), ("output_sqnr_db", "output"),
                  ("input_sqnr_isolated_db", "input alone"), ("output_sqnr_isolated_db", "output alone"),
                  ("model_sqnr_without_db", "model, this layer float")]


def rows_as_dicts(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Each row as a dict (dataclass fields in order, or the dict itself)."""
    out = []
    for row in rows:
        if dataclasses.is_dataclass(row) and not isinstance(row, type):
            out.append(dataclasses.asdict(row))
        elif isinstance(row, Mapping):
            out.append(dict(row))
        else:
            raise TypeError(f"a row must be a dataclass or a dict, got {type(row).__name__}")
    return out


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "exact" if value > 0 else "-inf"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: Iterable[Any], columns: Sequence[tuple[str, str]] | None = None, digits: int = 2) -> str:
    """An aligned text table; ``columns`` are ``(field, header)`` pairs (default: every field)."""
    dicts = rows_as_dicts(rows)
    if columns is None:
        columns = [(key, key) for key in (dicts[0] if dicts else {})]
    table = [[header for _, header in columns]]
    table += [[_cell(row.get(key), digits) for key, _ in columns] for row in dicts]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def most_harmful_layer(rows: Iterable[Any]) -> dict[str, Any] | None:
    """The compared layer that hurts the model most: the one whose keeping in float raises the model's output
    SQNR most (``model_sqnr_without_db``); rows without that measurement fall back to the layer's own error
    (the lowest isolated output SQNR)."""
    rows = rows_as_dicts(rows)
    measured = [row for row in rows if row.get("model_sqnr_without_db") is not None]
    if measured:
        return max(measured, key=lambda row: row["model_sqnr_without_db"])
    measured = [row for row in rows if row.get("output_sqnr_isolated_db") is not None]
    return min(measured, key=lambda row: row["output_sqnr_isolated_db"]) if measured else None


def layer_table(rows: Sequence[Any]) -> str:
    """The layer-by-layer comparison (:func:`~quark_brevitas.analysis.compare_layers`) as text: SQNR in dB, the
    whole-model line, and the layer that hurts most."""
    lines = ["SQNR in dB (higher is better; 'alone': the layer fed the float input)",
             format_table(rows, _LAYER_COLUMNS)]
    summary = getattr(rows, "summary", {})
    if summary:
        agreement = summary.get("top1_agreement")
        lines.append(f"model output: SQNR {_cell(summary.get('output_sqnr_db'))} dB"
                     + (f", top-1 agreement {agreement:.2f} %" if agreement is not None else "")
                     + f" ({summary.get('batches')} batches)")
    worst = most_harmful_layer(rows)
    if worst is not None and worst.get("model_sqnr_without_db") is not None:
        lines.append(f"hurts most: {worst['name']} (keeping only it in float gives model output SQNR "
                     f"{_cell(worst['model_sqnr_without_db'])} dB, the most of any layer)")
    elif worst is not None:
        alone = _cell(worst["output_sqnr_isolated_db"])
        lines.append(f"hurts most: {worst['name']} (its own error: output SQNR {alone} dB alone, the lowest)")
    return "\n".join(lines)


def sensitivity_table(rows: Sequence[Any]) -> str:
    """The sensitivity ranking (:func:`~quark_brevitas.analysis.sensitivity`) as text, most sensitive first."""
    summary = getattr(rows, "summary", {})
    metric = summary.get("metric", "metric")
    columns = [("name", "layer"), ("module_type", "type"), ("all_but", "all but this layer"),
               ("only", "only this layer")]
    lines = [f"{metric} ({'higher' if summary.get('higher_is_better', True) else 'lower'} is better), most "
             "sensitive layer first", format_table(rows, columns, digits=3)]
    if summary:
        lines.append(f"float model: {_cell(summary.get('float_metric'), 3)}; every layer quantized: "
                     f"{_cell(summary.get('quantized_metric'), 3)} ({'exact' if summary.get('exact') else 'cheap'} "
                     "mode)")
    if rows:
        first = rows_as_dicts(rows[:1])[0]
        lines.append(f"most sensitive: {first['name']} (keeping only it in float gives {_cell(first['all_but'], 3)})")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


def write_json(rows: Sequence[Any], path: str | Path) -> Path:
    """``{"summary": ..., "rows": [...]}`` (``summary``: the rows' whole-model values, if any)."""
    path = Path(path)
    data = {"summary": {k: _plain(v) for k, v in getattr(rows, "summary", {}).items()},
            "rows": [{k: _plain(v) for k, v in row.items()} for row in rows_as_dicts(rows)]}
    text = json.dumps(data, indent=2) + "\n"
    return write_file(path, lambda tmp: tmp.write_text(text))


def write_csv(rows: Sequence[Any], path: str | Path) -> Path:
    """One line per row, a header of the field names."""
    path = Path(path)
    dicts = rows_as_dicts(rows)

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(dicts[0]) if dicts else [])
            writer.writeheader()
            for row in dicts:
                writer.writerow({k: "" if _plain(v) is None else _plain(v) for k, v in row.items()})

    return write_file(path, write)


def write_rows(rows: Sequence[Any], directory: str | Path, stem: str) -> tuple[Path, Path]:
    """``DIRECTORY/STEM.json`` and ``DIRECTORY/STEM.csv``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return write_json(rows, directory / f"{stem}.json"), write_csv(rows, directory / f"{stem}.csv")
