"""The package's shape stays navigable (issue 21): small modules, a short package root, no private names shared
between modules, no definition silently replaced by a second one of the same name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from quark_brevitas.public_api import MOVED

PACKAGE = Path(__file__).resolve().parent.parent / "quark_brevitas"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 500
MAX_ROOT_MODULES = 15


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_package_was_found() -> None:
    assert len(MODULES) > 50, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_500_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by concept"


def test_the_package_root_holds_at_most_15_modules() -> None:
    # The deprecation shims left where public modules used to be (quark_brevitas.public_api.MOVED) are not rooms.
    shims = {f"{old.rpartition('.')[2]}.py" for old in MOVED}
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in shims)
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_no_private_name_is_imported_across_modules() -> None:
    found = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quark_brevitas"):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {node.module}.{alias.name}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not found, "\n".join(found)


def _duplicates(body: list[ast.stmt]) -> list[str]:
    names = Counter(node.name for node in body
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and not any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "register")
                                or isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list))
    return [name for name, count in names.items() if count > 1]


def test_no_function_or_class_is_defined_twice_in_one_scope() -> None:
    found = []
    for path in MODULES:
        tree = _tree(path)
        found += [f"{path.relative_to(PACKAGE)}: {name}" for name in _duplicates(tree.body)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found += [f"{path.relative_to(PACKAGE)}: {node.name}.{name}" for name in _duplicates(node.body)]
    assert not found, "\n".join(found)


def test_the_duplicate_check_finds_a_second_definition() -> None:
    tree = ast.parse("def f():\n    pass\n\n\ndef g():\n    pass\n\n\ndef f():\n    pass\n")
    assert _duplicates(tree.body) == ["f"]
