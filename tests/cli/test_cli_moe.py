"""``quark-brevitas quantize --model DIR`` on a mixture-of-experts folder (issue 30): the folder's model is built with
its experts unfused, as the API quantizes a model after ``unfuse_experts``, and its experts are read from the
checkpoint's own tensor names (Mixtral's ``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2``, which
``save_pretrained`` writes); the quantized checkpoint and its GGUF hold every expert with the API's codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

for _name in ("transformers", "tokenizers", "accelerate", "gguf"):
    pytest.importorskip(_name)

import gguf  # noqa: E402
from helpers.families import build_moe  # noqa: E402
from helpers.llm_folders import FAST, text  # noqa: E402
from helpers.llm_models import bpe_tokenizer  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.cli import main  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.hf.streaming import load_pretrained_quantized  # noqa: E402
from quark_brevitas.model_parts.moe import unfuse_experts  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Mixtral folder (save_pretrained: Mixtral's checkpoint names), its calibration text, and the
    checkpoint ``quantize --model --preset gguf_q4_0 --export gguf`` wrote from it."""
    root = tmp_path_factory.mktemp("moe")
    folder = root / "mixtral"
    tokenizer = bpe_tokenizer(folder)
    build_moe("mixtral", vocab_size=len(tokenizer)).save_pretrained(folder)
    (root / "calib.txt").write_text(text(40, seed=1))
    out = root / "out"
    assert main(["quantize", "--model", str(folder), "--calib-text", str(root / "calib.txt"), "--output", str(out),
                 "--preset", "gguf_q4_0", "--export", "gguf", *FAST]) == 0
    return {"folder": folder, "checkpoint": out}


def _api_quantized(folder: Path) -> torch.nn.Module:
    """The same model through the API: loaded by transformers (which fuses the experts), unfused, quantized."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert unfuse_experts(model) == 2
    return ModelQuantizer(get_preset("gguf_q4_0")).quantize_model(model)


@pytest.mark.slow
def test_a_moe_folder_is_quantized_expert_by_expert_as_the_api_does(mixtral: dict[str, Path]) -> None:
    """Every expert of the checkpoint is a quantized layer with the codes the API gives it (so each read its own
    checkpoint tensor: w1 is gate, w3 up, w2 down); the router is read too and stays float."""
    quant = load_pretrained_quantized(mixtral["checkpoint"])
    api = _api_quantized(mixtral["folder"])
    for block, reference in zip(quant.model.layers, api.model.layers, strict=True):
        assert len(block.mlp.experts) == 4
        for expert, expected in zip(block.mlp.experts, reference.mlp.experts, strict=True):
            for name in ("gate_proj", "up_proj", "down_proj"):
                ours = getattr(expert, name)
                assert type(ours).__name__ == "QuantLinear", name
                assert torch.equal(ours.quant_weight().value, getattr(expected, name).quant_weight().value), name
        assert torch.equal(block.mlp.gate.weight, reference.mlp.gate.weight)
    tokens = torch.randint(0, quant.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(quant(tokens).logits, api(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_gguf_of_a_moe_folder_holds_every_experts_codes(mixtral: dict[str, Path]) -> None:
    """``--export gguf`` from the block-by-block checkpoint: llama.cpp's stacked expert tensors, each expert's
    slice dequantizing to the API model's quantized weight of that expert."""
    api = _api_quantized(mixtral["folder"])
    reader = gguf.GGUFReader(str(mixtral["checkpoint"] / "gguf" / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    for index, block in enumerate(api.model.layers):
        for proj in ("gate", "up", "down"):
            stored = tensors[f"blk.{index}.ffn_{proj}_exps.weight"]
            decoded = gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type)
            for expert_index, expert in enumerate(block.mlp.experts):
                expected = getattr(expert, f"{proj}_proj").quant_weight().value.detach().numpy()
                assert np.array_equal(decoded[expert_index], expected), (index, proj, expert_index)


@pytest.mark.slow
def test_the_compressed_tensors_folder_of_a_moe_folder_reloads_with_our_logits(mixtral: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """``--export compressed-tensors`` of the Mixtral folder (block by block; experts under Mixtral's checkpoint
    names): transformers in a fresh process fuses them back and computes the quantized checkpoint's logits."""
    import sys

    import transformers
    from helpers.consumer import MOE_LOGITS, run_consumer

    out = tmp_path / "ct"
    calib = mixtral["folder"].parent / "calib.txt"
    assert main(["quantize", "--model", str(mixtral["folder"]), "--calib-text", str(calib), "--output", str(out),
                 "--preset", "w4_weight_only", "--export", "compressed-tensors", *FAST]) == 0
    quant = load_pretrained_quantized(out)
    assert all(type(e.down_proj).__name__ == "QuantLinear" for b in quant.model.layers for e in b.mlp.experts)
    tokens = torch.randint(0, quant.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    site_packages = str(Path(transformers.__file__).resolve().parents[1])
    theirs = run_consumer(MOE_LOGITS, [out / "compressed-tensors"], tokens, tmp_path, python=sys.executable,
                          pythonpath=site_packages)
    assert theirs["experts"] == "MixtralExperts"
    with torch.no_grad():
        torch.testing.assert_close(theirs["logits"], quant(tokens).logits, rtol=0, atol=1e-5)
