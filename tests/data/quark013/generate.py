"""Regenerate the Quark 0.13 config files in this folder (run with an interpreter that has amd-quark==0.13).

Not part of the test suite: the JSON files are the output of Quark's public API, saved so that the tests can read
what Quark writes without amd-quark installed. ``<scheme>.json`` is ``LLMTemplate.get("llama").get_config(...)
.to_dict()``; ``exported_config.json`` is the ``config.json`` Quark's own ``export_safetensors`` writes for a tiny
Llama (hidden size 64) quantized with ``int4_wo_32`` (its ``quantization_config`` carries the ``export`` section).

    python tests/data/quark013/generate.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
#: (file stem, scheme, algorithm)
CONFIGS = [("int4_wo_128", "int4_wo_128", None), ("uint4_wo_128_awq", "uint4_wo_128", "awq"),
           ("int4_wo_64_gptq", "int4_wo_64", "gptq"), ("int8", "int8", None), ("fp8", "fp8", None),
           ("ptpc_fp8", "ptpc_fp8", None), ("int4_wa_64", "int4_wa_64", None), ("mxfp4", "mxfp4", None),
           ("nvfp4", "nvfp4", None), ("amdfp4", "amdfp4", None), ("int4_fp8", "int4_fp8", None)]


def main() -> None:
    template = LLMTemplate.get("llama")
    for stem, scheme, algorithm in CONFIGS:
        config = template.get_config(scheme=scheme, algorithm=algorithm) if algorithm else template.get_config(scheme)
        (HERE / f"{stem}.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.eval()
    config = template.get_config(scheme="int4_wo_32", exclude_layers=["lm_head"])
    calib = [torch.randint(0, 128, (1, 16)) for _ in range(2)]
    quantized = ModelQuantizer(config).quantize_model(model, calib)
    quantized = ModelQuantizer.freeze(quantized)
    with tempfile.TemporaryDirectory() as work:
        export_safetensors(quantized, work, custom_mode="quark")
        exported = json.loads((Path(work) / "config.json").read_text())
    (HERE / "exported_config.json").write_text(json.dumps(exported, indent=2) + "\n")
    print("wrote", sorted(p.name for p in HERE.glob("*.json")), file=sys.stderr)


if __name__ == "__main__":
    main()
