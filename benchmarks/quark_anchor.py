"""AMD Quark 0.13 as the anchor, run in its own virtualenv and process, one measurement per call.

Not part of quark_brevitas (which never imports amd-quark): the benchmarks start this file with the anchor
virtualenv's interpreter (``--anchor-python``, default ``/work/anchor-venv/bin/python``) and read one JSON line
from its standard output. Each task rebuilds exactly the model and data our side of the benchmark builds (same
seeds, same shapes), quantizes it with Quark's ``ModelQuantizer`` and reports the CPU time of that call alone
(one torch thread), so that the two tools are compared in the same run.

Run by hand: ``/work/anchor-venv/bin/python -m benchmarks.quark_anchor '{"task": "speed", "recipe": "gptq",
"blocks": 4, "rows": 64}'``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

WIDTH, HEADS, SEQ = 256, 4, 128


def random_llama(blocks: int, vocab: int = 8192, intermediate: int = 768) -> torch.nn.Module:
    """The random Llama of benchmarks/llm.py's speed section (same seed, same config)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=WIDTH, intermediate_size=intermediate,
                                      num_hidden_layers=blocks, num_attention_heads=HEADS,
                                      num_key_value_heads=HEADS, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config).eval()


def _llama_algo(recipe: str, bits: int) -> tuple[Any, Any]:
    """(Quark QConfig, its algorithm) for ``recipe`` on a Llama, weights int``bits`` per group of 128."""
    from quark.torch import LLMTemplate
    from quark.torch.quantization.config import config as qc

    inside = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if recipe == "smoothquant":
        return LLMTemplate.get("llama").get_config(scheme="int8", algorithm="smoothquant"), None
    template = LLMTemplate.get("llama").get_config(scheme="int4_wo_128", algorithm=recipe)
    if bits == 3:
        spec = qc.Int3PerGroupSpec(ch_axis=-1, group_size=128, symmetric=True).to_quantization_spec()
        template.global_quant_config = qc.QLayerConfig(weight=spec)
    algo = {"gptq": lambda: qc.GPTQConfig(inside_layer_modules=inside, model_decoder_layers="model.layers"),
            "qronos": lambda: qc.QronosConfig(inside_layer_modules=inside, model_decoder_layers="model.layers"),
            "autoround": lambda: qc.AutoRoundConfig(inside_layer_modules=inside,
                                                    model_decoder_layers="model.layers"),
            "awq": lambda: None}[recipe]()
    if algo is not None:
        template.algo_config = [algo]
    return template, algo


def task_speed(args: dict[str, Any]) -> dict[str, Any]:
    """``recipe`` (gptq, awq, qronos, autoround, smoothquant) on the random Llama or a saved one (``model``),
    ``rows`` random rows of 128 tokens, batch 1 (or ``calib == "tokens"``: the token file's windows, batch 4)."""
    import transformers
    from quark.torch import ModelQuantizer

    if args.get("model"):
        model = transformers.AutoModelForCausalLM.from_pretrained(args["model"]).eval()
    else:
        model = random_llama(args["blocks"])
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, vocab, (1, SEQ), generator=generator) for _ in range(args["rows"])]
    if args.get("tokens"):  # the token windows our side reads (benchmarks/llm.py ``windows``)
        ids = torch.load(args["tokens"]).long()
        count = args.get("token_rows", 128)
        rows = list(ids[:count * SEQ].view(count, SEQ).split(4))
    config, _ = _llama_algo(args["recipe"], args.get("bits", 4))
    start, cpu = time.perf_counter(), time.process_time()
    quant = ModelQuantizer(config).quantize_model(model, rows)
    cpu_seconds, seconds = time.process_time() - cpu, time.perf_counter() - start
    with torch.no_grad():
        logits = quant(rows[0]).logits
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "logit_norm": float(logits.norm())}


TASKS = {"speed": task_speed}


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    request = json.loads(sys.argv[1])
    print(json.dumps(TASKS[request.pop("task")](request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
