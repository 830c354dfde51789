"""The public API does not move under users (issue 28 item 4).

Every name :data:`quark_brevitas.public_api.PUBLIC` declares imports from its path without a warning; every name
that moved (:data:`~quark_brevitas.public_api.MOVED`) still imports from its old path, is the very object of the new
one, and says where it went with a ``DeprecationWarning``; and every import the README and the examples ever showed
(collected from the git history of README.md and examples/ on 2026-11-27: ``git log -p -- README.md examples/``)
still works. pyproject's ``filterwarnings`` ignores DeprecationWarning globally, so the warnings are asserted under
``warnings.catch_warnings`` with ``simplefilter("always")``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quark_brevitas.public_api import MOVED, MOVED_SINCE, PUBLIC

ROOT = Path(__file__).resolve().parent.parent

#: (module, name) of every ``from quark_brevitas... import name`` in any version of README.md or examples/, and
#: the qualified names the README's prose showed (``quark_brevitas.data.cache_keyword``).
DOCUMENTED: list[tuple[str, str]] = [
    *[("quark_brevitas", n) for n in (
        "Config", "Container", "DEFAULT_LAYER_MAP", "LLMTemplate", "LayerMapping", "ModelExporter", "ModelQuantizer",
        "QATConfig", "QLayerConfig", "QTensorConfig", "algos", "integer_weights", "load_quantized", "prepare_qat",
        "save_integer_weights", "save_quantized")],
    ("quark_brevitas.algos", "GPTQ"), ("quark_brevitas.algos", "Preprocess"),
    *[("quark_brevitas.analysis", n) for n in (
        "CANDIDATES", "auto_mixed_precision", "compare_layers", "layer_table", "model_size", "plot_layer_sqnr",
        "plot_sensitivity", "sensitivity", "sensitivity_table", "write_rows")],
    ("quark_brevitas.api", "ModelExporter"), ("quark_brevitas.api", "ModelQuantizer"),
    ("quark_brevitas.backend", "plan_table"),
    *[(module, n) for module in ("quark_brevitas.cli.digits", "quark_brevitas.digits") for n in (
        "DigitsCNN", "evaluate", "evaluate_predictions", "example_input", "fine_tune", "load_digits_data",
        "train_digits_cnn")],
    *[("quark_brevitas.config", n) for n in (
        "AWQConfig", "AutoRoundConfig", "Config", "GPTQConfig", "LLMTemplate", "QLayerConfig", "QTensorConfig",
        "QronosConfig", "QuantizationConfig", "QuantizationSpec", "RotationConfig", "SmoothQuantConfig")],
    ("quark_brevitas.config.presets", "get_preset"), ("quark_brevitas.presets", "get_preset"),
    ("quark_brevitas.export", "export_safetensors"), ("quark_brevitas.export", "run_onnx"),
    ("quark_brevitas.export", "export_gguf"), ("quark_brevitas.export", "create_ort_session"),
    ("quark_brevitas.hf.streaming", "load_pretrained_quantized"),
    ("quark_brevitas.hf.streaming", "quantize_pretrained"),
    ("quark_brevitas.hf.export_streamed", "export_gguf_streamed"),
    ("quark_brevitas.hf.export_streamed", "export_safetensors_streamed"),
    ("quark_brevitas.qat", "QATConfig"), ("quark_brevitas.qat", "prepare_qat"),
    *[("quark_brevitas.types", n) for n in ("Dtype", "ParamType", "QSchemeType", "RoundType", "TQTThresholdInitMeth")],
    ("quark_brevitas.algorithms", "register"), ("quark_brevitas.algorithms", "describe_algorithms"),
    ("quark_brevitas.algorithms", "apply_algorithm"),
    ("quark_brevitas.backend.layers", "QuantMultiheadAttention"), ("quark_brevitas.layers", "QuantMultiheadAttention"),
    ("quark_brevitas.calibration.data", "cache_keyword"), ("quark_brevitas.data", "cache_keyword"),
]

#: Modules the README documented as such (``import quark_brevitas.config``, ``python -m ...``).
DOCUMENTED_MODULES = ["quark_brevitas.types", "quark_brevitas.algos", "quark_brevitas.config.observers",
                      "quark_brevitas.config.schema", "quark_brevitas.schema", "quark_brevitas.export",
                      "quark_brevitas.analysis"]


def _declared(module: str, name: str) -> bool:
    return name in PUBLIC.get(module, ()) or name in MOVED.get(module, {})


def _get(module: str, name: str) -> tuple[object, list[warnings.WarningMessage]]:
    """``from module import name`` (the statement itself, so the shims' ``__getattr__`` path is the one a user
    runs) and the warnings it raised."""
    namespace: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from {module} import {name} as value", namespace)  # noqa: S102 - the statement under test
    return namespace["value"], caught


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
            and "quark_brevitas" in str(w.message)]


PUBLIC_NAMES = [(module, name) for module, names in PUBLIC.items() for name in names]


@pytest.mark.parametrize(("module", "name"), PUBLIC_NAMES, ids=[f"{m}.{n}" for m, n in PUBLIC_NAMES])
def test_every_public_name_imports_from_its_path_without_a_deprecation(module: str, name: str) -> None:
    _, caught = _get(module, name)
    assert not _deprecations(caught), f"{module}.{name} is declared public but warns: {_deprecations(caught)}"


MOVED_NAMES = [(old, name, new) for old, names in MOVED.items() for name, new in names.items()]


@pytest.mark.parametrize(("old", "name", "new"), MOVED_NAMES, ids=[f"{o}.{n}" for o, n, _ in MOVED_NAMES])
def test_a_moved_name_works_from_its_old_path_and_warns_naming_the_new_one(old: str, name: str, new: str) -> None:
    value, caught = _get(old, name)
    messages = _deprecations(caught)
    assert len(messages) == 1, messages
    assert f"{new}.{name}" in messages[0] and MOVED_SINCE.get(old, "0.2.0") in messages[0], messages[0]
    assert value is getattr(importlib.import_module(new), name)
    # The warning points at the user's line, not at the shim.
    assert all("public_api.py" not in w.filename for w in caught if issubclass(w.category, DeprecationWarning))


def test_the_warning_comes_on_every_use_and_an_unknown_name_lists_the_moved_ones() -> None:
    import quark_brevitas.presets as presets

    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            presets.get_preset("w8a8")
        assert _deprecations(caught), "the shim cached the value and stopped warning"
    with pytest.raises(AttributeError, match="get_preset"):
        presets.no_such_name  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_every_documented_import_still_works_and_is_declared(module: str, name: str) -> None:
    value, _ = _get(module, name)
    assert value is not None
    assert _declared(module, name), f"{module}.{name} was documented but is neither in PUBLIC nor in MOVED"


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_every_documented_module_imports(module: str) -> None:
    assert importlib.import_module(module).__name__ == module
    assert module in PUBLIC or module in MOVED


def _current_doc_imports() -> set[tuple[str, str]]:
    """``from quark_brevitas... import name`` in today's README.md, docs/*.md and examples/*.py."""
    found: set[tuple[str, str]] = set()
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    for path in sources:
        text = path.read_text()
        chunks = re.findall(r"```python\n(.*?)```", text, re.S) if path.suffix == ".md" else [text]
        for chunk in chunks:
            try:
                tree = ast.parse(chunk)
            except SyntaxError:
                continue  # a fragment (``...``); its imports are covered by DOCUMENTED
            found |= {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.module and node.module.startswith("quark_brevitas") for alias in node.names}
    return found


def test_what_the_docs_import_today_is_declared_public() -> None:
    missing = sorted(f"{m}.{n}" for m, n in _current_doc_imports() if not _declared(m, n))
    assert not missing, f"documented but not in quark_brevitas.public_api.PUBLIC: {missing}"


def test_python_m_of_the_old_schema_module_still_writes_the_schema(tmp_path: Path) -> None:
    target = tmp_path / "schema.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "quark_brevitas.schema",
                           str(target)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert target.read_text() == (ROOT / "quark_brevitas" / "config.schema.json").read_text()
    assert "quark_brevitas.config.schema" in done.stderr and "DeprecationWarning" in done.stderr
