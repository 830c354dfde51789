"""Never lose the user's files: outputs appear whole or not at all (quark_brevitas.outputs), a folder of
someone else's files (the input model's folder above all) is refused unless overwrite is asked for, and then
only our entries are replaced."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.checkpoint import load_quantized, save_quantized
from quark_brevitas.cli import main
from quark_brevitas.export.onnx import orchestrate
from quark_brevitas.outputs import MARKER_FILE, OutputError, add_file, output_dir, write_file

W8 = Config(QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[], algo_config=[])


def _quantized() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    return ModelQuantizer(W8).quantize_model(model, [torch.randn(2, 6)])


def _hf_like_folder(folder: Path) -> dict[str, bytes]:
    """A folder that looks like a Hugging Face model's: what the user must not lose."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"model.safetensors": b"float weights", "config.json": b'{"model_type": "llama"}',
             "tokenizer.json": b"{}"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# ===================================================================== the helpers
def test_write_file_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")

    def fail(path: Path) -> None:
        path.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_file(target, fail)
    assert _contents(tmp_path) == {"model.onnx": b"old"}  # no temporary file left either
    write_file(target, lambda p: p.write_bytes(b"new"))
    assert _contents(tmp_path) == {"model.onnx": b"new"}


def test_onnx_save_model_replaces_the_file_only_when_complete(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "m.onnx"
    target.write_bytes(b"previous export")

    def broken_save(proto: onnx.ModelProto, path: str, **kwargs) -> None:
        Path(path).write_bytes(b"trunc")
        raise ValueError("2 GiB protobuf limit")

    monkeypatch.setattr(orchestrate.onnx, "save_model", broken_save)
    with pytest.raises(orchestrate.ExportError, match="2 GiB"):
        orchestrate.save_model(onnx.ModelProto(), target)
    assert _contents(tmp_path) == {"m.onnx": b"previous export"}


def test_output_dir_is_moved_into_place_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with output_dir(out) as work:
        (work / "a.txt").write_text("1")
        (work / "b.txt").write_text("1")
    assert json.loads((out / MARKER_FILE).read_text()) == {"written_by_quark_brevitas": ["a.txt", "b.txt"]}
    with pytest.raises(RuntimeError), output_dir(out) as work:
        (work / "a.txt").write_text("2")
        raise RuntimeError("interrupted")
    assert (out / "a.txt").read_text() == "1"  # never half-overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary sibling is gone
    with output_dir(out) as work:  # our own folder: replaced as a whole (b.txt was ours and is not rewritten)
        (work / "a.txt").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == [MARKER_FILE, "a.txt"]
    add_file(out, "report.json", lambda p: p.write_text("{}"))  # a later addition is ours too
    with output_dir(out) as work:
        (work / "a.txt").write_text("4")
    assert sorted(p.name for p in out.iterdir()) == [MARKER_FILE, "a.txt"]


# ===================================================================== save_quantized
def test_save_quantized_refuses_a_model_folder(tmp_path: Path) -> None:
    folder = tmp_path / "hf_model"
    files = _hf_like_folder(folder)
    model = _quantized()
    with pytest.raises(OutputError, match=r"hf_model.*holds files quark_brevitas did not write \(config\.json, "
                                          r"model\.safetensors, tokenizer\.json\).*overwrite=True \(--overwrite"):
        save_quantized(model, folder)
    assert _contents(folder) == files
    save_quantized(model, folder, overwrite=True)  # asked for: our entries replaced, the others kept
    assert (folder / "tokenizer.json").read_bytes() == b"{}"
    assert (folder / "model.safetensors").read_bytes() != files["model.safetensors"]
    loaded = load_quantized(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), folder)
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_save_quantized_replaces_its_own_checkpoint(tmp_path: Path) -> None:
    model = _quantized()
    save_quantized(model, tmp_path / "ckpt", example_input=torch.randn(1, 6))
    save_quantized(model, tmp_path / "ckpt")  # ours: no flag needed; the stale example input goes
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        MARKER_FILE, "config.json", "manifest.json", "model.safetensors"]
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")  # the user's file in it: no longer only ours
    with pytest.raises(OutputError, match="notes.txt"):
        save_quantized(model, tmp_path / "ckpt")


# ===================================================================== the command line
def test_cli_quantize_refuses_a_folder_of_other_files_before_training(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "mine"
    files = _hf_like_folder(folder)
    assert main(["quantize", "--output", str(folder), "--epochs", "1"]) == 2
    error = capsys.readouterr().err
    assert "--output" in error and "--overwrite" in error and "holds files quark_brevitas did not write" in error
    assert _contents(folder) == files
    assert main(["quantize", "--output", str(tmp_path / "out"), "--save-checkpoint", str(folder)]) == 2
    assert "--save-checkpoint" in capsys.readouterr().err
    assert _contents(folder) == files


def test_cli_quantize_never_writes_into_the_model_folder(tmp_path: Path, capsys) -> None:
    """The user trial: ``quantize --model DIR --output DIR`` deleted the float model.safetensors, exit code 0."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    before = _contents(folder)
    (tmp_path / "calib.txt").write_text("some text\n")
    for overwrite in ([], ["--overwrite"]):
        code = main(["quantize", "--model", str(folder), "--calib-text", str(tmp_path / "calib.txt"),
                     "--output", str(folder), *overwrite])
        assert code == 2
        assert "is the input model folder" in capsys.readouterr().err
    assert _contents(folder) == before
