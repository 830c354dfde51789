"""The llama.cpp rows of ``benchmarks/llm_deploy.py`` (issue 18, item 6), where ``llama-cpp-python`` is installed (an
optional extra, ``pip install -c constraints.txt -e ".[llamacpp]"``: it compiles llama.cpp, several minutes).

* perplexity of each GGUF file of the trained Llama as llama.cpp computes it (its own kernels: a Q4_0 product
  quantizes the activations to 8 bits per block of 32, so it is close to, not equal to, what the file's weights
  give in float);
* decode tokens/s of the 1024-wide speed Llama: the float model as an F32 GGUF file and ours as Q4_0, batch 1,
  ``new_tokens`` greedy tokens after the prompt, 1 and 2 threads.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def missing() -> str | None:
    """Why the llama.cpp rows cannot run here, or ``None``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python not installed (the optional extra [llamacpp])"
    return None


def _load(path: Path, context: int, threads: int = 1, all_logits: bool = False) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           logits_all=all_logits, verbose=False)


def perplexity(path: Path, windows: list[dict[str, torch.Tensor]]) -> float:
    """exp(mean next-token cross-entropy) over every sequence of ``windows``, each evaluated from an empty
    context (the same tokens and weighting as transformers' loss over the windows)."""
    ids = [row.tolist() for batch in windows for row in batch["input_ids"]]
    model = _load(path, max(len(row) for row in ids), all_logits=True)
    total, count = 0.0, 0
    for row in ids:
        model.reset()
        model.eval(row)
        logits = np.asarray(model.scores[:len(row) - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= float(log_probs[np.arange(len(row) - 1), row[1:]].sum())
        count += len(row) - 1
    return math.exp(total / count)


def decode_tokens_per_s(path: Path, prompt: list[int], new_tokens: int, threads: int) -> float:
    """Greedy decoding of ``new_tokens`` after ``prompt`` (batch 1); tokens/s of the one-token steps."""
    model = _load(path, len(prompt) + new_tokens + 8, threads)
    model.reset()
    model.eval(prompt)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        model.eval([token])
    return new_tokens / (time.perf_counter() - start)


def float_gguf(float_model: torch.nn.Module, tokenizer_dir: Path, out: Path) -> Path:
    """``float_model`` as an all-F32 GGUF file with our exporter's names and metadata and the tokenizer of
    ``tokenizer_dir`` (the float baseline llama.cpp runs)."""
    from quark_brevitas.export.gguf.writer import collect_gguf_tensors, plan_gguf, write_gguf

    config = float_model.config
    plan = plan_gguf(config, None, tokenizer_dir)
    with torch.no_grad():
        tensors = collect_gguf_tensors(float_model, plan.family, plan.name_map, config)
    return write_gguf(plan, config, tensors, out)


def speed_rows(float_model: torch.nn.Module, quant: torch.nn.Module, work: Path, prompt: list[int],
               new_tokens: int, threads: list[int], repeats: int) -> dict[str, tuple[Path, dict[int, float]]]:
    """``{row: (file, {threads: median tokens/s})}`` of the float model (F32) and ``quant`` (GGUF Q4_0) in
    llama.cpp, repetitions interleaved."""
    from benchmarks import llm
    from quark_brevitas.export import export_gguf

    folder = llm.trained_llama(200)  # its tokenizer: the speed model has the same vocabulary
    files = {"float GGUF (F32), llama.cpp": float_gguf(float_model, folder, work / "speed_float_gguf"),
             "ours RTN GGUF Q4_0, llama.cpp": export_gguf(quant, work / "speed_q4_0_gguf", tokenizer_path=folder)}
    result: dict[str, tuple[Path, dict[int, float]]] = {name: (path, {}) for name, path in files.items()}
    for n_threads in threads:
        samples: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(repeats):
            for name, path in files.items():
                samples[name].append(decode_tokens_per_s(path, prompt, new_tokens, n_threads))
        for name, values in samples.items():
            result[name][1][n_threads] = float(np.median(values))
    return result
