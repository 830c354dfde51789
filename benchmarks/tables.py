"""The one table printer of the benchmarks: Markdown pipe tables, so results paste into the README."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a ``---`` rule under the header."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines)
