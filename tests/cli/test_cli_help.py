"""The command line describes itself without the heavy machinery (issue 27 item 6).

``--help`` of every command answers without importing torch, Brevitas, transformers or onnx (checked in a fresh
interpreter's ``sys.modules``, not with a timing: timings on a shared machine are noise), and ``quark-brevitas list
TOPIC`` prints what this install can do from the tables the code uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quark_brevitas.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "brevitas", "transformers", "onnx", "onnxruntime", "numpy")

PROBE = f"""
import json, sys
from quark_brevitas.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "heavy": sorted(m for m in sys.modules if m.partition(".")[0] in {HEAVY!r})}}))
"""


def _probe(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


COMMANDS = [[], ["quantize"], ["export"], ["plan"], ["presets"], ["analyze"], ["autoconfig"], ["list"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_help_imports_no_torch(command: list[str]) -> None:
    result = _probe([*command, "--help"])
    assert result["code"] == 0
    assert result["heavy"] == [], f"'{' '.join(command)} --help' imported {result['heavy']}"


@pytest.mark.parametrize("topic", ["formats", "families", "presets"])
def test_the_light_listings_import_no_torch(topic: str) -> None:
    result = _probe(["list", topic])
    assert result["code"] == 0 and result["heavy"] == [], result


def test_python_dash_m_help_works() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "quark_brevitas", "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and "list" in done.stdout and "export" in done.stdout, done.stderr


def test_list_formats_reads_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.export.registry import FORMATS

    assert main(["list", "formats"]) == 0
    out = capsys.readouterr().out
    for row in FORMATS.values():
        assert row.name in out and row.holds in out
    assert "[gguf]" in out and "[deploy]" in out  # the extras


def test_list_layers_reads_the_default_layer_map(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.backend import DEFAULT_LAYER_MAP

    assert main(["list", "layers"]) == 0
    out = capsys.readouterr().out
    for float_cls, mapping in DEFAULT_LAYER_MAP.items():
        assert f"{float_cls.__module__}.{float_cls.__qualname__}" in out
        assert mapping.quant_class.__qualname__ in out


def test_list_families_algorithms_presets_and_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.algorithms import registered_handlers
    from quark_brevitas.analysis import CANDIDATES
    from quark_brevitas.config.families import FAMILIES
    from quark_brevitas.config.presets import PRESETS

    for topic, names in (("families", FAMILIES), ("presets", PRESETS), ("candidates", CANDIDATES),
                         ("algorithms", [config.__name__ for config in registered_handlers()])):
        assert main(["list", topic]) == 0
        out = capsys.readouterr().out
        missing = [name for name in names if name not in out]
        assert not missing, f"list {topic} lacks {missing}"


def test_list_refuses_an_unknown_topic(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "colours"]) == 2
    assert "formats" in capsys.readouterr().err


def test_export_model_option_imports_a_module_from_the_current_folder(tmp_path: Path) -> None:
    """``--model mymodule:make`` with ``mymodule.py`` in the current folder, from the console script (whose
    ``sys.path`` does not hold the current folder, unlike ``python -m``)."""
    (tmp_path / "mymodule_cwd.py").write_text("def make():\n    raise RuntimeError('reached the factory')\n")
    (tmp_path / "ckpt").mkdir()
    script = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
              "from quark_brevitas.cli.export import _float_model; _float_model('mymodule_cwd:make')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert "reached the factory" in done.stderr, done.stderr  # imported and called; the factory's error is ours
    assert "cannot import" not in done.stderr
