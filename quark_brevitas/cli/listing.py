"""``quark-brevitas list formats|layers|families|algorithms|presets|candidates``: what this install can do.

Each listing reads the table the code itself uses, so it cannot drift from what runs: the export formats from
:data:`quark_brevitas.export.registry.FORMATS`, the layer types from
:data:`quark_brevitas.backend.DEFAULT_LAYER_MAP` (with the optional entries of installed packages), the model
families from :data:`quark_brevitas.config.families.FAMILIES`, the algorithms from the handler registry of
:mod:`quark_brevitas.algorithms`, the presets from :mod:`quark_brevitas.config.presets` and the mixed-precision
candidates from :data:`quark_brevitas.analysis.CANDIDATES`. Only the chosen listing's modules are imported (layers,
algorithms and candidates need torch and Brevitas; the others answer at once).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

__all__ = ["TOPICS", "cmd_list", "listing_rows"]

#: Topic -> what it lists (the ``list`` command's choices and help).
TOPICS: dict[str, str] = {
    "formats": "export formats (--format / --export), their layout, extra and whether this install can write them",
    "layers": "float layer types that get quantized and the quantized class replacing each",
    "families": "model families with built-in knowledge (blocks, layers kept float, scaling, rotation)",
    "algorithms": "algorithm configs and the handler that runs each",
    "presets": "named configs for --preset",
    "candidates": "per-layer formats autoconfig chooses from",
}


def _formats() -> list[tuple[str, ...]]:
    from quark_brevitas.export.registry import FORMATS

    rows = [("format", "output", "block by block", "needs", "installed", "holds")]
    for row in FORMATS.values():
        name = row.name + "".join(f", {alias}" for alias in row.aliases)
        output = f"{row.layout} ({row.suffix})" if row.suffix else row.layout
        needs = f"[{row.extra}]" if row.extra else "base install"
        rows.append((name, output, "yes" if row.streamed_writer is not None else "no", needs,
                     "yes" if row.installed() else "no", row.holds))
    return rows


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _layers() -> list[tuple[str, ...]]:
    from quark_brevitas.backend import DEFAULT_LAYER_MAP, OPTIONAL_LAYER_MAP

    rows = [("float layer", "quantized as", "note")]
    for float_cls, mapping in DEFAULT_LAYER_MAP.items():
        note = "only when the config names it" if mapping.explicit_only else ""
        rows.append((_qualified(float_cls), _qualified(mapping.quant_class), note))
    present = {(cls.__module__, cls.__name__) for cls in DEFAULT_LAYER_MAP}
    for (module, name), mapping in OPTIONAL_LAYER_MAP.items():
        if (module, name) not in present:
            rows.append((f"{module}.{name}", _qualified(mapping.quant_class), f"needs {module.partition('.')[0]}"))
    return rows


def _families() -> list[tuple[str, ...]]:
    from quark_brevitas.config.families import FAMILIES

    rows = [("family", "blocks", "kept float", "scaling groups", "rotation")]
    for family in FAMILIES.values():
        rows.append((family.name, family.decoder_layers, ", ".join(family.exclude) or "-", str(len(family.scaling)),
                     "yes" if family.rotation is not None else "no"))
    return rows


def _algorithms() -> list[tuple[str, ...]]:
    from quark_brevitas.algorithms import registered_handlers

    rows = [("config", "runs", "handler")]
    for config_type, handler in registered_handlers().items():
        runs = "block by block" if handler.blockwise else "on the whole model"
        rows.append((config_type.__name__, runs, _qualified(type(handler))))
    return rows


def _presets() -> list[tuple[str, ...]]:
    from quark_brevitas.config.presets import DEFAULT_PRESET, DESCRIPTIONS, PRESETS

    return [("preset", "description"),
            *((name + (" (default)" if name == DEFAULT_PRESET and "(default)" not in DESCRIPTIONS[name] else ""),
              DESCRIPTIONS[name]) for name in PRESETS)]


def _candidates() -> list[tuple[str, ...]]:
    from quark_brevitas.analysis import CANDIDATES, DEFAULT_CANDIDATES

    def described(config: object) -> str:
        if config is None:
            return "float (not quantized)"
        return "; ".join(f"{role}: {getattr(config, role).short()}" for role in ("weight", "input_tensors")
                         if getattr(config, role) is not None)

    return [("candidate", "default", "format"),
            *((name, "yes" if name in DEFAULT_CANDIDATES else "", described(config))
              for name, config in CANDIDATES.items())]


_LISTINGS: dict[str, Callable[[], list[tuple[str, ...]]]] = {
    "formats": _formats, "layers": _layers, "families": _families, "algorithms": _algorithms,
    "presets": _presets, "candidates": _candidates,
}


def listing_rows(topic: str) -> list[tuple[str, ...]]:
    """The header and rows of one listing (``topic``: a key of :data:`TOPICS`)."""
    return _LISTINGS[topic]()


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the last column is left as it is (it may be long)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip()
                     for row in rows)


def cmd_list(args: argparse.Namespace) -> int:
    print(_table(listing_rows(args.topic)))
    return 0
