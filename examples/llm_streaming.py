"""Quantize a Hugging Face causal LM from its folder, one decoder block at a time, then generate text.

Nothing is downloaded: a small Llama is built from a ``LlamaConfig`` (random weights) and saved with
``save_pretrained`` to a temporary folder, as a real checkpoint would be. ``quantize_pretrained`` never loads
that float model as a whole: it reads one block's weights, quantizes the block with GPTQ on the block's cached
inputs, writes it to the output checkpoint and drops it (peak memory about one block). The checkpoint loads
without the float weights (``load_pretrained_quantized``) and generates with ``generate()``.

Run: ``python examples/llm_streaming.py`` (offline, under a minute; needs ``transformers`` and ``accelerate``).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quark_brevitas import Config, QLayerConfig, QTensorConfig, algos
from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained
from quark_brevitas.types import QSchemeType

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
torch.manual_seed(0)

config = Config(
    QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)),  # int4 weights
    pre_quant_opt_config=[],  # Hugging Face models cannot be FX-traced: no Preprocess
    algo_config=[algos.GPTQ()],
)
calibration = [{"input_ids": torch.randint(0, 256, (4, 32))} for _ in range(4)]

with tempfile.TemporaryDirectory() as tmp:
    folder, output = Path(tmp) / "llama", Path(tmp) / "llama-w4"
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(folder)
    quantize_pretrained(folder, config, calibration, output)
    print("checkpoint files:", ", ".join(sorted(p.name for p in output.iterdir())))

    model = load_pretrained_quantized(output)
    prompt = torch.tensor([[1, 17, 42]])
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
    print("quantized layers:", sum(type(m).__name__ == "QuantLinear" for m in model.modules()))
    print("generated token ids:", generated[0, prompt.shape[1]:].tolist())
