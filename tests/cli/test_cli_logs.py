"""What ``quark-brevitas quantize --model DIR --export FORMAT`` says on stderr (issue 27 item 6): log lines name
the final paths (not the temporary folder a format is built in), no FX-tracing warning for a Hugging Face model
under a preset's default Preprocess, Python warnings only through ``logging``, no library chatter at INFO."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

for _name in ("transformers", "tokenizers", "gguf"):
    pytest.importorskip(_name)


from helpers.llm_folders import FAST, tiny_llama_folder  # noqa: E402

from quark_brevitas.cli import main  # noqa: E402

TIMESTAMPED = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR)\b")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("logs"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed-tensors", "gguf"])
def test_quantize_export_logs_final_paths_and_no_tracing_warning(llama_folder: Path, tmp_path: Path, fmt: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    status = main(["quantize", "--model", str(llama_folder), "--calib-text", str(llama_folder.parent / "calib.txt"),
                   "--output", str(out), "--preset", "gguf_q8_0", "--export", fmt, *FAST])
    err = capsys.readouterr().err
    assert status == 0, err
    wrote = [line for line in err.splitlines() if " Wrote " in line]
    assert any(str(out / fmt) in line for line in wrote), wrote
    assert ".tmp" not in err and ".partial" not in "\n".join(wrote), wrote
    assert "Preprocess:" not in err  # the default Preprocess on a Hugging Face model: no tracing warning
    assert "Little Endian" not in err  # gguf's INFO chatter
    # Every line is a log record (or the continuation of a multi-line one): no warning printed around logging.
    stray = [line for line in err.splitlines() if re.match(r"^\S+\.py:\d+: \w*Warning", line)]
    assert not stray, stray
    assert TIMESTAMPED.match(err.splitlines()[0]), err.splitlines()[0]


STAGE_LINES = ("Applying Pre-Processing", "Quantized ", "Applying quantization")


@pytest.mark.slow
def test_each_stage_is_logged_once_when_the_checkpoint_is_reloaded(llama_folder: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Block by block, the streamed checkpoint is loaded again for evaluation and for the export: those reloads
    rebuild the structure without saying so again at INFO (they repeated "Applying Pre-Processing ..." and
    "Quantized 1 layers" once per reload), while -v still shows them at DEBUG."""
    args = ["quantize", "--model", str(llama_folder), "--calib-text", str(llama_folder.parent / "calib.txt"),
            "--preset", "gguf_q8_0", "--export", "compressed-tensors", *FAST]
    assert main([*args, "--output", str(tmp_path / "quiet")]) == 0
    info = [line for line in capsys.readouterr().err.splitlines() if " INFO " in line]
    for stage in STAGE_LINES:
        said = [line for line in info if stage in line]
        assert len(said) <= 1, said
    assert sum("Applying Pre-Processing" in line for line in info) == 1, info
    assert sum("Quantized 1 layers" in line for line in info) == 1, info  # lm_head, outside the blocks
    assert main(["-v", *args, "--output", str(tmp_path / "verbose")]) == 0
    debug = [line for line in capsys.readouterr().err.splitlines() if " DEBUG " in line]
    assert sum("Applying Pre-Processing" in line for line in debug) >= 2, debug  # the reloads, at DEBUG


def test_the_digits_run_logs_its_final_paths_not_the_temporary_folder(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """README's first command logged ``exported .quark_brevitas_output.partial-xxxx/digits_quant.onnx``: the ONNX
    exporter names the file it wrote, inside the temporary folder the run is moved from. Every record through the
    command line's handler now names the final folder."""
    out = tmp_path / "out"
    assert main(["quantize", "--output", str(out), "--epochs", "2"]) == 0
    err = capsys.readouterr().err
    assert ".partial-" not in err, [line for line in err.splitlines() if ".partial-" in line]
    assert f"exported {out / 'digits_quant.onnx'}" in err
