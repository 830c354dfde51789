"""The package's modules import each other without cycles, and its rooms import only the rooms below them.

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

Rooms (the top-level modules and packages of ``quark_brevitas``) form layers, from the bottom up (see
:data:`LAYERS`; rooms on one line are peers and import neither each other nor anything above):

1. ``version``, ``errors`` -- 2. ``outputs``, ``extras`` -- 3. ``config`` (plain data) -- 4. ``brevitas_adapter``
(the one door to Brevitas) -- 5. ``calibration`` (calibration data, activation statistics), ``model_parts`` (the
KV-cache quantizers of attention modules, mixture-of-experts experts: what the data phase attaches beyond the layer
map and the exporters read) -- 6. ``quantizers``,
``resolve`` -- 7. ``backend`` (the layer map, layer-wise quantization) -- 8. ``blocks`` (the block engine: capture,
replay, stores, sources, the stack finder), ``export`` (writers of a quantized model), ``qat`` -- 9. ``container``
(dependency injection of the layer map and exporters) -- 10. ``algorithms`` -- 11. ``orchestration`` (what a
config asks of the block engine: the block-by-block run) -- 12. ``pipeline`` -- 13. ``api``, ``checkpoint`` --
14. ``hf`` (Hugging Face models, streaming) -- 15. ``analysis`` -- 16. ``cli`` -- 17. the entry points and facades
nothing inside imports: ``__main__``, the package ``__init__`` (the public API, lazily) and the Quark-compatibility
shims ``algos`` and ``types`` (public for users; internal code imports :mod:`quark_brevitas.config` instead).

``export`` sits below ``pipeline`` because the dependency-injection ``container`` (which the pipeline holds) makes
the exporters; ``blocks`` imports no algorithm, checkpoint or pipeline module. No import runs upward:
:data:`UPWARD_EXCEPTIONS` (an import that would, with its reason) is empty; a listed exception that is no longer
needed fails the test too, so the list only shrinks.
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
                 "quark_fields", "kv_cache", "attention", "model_config",
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


#: The rooms of the package from the bottom up (module docstring); a room may import itself and the rooms on
#: earlier lines only. ``__init__`` is the package's own ``__init__.py``.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("version", "errors", "public_api"),
    ("outputs", "extras"),
    ("config",),
    ("brevitas_adapter",),
    ("calibration", "model_parts"),
    ("quantizers", "resolve"),
    ("backend",),
    ("blocks", "export", "qat"),
    ("container",),
    ("algorithms",),
    ("orchestration",),
    ("pipeline",),
    ("api", "checkpoint"),
    ("hf",),
    ("analysis",),
    ("cli", "quark_compat"),
    ("__main__", "__init__", "algos", "types",
     # deprecation shims of moved public modules (public_api.MOVED): they forward to the new locations
     "activation_store", "blockwise", "data", "digits", "dtypes", "export_blocked", "export_qonnx", "intweights",
     "layers", "presets", "schema", "serialization", "ties", "verification"),
)

#: Imports that run upward: ``(importer, imported module) -> why``; the importer is a module or a package (then
#: every module in it). Each must still occur.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
}


def room_of(module: str, package: str = PACKAGE) -> str:
    """The room of a module: its top-level module or package under ``package`` (``__init__`` for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _excepted(importer: str, target: str, exceptions: dict[tuple[str, str], str]) -> tuple[str, str] | None:
    for key in exceptions:
        prefix, imported = key
        if target == imported and (importer == prefix or importer.startswith(prefix + ".")):
            return key
    return None


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS,
                   exceptions: dict[tuple[str, str], str] | None = None,
                   package: str = PACKAGE) -> tuple[list[str], set[tuple[str, str]]]:
    """``(violations, exceptions used)``: every import of a room on the same line or a later line of
    ``layers`` than the importer's room (``"importer (room) -> imported (room)"``), less the listed exceptions."""
    exceptions = UPWARD_EXCEPTIONS if exceptions is None else exceptions
    rank = {room: index for index, line in enumerate(layers) for room in line}
    violations: list[str] = []
    used: set[tuple[str, str]] = set()
    for importer in sorted(graph):
        source = room_of(importer, package)
        for target in sorted(graph[importer]):
            room = room_of(target, package)
            if room == source or rank[room] < rank[source]:
                continue
            key = _excepted(importer, target, exceptions)
            if key is not None:
                used.add(key)
            else:
                violations.append(f"{importer} ({source}) -> {target} ({room})")
    return violations, used


def test_every_room_has_a_layer() -> None:
    """A new top-level module or package must be placed in :data:`LAYERS` (and a removed one taken out)."""
    rooms = {room_of(module) for module in import_graph()}
    listed = [room for line in LAYERS for room in line]
    assert len(listed) == len(set(listed)), "a room is listed twice"
    assert rooms == set(listed), (f"rooms without a layer: {sorted(rooms - set(listed))}; "
                                  f"listed rooms that do not exist: {sorted(set(listed) - rooms)}")


def test_rooms_import_downwards_only() -> None:
    """No import runs upward between rooms, except the listed ones, and every listed exception is still needed."""
    violations, used = upward_imports(import_graph())
    assert not violations, "imports that run upward (see LAYERS):\n" + "\n".join(violations)
    stale = set(UPWARD_EXCEPTIONS) - used
    assert not stale, f"exceptions no longer needed, remove them from UPWARD_EXCEPTIONS: {sorted(stale)}"


def test_upward_imports_are_found() -> None:
    """The layer check itself, on a made-up graph: an import of a higher room or of a peer is reported, an import
    downwards or within a room is not, and an exception is matched by importer package and counted as used."""
    graph = {"pkg.low": set(), "pkg.peer": {"pkg.low"}, "pkg.mid.a": {"pkg.low", "pkg.mid.b"},
             "pkg.mid.b": {"pkg.top", "pkg.peer"}, "pkg.low.x": {"pkg.mid.a"}, "pkg.top": {"pkg.mid.a"}}
    layers = (("low", "peer"), ("mid",), ("top",))
    exceptions = {("pkg.low", "pkg.mid.a"): "test"}
    violations, used = upward_imports(graph, layers, exceptions, "pkg")
    assert violations == ["pkg.mid.b (mid) -> pkg.top (top)", "pkg.peer (peer) -> pkg.low (low)"]
    assert used == {("pkg.low", "pkg.mid.a")}
