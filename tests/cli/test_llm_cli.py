"""``quark-brevitas quantize --model DIR --calib-text FILE``: a Hugging Face folder quantized block by block,
with perplexity (or embedding cosine) before and after, checked against Hugging Face's own loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")

from helpers.llm_folders import text as _text  # noqa: E402
from helpers.llm_folders import word_tokenizer as _tokenizer  # noqa: E402

from quark_brevitas.checkpoint import load_quantized  # noqa: E402
from quark_brevitas.cli import main  # noqa: E402
from quark_brevitas.hf.lm import PerplexityMeter, split_held_out, text_batches  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    tokenizer = _tokenizer("causal")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _hf_perplexity(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Hugging Face's own shifted cross-entropy (``labels=``, a mean per batch), weighted by each batch's
    predicted tokens."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            count = batch["input_ids"][:, 1:].numel()
            total += float(model(**batch, labels=batch["input_ids"]).loss) * count
            tokens += count
    return math.exp(total / tokens)


def test_causal_lm(llama_dir, tmp_path, capsys) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(_text(60, seed=1))
    out = tmp_path / "out"
    args = ["quantize", "--model", str(llama_dir), "--calib-text", str(calib), "--output", str(out), "--seq-len",
            "16", "--batch-size", "2", "--calib-sequences", "8", "--eval-sequences", "6", "--prompt", "the quick",
            "--max-new-tokens", "5"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "perplexity float" in table and "perplexity quantized" in table and "block by block" in table
    report = json.loads((out / "report.json").read_text())
    # Independent reference: the float model in memory and Hugging Face's loss on the same held-out windows.
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    held_out = text_batches(tokenizer, split_held_out(calib.read_text())[1], seq_len=16, batch_size=2,
                            max_sequences=6)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    assert report["float_value"] == pytest.approx(_hf_perplexity(float_model, held_out), rel=1e-4)
    quantized = load_quantized(float_model, out)
    assert report["quant_value"] == pytest.approx(_hf_perplexity(quantized, held_out), rel=1e-4)
    assert report["quant_value"] != report["float_value"]
    assert isinstance(report["sample"], str) and report["sample"].split()
    assert (out / "float_model" / "tokenizer.json").is_file()


def test_perplexity_meter_skips_padding() -> None:
    logits = torch.randn(1, 4, 5)
    ids = torch.tensor([[1, 2, 3, 0]])
    meter = PerplexityMeter()
    meter.add(logits, {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    expected = torch.nn.functional.cross_entropy(logits[0, :2], ids[0, 1:3])
    assert meter.tokens == 2 and meter.perplexity == pytest.approx(math.exp(float(expected)), rel=1e-6)


def test_encoder(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    tokenizer = _tokenizer("encoder")
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    folder = tmp_path / "bert"
    transformers.BertModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text(_text(40, seed=2))
    assert main(["quantize", "--model", str(folder), "--calib-text", str(calib), "--output", str(tmp_path / "out"),
                 "--preset", "w8a8_per_channel", "--seq-len", "16"]) == 0
    assert "embedding cosine vs float quantized" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["kind"] == "encoder" and report["float_value"] == 1.0 and 0.9 < report["quant_value"] < 1.0


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "{dir}"], "--model needs --calib-text"),
    (["--calib-text", "{file}"], "--calib-text needs --model"),
    (["--model", "{file}", "--calib-text", "{file}"], "is not a Hugging Face model folder"),
])
def test_bad_arguments(tmp_path, capsys, args, message) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    filled = [a.format(dir=tmp_path, file=text) for a in args]
    assert main(["quantize", "--output", str(tmp_path / "out"), *filled]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_streaming_example_runs(tmp_path) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "llm_streaming.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "model-block-00003.safetensors" in result.stdout and "quantized layers: 29" in result.stdout
    assert list(tmp_path.iterdir()) == []
