"""The package's modules import each other without cycles.

Layering keeps configs plain data: inside the ``config`` package, ``enums``/``errors`` <- ``formats`` <-
``serialization`` <- ``specs`` <- ``algorithms`` <- ``rotation`` <- ``checks`` <- ``model_config`` <- ``families``
<- ``template`` <- ``config`` (its ``__init__``),
then ``quantizers``, ``resolve``, ``backend``, ``api``, ... above it. A cycle means two modules can only
be understood (and imported) together, so this test parses every module of ``quark_brevitas`` with ``ast``
(without importing it), collects *every* import of a ``quark_brevitas`` module (module level, inside
functions, and under ``if TYPE_CHECKING:``: an annotation that needs an import is a dependency too) and
asserts the graph has no cycle.

Not modelled: the implicit import of a parent package (``import quark_brevitas.config`` runs
``quark_brevitas/__init__.py`` first). The package ``__init__`` re-exports the public API, so every module
would otherwise sit on a cycle through it; an *explicit* ``from quark_brevitas import name`` is an edge to
the package and counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "quark_brevitas"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__`` by the package's name)."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in: the longest prefix that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(node: ast.ImportFrom, importer: str, modules: dict[str, Path]) -> str:
    """The absolute module name of a ``from ... import`` (relative imports resolved against ``importer``)."""
    if node.level == 0:
        return node.module or ""
    base = importer if _is_package(importer, modules) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports_of(importer: str, tree: ast.AST, modules: dict[str, Path], package: str) -> set[str]:
    """The package modules ``importer`` imports anywhere in its source (``ast.walk`` reaches function
    bodies and ``if TYPE_CHECKING:`` blocks)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, importer, modules)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one, else a name of ``pkg``.
            names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                     for alias in node.names]
        else:
            continue
        for name in names:
            if name == package or name.startswith(f"{package}."):
                target = _known(name, modules)
                if target is not None and target != importer:
                    found.add(target)
    return found


def import_graph(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_names(package_dir, package)
    return {name: imports_of(name, ast.parse(path.read_text(), str(path)), modules, package)
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None`` (depth-first search, modules in sorted order)."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> list[str] | None:
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target in on_stack:
                return [*stack[stack.index(target):], target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        stack.pop()
        on_stack.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)) is not None:
            return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other: remove the first edge of each cycle found and
    search again, so a failure lists every tangle at once instead of one per run."""
    remaining = {module: set(targets) for module, targets in graph.items()}
    cycles: list[list[str]] = []
    while (cycle := find_cycle(remaining)) is not None:
        cycles.append(cycle)
        remaining[cycle[0]].discard(cycle[1])
    return cycles


def test_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.config" in graph and len(graph) > 10, f"scanned only {sorted(graph)}"
    cycles = all_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


#: The config package from the bottom up: each module may import only those before it (and ``errors``).
CONFIG_LAYERS = ["enums", "kquants", "formats", "serialization", "specs", "algorithms", "rotation", "checks",
                 "quark_fields", "model_config",
                 "families", "template", "rounding"]


def test_config_layers_import_downwards_only() -> None:
    """The plain-data modules of the config package import only the ones below them (never the package's
    ``__init__``, nor anything outside it but ``errors``), so they load without torch in this order."""
    graph = import_graph()
    allowed = {f"{PACKAGE}.errors"}
    for name in CONFIG_LAYERS:
        module = f"{PACKAGE}.config.{name}"
        assert module in graph, f"{module} not found in {sorted(graph)}"
        reachable = _reachable(graph, module)
        assert reachable <= allowed, f"{module} reaches {sorted(reachable - allowed)}"
        allowed.add(module)
    assert _reachable(graph, f"{PACKAGE}.config.serialization") <= {f"{PACKAGE}.errors"}, \
        "serialization must stay generic"
    # The package and the Quark-path re-exports add only what is below them.
    for module in (f"{PACKAGE}.config", f"{PACKAGE}.types", f"{PACKAGE}.algos"):
        assert module in graph and _reachable(graph, module) <= allowed, f"{module} reaches {_reachable(graph, module)}"


def test_package_init_imports_nothing_at_module_level() -> None:
    """``quark_brevitas/__init__.py`` imports its public names on first use (PEP 562), so importing any module
    of the package (which runs the package first) does not pull in torch or the rest of the library."""
    graph = import_graph()
    assert graph[PACKAGE] <= {f"{PACKAGE}.version"}, sorted(graph[PACKAGE])


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The scanner itself: function-level, TYPE_CHECKING, relative and ``from pkg import sub`` imports are
    edges, and a cycle through them is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("import pkg.a\nimport os\n")
    (pkg / "d.py").write_text("from pkg import sub, VERSION\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.sub", "pkg"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    graph["pkg.c"].discard("pkg.a")
    assert find_cycle(graph) is None
