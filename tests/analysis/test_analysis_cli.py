"""``quark-brevitas analyze`` and ``autoconfig`` on the digits CNN (in-process, 3 training epochs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quark_brevitas import Config, ModelQuantizer
from quark_brevitas.analysis import model_size
from quark_brevitas.cli import main
from quark_brevitas.cli.digits import DigitsCNN

FAST = ["--epochs", "3"]


def test_analyze_writes_tables_files_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "analysis"
    assert main(["analyze", "--output", str(out), *FAST, "--preset", "w4a8_gptq", "-q"]) == 0
    printed = capsys.readouterr().out
    layers = json.loads((out / "layers.json").read_text())
    ranking = json.loads((out / "sensitivity.json").read_text())
    assert [row["name"] for row in layers["rows"]] == ["conv1", "conv2", "fc1", "fc2"]
    assert sorted(row["name"] for row in ranking["rows"]) == ["conv1", "conv2", "fc1", "fc2"]
    assert f"most sensitive: {ranking['rows'][0]['name']}" in printed and "hurts most:" in printed
    assert (out / "layers.csv").read_text().startswith("name,module_type,index")
    for name in ("layers.png", "sensitivity.png"):
        image = matplotlib.image.imread(str(out / name))
        assert image.shape[0] > 300 and image[..., :3].std() > 0.05


def test_analyze_without_plots_and_bad_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a"
    assert main(["analyze", "--output", str(out), *FAST, "--no-plots", "--batches", "2", "-q"]) == 0
    assert not list(out.glob("*.png")) and (out / "sensitivity.json").is_file()
    assert json.loads((out / "layers.json").read_text())["summary"]["batches"] == 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["analyze", "--output", str(blocker), *FAST, "-q"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_autoconfig_yaml_runs_in_plan_and_quantize(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.yaml"
    assert main(["autoconfig", "--budget-bits", "5", "--output", str(path), *FAST, "-q"]) == 0
    printed = capsys.readouterr().out
    assert "average weight bits" in printed and str(path) in printed
    config = Config.from_file(path)
    assert model_size(DigitsCNN(), config).average_weight_bits <= 5.0
    assert {row.name for row in ModelQuantizer(config).plan(DigitsCNN()) if row.sources} == \
        {"conv1", "conv2", "fc1", "fc2"}
    assert main(["plan", "--config", str(path), "-q"]) == 0
    assert "layer_quant_config" in capsys.readouterr().out or config.layer_quant_config == {}
    out = tmp_path / "q"
    assert main(["quantize", "--config", str(path), "--output", str(out), *FAST, "-q"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["quant_accuracy_pytorch"] > 90.0


@pytest.mark.parametrize(("args", "message"), [
    (["--output", "x.yaml"], "give a budget"),
    (["--budget-bits", "4", "--candidates", "w8a8,w5a8"], "unknown ['w5a8']"),
    (["--budget-bits", "1"], "no assignment of the candidates fits"),
])
def test_autoconfig_errors(args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoconfig", *args, *FAST, "-q", "--output", str(tmp_path / "x.yaml")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_analysis_example_runs(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    repo = Path(__file__).resolve().parents[2]
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    # No output argument: the default is a new folder in the temp dir, never the cwd (the repository, when the
    # example is run from there).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp), "PYTHONPATH": str(repo)}
    result = subprocess.run([sys.executable, str(repo / "examples" / "analysis_digits.py")], capture_output=True,
                            text=True, timeout=300, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert list(cwd.iterdir()) == []
    out = Path(result.stdout.strip().splitlines()[-1].removeprefix("wrote ").rstrip("/"))
    assert out.parent == temp
    assert "most sensitive:" in result.stdout and "hurts most:" in result.stdout
    for name in ("layers.json", "layers.csv", "layers.png", "sensitivity.json", "sensitivity.png"):
        assert (out / name).is_file(), name
    config = Config.from_file(out / "mixed_precision.yaml")
    assert model_size(DigitsCNN(), config).average_weight_bits <= 4.103
