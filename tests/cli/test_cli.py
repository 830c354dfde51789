"""Tests of the ``quark-brevitas`` command line, the presets and the runnable examples.

Most tests call :func:`quark_brevitas.cli.main` in-process with ``--epochs 3`` (training then takes
well under a second); the ``slow`` ones run the installed console script and every example script
in subprocesses, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from quark_brevitas import Config
from quark_brevitas.cli import main
from quark_brevitas.config.presets import DEFAULT_PRESET, DESCRIPTIONS, PRESETS, get_preset
from quark_brevitas.outputs import MARKER_FILE

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
FAST = ["--epochs", "3"]


def _quantize(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "out"
    return main(["quantize", "--output", str(out), *FAST, *extra]), out


def _check_report(out: Path) -> dict:
    assert (out / "digits_quant.onnx").is_file()
    report = json.loads((out / "report.json").read_text())
    for key in ("float_accuracy", "quant_accuracy_pytorch", "quant_accuracy_onnxruntime"):
        assert 0.0 <= report[key] <= 100.0, key
    assert report["quant_accuracy_pytorch"] > 80.0  # a working model, not chance level
    assert abs(report["quant_accuracy_onnxruntime"] - report["quant_accuracy_pytorch"]) <= 0.5
    assert report["agreement_onnxruntime_pytorch"] >= 99.0
    assert report["onnx_size_bytes"] == (out / "digits_quant.onnx").stat().st_size
    assert set(report["timings_s"]) >= {"train", "quantize", "export"}
    return report


# ===================================================================== presets
def test_presets_build_valid_configs() -> None:
    assert DEFAULT_PRESET == "w8a8"
    assert set(PRESETS) == set(DESCRIPTIONS) == {"w8a8", "w8a8_per_channel", "w4a8_gptq", "w4_weight_only", "fp8",
                                                 "bert_w8a8", "bert_w8a8_dynamic", "bert_w4_g32", "gguf_q4_0",
                                                 "gguf_q4_1", "gguf_q8_0", "finn_w8a8", "finn_w4a4", "finn_w2a2",
                                                 "gguf_q6_k", "gguf_q5_k", "gguf_q4_k",
                                                 "gguf_q3_k", "gguf_q2_k", "gguf_q6_k_mix", "gguf_q5_k_m",
                                                 "gguf_q4_k_m", "gguf_q3_k_m", "gguf_q2_k_mix"}
    model = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4)  # the GGUF mixes are per model
    for name in PRESETS:
        config = get_preset(name, model)
        assert isinstance(config, Config)
        assert Config.from_dict(config.to_dict()) == config  # verifies too
        assert get_preset(name, model) is not config  # a fresh object every call


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ValueError, match="w4a8_gptq"):
        get_preset("w3a8")


# ===================================================================== quantize
def test_quantize_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _quantize(tmp_path)
    assert code == 0
    report = _check_report(out)
    assert report["config_source"] == f"preset {DEFAULT_PRESET}"
    assert json.loads((out / "config.json").read_text()) == get_preset(DEFAULT_PRESET).to_dict()
    assert sorted(p.name for p in out.iterdir()) == [MARKER_FILE, "config.json", "digits_quant.onnx", "report.json"]
    stdout = capsys.readouterr().out
    for label in ("float accuracy", "quantized accuracy (PyTorch)", "quantized accuracy (onnxruntime)",
                  "agreement onnxruntime vs PyTorch", "ONNX size", "time: train / quantize / export"):
        assert label in stdout
    assert f"{report['quant_accuracy_onnxruntime']:6.2f} %" in stdout


def test_quantize_with_yaml_config(tmp_path: Path) -> None:
    config_file = tmp_path / "w6.yaml"
    config_file.write_text(
        "global_quant_config:\n"
        "  weight: {qscheme: per_channel, bit_width: 6}\n"
        "  input_tensors: {bit_width: 8}\n"
        "pre_quant_opt_config:\n"
        "  - {name: Preprocess, equalize_iterations: 5}\n"
    )
    code, out = _quantize(tmp_path, "--config", str(config_file))
    assert code == 0
    _check_report(out)
    used = json.loads((out / "config.json").read_text())
    assert used == Config.from_file(config_file).to_dict()
    assert used["global_quant_config"]["weight"]["bit_width"] == 6
    assert used["pre_quant_opt_config"][0]["equalize_iterations"] == 5


def test_quantize_weight_only_preset(tmp_path: Path) -> None:
    code, out = _quantize(tmp_path, "--preset", "w4_weight_only")
    assert code == 0
    _check_report(out)
    assert json.loads((out / "config.json").read_text()) == get_preset("w4_weight_only").to_dict()


def test_unknown_preset_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _quantize(tmp_path, "--preset", "w3a8")
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") or "\nerror: " in err
    assert "Traceback" not in err
    for name in PRESETS:
        assert name in err
    assert not out.exists()  # nothing was done


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("global_quant_config:\n  weight:\n    bit_widht: 4\n", "global_quant_config.weight.bit_widht"),
        ("global_quant_config:\n  weight: {bit_width: 99}\n", "global_quant_config.weight.bit_width"),
        ("global_quant_config: [\n", "not valid YAML"),
    ],
)
def test_bad_config_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str) -> None:
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(text)
    code, _ = _quantize(tmp_path, "--config", str(config_file))
    assert code == 2
    err = capsys.readouterr().err
    assert "error: " in err and expected in err and str(config_file) in err
    assert "Traceback" not in err


def test_missing_config_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_and_preset_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(get_preset("w8a8").to_yaml())
    code, _ = _quantize(tmp_path, "--config", str(config_file), "--preset", "w8a8")
    assert code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["quantize", "--epochs", "0"], [], ["frobnicate"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_output_is_a_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "file"
    target.write_text("")
    assert main(["quantize", "--output", str(target), *FAST]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_help_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--help"]) == 0
    assert "--preset" in capsys.readouterr().out


# ===================================================================== plan / presets
def test_plan_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.cli.digits import DigitsCNN

    assert main(["plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [name for name, _ in DigitsCNN().named_children()]
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in names}
    assert sorted(rows) == sorted(names)  # one row per module
    assert sum(1 for line in lines if line.split() and line.split()[0] in names) == len(names)
    for conv in ("conv1", "conv2"):
        assert "Conv2d" in rows[conv] and " yes " in rows[conv]
        assert "int8 per_tensor sym stats" in rows[conv]
        assert "int32 per_tensor sym stats" in rows[conv]
    assert " no " in rows["bn1"] and "int8" not in rows["bn1"]


def test_plan_with_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "w4a8_gptq"]) == 0
    out = capsys.readouterr().out
    assert "int4 per_channel sym stats" in out and "GPTQ" in out


def test_presets_lists_every_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    assert all(DESCRIPTIONS[line.split()[0]] in line for line in lines)


def test_example_config_file_loads() -> None:
    assert Config.from_file(EXAMPLES / "configs" / "w4a8_gptq.yaml") == get_preset("w4a8_gptq")
    assert yaml.safe_load((EXAMPLES / "configs" / "w4a8_gptq.yaml").read_text())["algo_config"][0]["name"] == "GPTQ"


# ===================================================================== subprocesses (slow)
def _env() -> dict[str, str]:
    # Offline, quiet and single-threaded children (the machines running this may have only 2 cores).
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow
def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("quark-brevitas")
    if not script.exists():
        found = shutil.which("quark-brevitas")
        if found is None:
            pytest.skip("the quark-brevitas console script is not installed")
        script = Path(found)
    out = tmp_path / "out"
    result = subprocess.run([str(script), "quantize", "--output", str(out), *FAST], capture_output=True, text=True,
                            timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _check_report(out)
    assert "quantized accuracy (onnxruntime)" in result.stdout


@pytest.mark.slow
def test_python_dash_m(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "quark_brevitas", "presets"], capture_output=True, text=True,
                            timeout=120, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in PRESETS)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ptq_digits.py", "export_onnx.py", "huggingface_bert.py", "custom_layer.py",
                                    "qat_digits.py"])
def test_example_runs(script: str, tmp_path: Path) -> None:
    if script == "huggingface_bert.py":
        pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True,
                            timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip()
    assert list(tmp_path.iterdir()) == []  # examples write to temporary directories only
