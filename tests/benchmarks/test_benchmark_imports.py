"""Benchmarks are a package run as ``python -m benchmarks.NAME``: they import each other as ``benchmarks.X`` (no
``sys.path`` edits) and use only the library's public names, as a user's script would (issue 28)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "quark_brevitas":
            found += [f"line {node.lineno}: private name {alias.name} from {node.module}" for alias in node.names
                      if alias.name.startswith("_")]
            found += [f"line {node.lineno}: private module {node.module}"
                      for part in node.module.split(".") if part.startswith("_") and part != "__init__"]
        if isinstance(node, ast.Attribute) and node.attr in ("path",) and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            parent_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                            and n.func.attr in ("insert", "append") and n.func.value is node]
            found += [f"line {call.lineno}: sys.path.{call.func.attr}" for call in parent_calls]
    return found


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_public_names_only(path: Path) -> None:
    assert not _findings(path), _findings(path)


def test_the_check_finds_a_private_import_and_a_path_edit(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, '.')\nfrom quark_brevitas.export.onnx.qcdq import _fit\n")
    assert sorted(f.split(":")[0] for f in _findings(bad)) == ["line 2", "line 3"]
