"""``quark-brevitas quantize --model DIR --export gguf|compressed-tensors|quark|onnx`` and ``quark-brevitas export
CKPT --format gguf|compressed-tensors|quark`` on a tiny Llama folder with a byte-level BPE tokenizer: what they
write is what the consumers (transformers' GGUF loader, transformers with compressed-tensors, onnxruntime) run as
our quantized model (Quark's folder: the tensors export_safetensors writes), and a model a format cannot hold is
one line on stderr."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

for _name in ("transformers", "tokenizers", "accelerate", "gguf"):
    pytest.importorskip(_name)

import gguf  # noqa: E402
import transformers  # noqa: E402
from helpers.llm_folders import FAST, tiny_llama_folder  # noqa: E402

from quark_brevitas.cli import main  # noqa: E402
from quark_brevitas.hf.streaming import load_pretrained_quantized  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama folder (hidden 32: one GGUF block per row) with a byte-level BPE tokenizer, calibration
    text, and the checkpoint ``quantize --model --preset gguf_q4_0 --export gguf`` wrote from it."""
    root = tmp_path_factory.mktemp("deploy")
    folder = tiny_llama_folder(root)
    calib = root / "calib.txt"
    checkpoint = root / "ckpt"
    status = main(["-q", "quantize", "--model", str(folder), "--calib-text", str(calib), "--output", str(checkpoint),
                   "--preset", "gguf_q4_0", "--export", "gguf", *FAST])
    assert status == 0
    return {"model": folder, "calib": calib, "checkpoint": checkpoint, "root": root}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(5))


def _ours(checkpoint: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_pretrained_quantized(checkpoint)(_tokens()).logits


def _gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def test_quantize_export_gguf_is_what_transformers_loads(llama: dict[str, Path]) -> None:
    path = llama["checkpoint"] / "gguf" / "model.gguf"
    assert path.is_file()
    tensors = _gguf_tensors(path)
    assert sum(kind == "Q4_0" for kind, _ in tensors.values()) == 15  # 7 Linear layers per block, output
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        theirs = loaded(_tokens()).logits
    torch.testing.assert_close(theirs, _ours(llama["checkpoint"]), rtol=0.0, atol=1e-5)
    # the tokenizer travels in the file: transformers reads it back from the GGUF
    gguf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert gguf_tokenizer("the lazy fox")["input_ids"][-3:] == \
        transformers.AutoTokenizer.from_pretrained(llama["model"])("the lazy fox")["input_ids"][-3:]


def test_export_gguf_from_the_streamed_checkpoint_equals_quantizes_file(llama: dict[str, Path], tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gguf"
    assert main(["-q", "export", str(llama["checkpoint"]), "--format", "gguf", "--output", str(out)]) == 0
    assert "rebuilt block by block" in capsys.readouterr().out
    written, expected = _gguf_tensors(out / "model.gguf"), _gguf_tensors(llama["checkpoint"] / "gguf" / "model.gguf")
    assert written.keys() == expected.keys()
    for name, (kind, data) in expected.items():
        assert written[name][0] == kind and np.array_equal(written[name][1], data), name


def test_export_compressed_tensors_loads_in_transformers(llama: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ct"
    assert main(["-q", "export", str(llama["checkpoint"]), "--format", "compressed-tensors", "--output",
                 str(out)]) == 0
    assert (out / "tokenizer.json").is_file()
    config = (out / "config.json").read_text()
    assert '"quant_method": "compressed-tensors"' in config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = loaded(_tokens()).logits
    torch.testing.assert_close(theirs, _ours(llama["checkpoint"]), rtol=0.0, atol=1e-5)


def test_export_quark_that_cannot_pack_the_lm_head_is_one_line_error(llama: dict[str, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """Quark packs per-group int4 codes along the output axis: a 61-token lm_head does not fit, named on one line."""
    status = main(["-q", "export", str(llama["checkpoint"]), "--format", "quark", "--output", str(tmp_path / "q")])
    assert status == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "layer 'lm_head': 61 output channels are not a multiple of 8" in line and "Quark's format holds" in line
    assert not (tmp_path / "q").exists()


@pytest.mark.slow
def test_quantize_export_quark_writes_what_export_safetensors_writes(llama: dict[str, Path], tmp_path: Path) -> None:
    """``quantize --model --export quark`` (block by block) writes, with the tokenizer, the tensors
    export_safetensors(format="quark") writes for the rebuilt model."""
    import json

    from safetensors.torch import load_file

    from quark_brevitas.export import export_safetensors

    checkpoint = tmp_path / "ckpt"
    assert main(["-q", "quantize", "--model", str(llama["model"]), "--calib-text", str(llama["calib"]), "--output",
                 str(checkpoint), "--preset", "gguf_q8_0", "--export", "quark", *FAST]) == 0
    out = checkpoint / "quark"
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "quark" and config["global_quant_config"]["weight"]["dtype"] == "int8"
    whole = export_safetensors(load_pretrained_quantized(checkpoint), tmp_path / "whole", "quark")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = {}
    for file in set(index["weight_map"].values()):
        written.update(load_file(str(out / file)))
    expected = load_file(str(whole / "model.safetensors"))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_quantize_export_onnx_and_compressed_tensors(llama: dict[str, Path], tmp_path: Path) -> None:
    import onnx

    out = tmp_path / "ckpt"
    base = ["-q", "quantize", "--model", str(llama["model"]), "--calib-text", str(llama["calib"]), "--output",
            str(out), "--preset", "gguf_q4_1", *FAST]
    assert main([*base, "--export", "onnx"]) == 0
    graph = onnx.load(str(out / "onnx" / "model.onnx")).graph
    assert {node.op_type for node in graph.node} & {"MatMulNBits", "DequantizeLinear"}
    assert main([*base, "--export", "compressed-tensors", "--no-resume"]) == 0  # rerun into the same folder
    assert (out / "compressed-tensors" / "config.json").is_file()
    assert not (out / "onnx").exists()  # written from the replaced checkpoint: removed with it, never left stale


def _one_line_error(err: str) -> str:
    """The one ``error:`` line (after any logged warnings), with no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


def test_model_gguf_cannot_hold_is_one_line_error(llama: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    status = main(["-q", "quantize", "--model", str(llama["model"]), "--calib-text", str(llama["calib"]),
                   "--output", str(tmp_path / "ckpt"), "--preset", "w4_weight_only", "--export", "gguf", *FAST])
    assert status == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "per channel" in line and "Q4_0" in line and "model.layers.0." in line
    assert "--export gguf" in line and "refused before quantizing" in line  # the plan is checked first (issue 27)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()


def test_export_without_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["quantize", "--export", "gguf", "--output", str(tmp_path / "o")]) == 2
    assert "--export needs --model" in _one_line_error(capsys.readouterr().err)
