"""The command line on real flows and in real trouble (issue 22): a Hugging Face checkpoint from ``quantize --model``
re-exported, ``plan --model``, a binary ``--config``, a model folder without a tokenizer, the base install without
the optional extras (examples writing outside the repository: tests/analysis/test_analysis_cli.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quark_brevitas import Config
from quark_brevitas.cli import main
from quark_brevitas.errors import ConfigError
from quark_brevitas.extras import MissingExtraError, available, require

BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00\x01"
LLM_FAST = ["--seq-len", "16", "--batch-size", "2", "--calib-sequences", "4", "--eval-sequences", "2", "-q"]


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ===================================================================== 2. binary --config
@pytest.mark.parametrize("name", ["model.json", "model.yaml"])
def test_binary_config_file_is_a_one_line_error(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / name
    path.write_bytes(BINARY)
    with pytest.raises(ConfigError, match="is not text .byte 0 is not UTF-8.; a JSON or YAML config"):
        Config.from_file(path)
    assert main(["plan", "--config", str(path)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert str(path) in line and "JSON or YAML" in line


# ===================================================================== 4. optional extras
def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, extra in (("transformers", "hf"), ("accelerate", "hf"), ("matplotlib", "plot"),
                          ("qonnx.core.modelwrapper", "qonnx")):
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):  # the package and each submodule, also when an earlier test imported it
            monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), None)
        with pytest.raises(MissingExtraError, match=f'pip install "quark_brevitas\\[{extra}\\]"') as caught:
            require(module, "this feature")
        assert isinstance(caught.value, ImportError) and caught.value.extra == extra
        assert not available(module)
    assert require("json", "x").dumps([1]) == "[1]" and available("json")


# ===================================================================== Hugging Face folders


@pytest.fixture(scope="module")
def llama_parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama folder with its tokenizer (built as tests/cli/test_llm_cli.py does), the same weights without a
    tokenizer, and calibration text."""
    for name in ("transformers", "tokenizers", "accelerate"):  # the hf extra; the tests above run without it
        pytest.importorskip(name)
    import transformers
    from helpers.llm_folders import text as _text
    from helpers.llm_folders import word_tokenizer as _tokenizer

    torch.manual_seed(0)
    tokenizer = _tokenizer("causal")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    root = tmp_path_factory.mktemp("llama_parts")
    full, bare = root / "llama", root / "llama_no_tokenizer"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(full)
    tokenizer.save_pretrained(full)
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(full / name, bare / name)
    calib = root / "calib.txt"
    calib.write_text(_text(40, seed=1))
    return {"full": full, "bare": bare, "calib": calib, "root": root}


def test_model_folder_without_tokenizer(llama_parts: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    bare = llama_parts["bare"]
    assert main(["quantize", "--model", str(bare), "--calib-text", str(llama_parts["calib"]), "--output",
                 str(tmp_path / "out"), *LLM_FAST]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert str(bare) in line and "has no tokenizer" in line and "tokenizer.json" in line and "--tokenizer" in line


def test_missing_transformers_says_which_extra(llama_parts: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what the base install (no [hf]) looks like
    for args in (["quantize", "--model", str(llama_parts["full"]), "--calib-text", str(llama_parts["calib"]),
                  "--output", str(tmp_path / "out"), *LLM_FAST],
                 ["plan", "--model", str(llama_parts["full"])]):
        assert main(args) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert 'pip install "quark_brevitas[hf]"' in line and "'transformers'" in line, line


def test_plan_model_without_weights_shows_inferred_structure(llama_parts: dict[str, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    only_config = tmp_path / "config_only"  # no weights at all: the plan must not read them
    only_config.mkdir()
    shutil.copy(llama_parts["full"] / "config.json", only_config / "config.json")
    config = tmp_path / "awq.yaml"
    config.write_text("global_quant_config:\n  weight: {qscheme: per_group, group_size: 16, bit_width: 4}\n"
                      "pre_quant_opt_config: []\nalgo_config:\n- {name: awq, sym: true, group_size: 16}\n")
    assert main(["plan", "--model", str(only_config), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"LlamaForCausalLM plan ({only_config}; file {config};")
    assert "block stack: 2 blocks in model.layers" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("model.", "lm_head"))}
    assert rows["model.layers.1.mlp.down_proj"][2:6] == ["yes", "int4", "per_group", "g16"]
    assert rows["model.embed_tokens"][2] == "no"
    for group in ("input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                  "self_attn.v_proj -> self_attn.o_proj", "mlp.up_proj -> mlp.down_proj"):
        assert group in out
    assert main(["plan", "--model", str(tmp_path)]) == 2  # not a model folder
    assert "no config.json" in _one_line_error(capsys.readouterr().err)


@pytest.fixture(scope="module")
def llm_checkpoint(llama_parts: dict[str, Path]) -> Path:
    """``quantize --model`` on the folder without a tokenizer, the tokenizer given with ``--tokenizer``."""
    out = llama_parts["root"] / "out"
    assert main(["quantize", "--model", str(llama_parts["bare"]), "--tokenizer", str(llama_parts["full"]),
                 "--calib-text", str(llama_parts["calib"]), "--output", str(out), *LLM_FAST]) == 0
    return out


def _ort_logits(path: Path, example: dict[str, torch.Tensor]) -> np.ndarray:
    from quark_brevitas.export import create_ort_session

    session = create_ort_session(path)
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {name: example[name].numpy() for name in names})[0]


@pytest.mark.slow
def test_export_takes_the_quantize_model_checkpoint(llm_checkpoint: Path, llama_parts: dict[str, Path],
                                                    tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import transformers

    from quark_brevitas.hf.streaming import load_pretrained_quantized

    assert (llm_checkpoint / "float_model" / "tokenizer.json").is_file()  # --tokenizer's tokenizer, saved
    onnx_path = tmp_path / "llama.onnx"
    assert main(["export", str(llm_checkpoint), "--output", str(onnx_path), "-q"]) == 0
    table = capsys.readouterr().out
    assert "LlamaForCausalLM from the checkpoint's float_model/config.json" in table
    assert f"a sentence through the tokenizer in {llm_checkpoint / 'float_model'}, shape [1, 16]" in table
    # Independently of the export's own check: onnxruntime on other tokens agrees with the loaded checkpoint.
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_parts["full"])
    example = dict(tokenizer("a lazy dog sleeps near the red house", return_tensors="pt"))
    with torch.no_grad():
        reference = load_pretrained_quantized(llm_checkpoint)(**example).logits.numpy()
    assert reference.shape == (1, 8, len(tokenizer))
    np.testing.assert_allclose(_ort_logits(onnx_path, example), reference, atol=1e-3)

    # Without a saved tokenizer: random token ids of the default shape, with an attention mask.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (llm_checkpoint / "float_model" / name).unlink()
    assert main(["export", str(llm_checkpoint), "--output", str(tmp_path / "random.onnx"), "-q"]) == 0
    assert "random token ids, shape [1, 16], full attention mask" in capsys.readouterr().out
    assert main(["export", str(llm_checkpoint), "--output", str(tmp_path / "shape.onnx"), "--input-shape", "2,8",
                 "-q"]) == 0
    assert "random token ids, shape [2, 8]" in capsys.readouterr().out


# ===================================================================== 5. analyze without matplotlib
@pytest.mark.slow
def test_analyze_without_matplotlib_prints_and_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "analysis"
    assert main(["analyze", "--output", str(out), "--epochs", "3", "--batches", "1", "-q"]) == 0
    captured = capsys.readouterr()
    assert "most sensitive:" in captured.out and "hurts most:" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["layers.csv", "layers.json", "sensitivity.csv",
                                                      "sensitivity.json"]
    assert 'plots skipped' in captured.err and 'pip install "quark_brevitas[plot]"' in captured.err
