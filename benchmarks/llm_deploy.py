"""Deploying a quantized Llama: one table, a row per format (issue 18, item 6).

Run: ``python -m benchmarks.llm_deploy`` (a few minutes; ``--quick`` for a smoke run). It needs the trained Llama
of ``benchmarks/llm.py`` (``benchmarks/.cache/llm/llama-4x256-200steps``; trained by that script's cache on first
use, about ten minutes on 2 cores).

ONNX rows (this file), measured in one run:

* **float ONNX**: the float model exported with its key/value cache (``export_onnx_qcdq(past_key_values=True)``);
* **ours, MatMulNBits**: W4 per-group 128 (symmetric int4; round-to-nearest and GPTQ) exported the same way, the
  weights as onnxruntime's ``MatMulNBits`` with our codes and scales (``int4_kernel="matmulnbits"``, the default);
* **onnxruntime MatMulNBitsQuantizer**: onnxruntime's own quantizer (RTN, block size 128, its defaults: asymmetric,
  no accuracy level = float32) run on the float ONNX file of the same run;
* **onnxruntime MatMulNBitsQuantizer ... accuracy_level 4**: the same quantizer asked for ``accuracy_level=4``
  (int8 inputs per block, the kernel of the W4 + A8 rows), so our W4 + A8 file meets onnxruntime's own file on
  the same kernel;
* **ours W4 g128 + A8 g128, MatMulNBits level 4, fused**: the same int4 weights (RTN and GPTQ) with every Linear
  input quantized dynamically to symmetric int8 per group of 128 input features (``input_tensors=QTensorConfig(
  dtype=int8, qscheme=per_group, group_size=128, is_dynamic=True)``), whose codes are MLAS's (``x * (127 / max|x|)``
  rounded half to even, scale ``max|x| / 127``): what ``MatMulNBits`` computes at ``accuracy_level=4``, so the
  export feeds the raw float input to that kernel (no quantization ops in the file) and verifies the file against
  this quantized model like every other;
* for comparison only, the weight-only file edited to ``accuracy_level=4`` (onnxruntime quantizes the activations
  on the fly: the speed of the row above, but no longer what the weight-only model computes, so the export never
  writes it).

Columns: file size; perplexity of what onnxruntime computes on the trained Llama (4 blocks, 256 wide; held-out
docstrings, ``--eval`` sequences of 128 tokens, each run as one prompt step with an empty past); decode speed on a
larger Llama built from a config with random weights (1024 wide, 8 blocks, intermediate 2816, vocabulary 4096):
batch 1, a 128-token prompt, then 128 new tokens one step at a time feeding the presents back as pasts, tokens/s
of those 128 steps (the prompt step excluded), onnxruntime's default session with 1 and 2 intra-op threads. The
files are timed interleaved (each repetition runs every file once, in a rotated order) and the median is printed:
the CPU is shared, so single runs are noisy.

GGUF (ours RTN and GPTQ Q4_0, the ``gguf`` package's own RTN Q4_0) and compressed-tensors rows: perplexity of
what transformers computes loading each file (``benchmarks/llm_deploy_hf.py``; ``--skip formats`` leaves them out).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import (
    llamacpp,  # noqa: E402
    llm,  # noqa: E402  (the trained Llama, its tokens and its recipes)
)
from benchmarks.llm_deploy_hf import section_formats  # noqa: E402
from benchmarks.tables import format_table  # noqa: E402

SPEED_WIDTH, SPEED_INTERMEDIATE, SPEED_BLOCKS, SPEED_HEADS = 1024, 2816, 8, 16
BLOCK = 128
PROMPT, NEW_TOKENS = 128, 128
#: The comparison row of a file edited to accuracy_level 4 (not what the export writes: not exact).
LEVEL4 = "ours W4 g128 weight-only file edited to accuracy_level 4 (not exact)"
#: The rows of the recipes with int8 inputs per group of 128 (MatMulNBits at accuracy_level 4, exact).
A8_ROWS = {"ours RTN W4 g128 + A8 g128, MatMulNBits level 4, fused": "rtn_w4_g128",
           "ours GPTQ W4 g128 + A8 g128, MatMulNBits level 4, fused": "gptq_w4_g128"}
#: onnxruntime's own quantizer, as it writes by default (float32 arithmetic) and asked for accuracy_level 4.
ORT_ROWS = {"onnxruntime MatMulNBitsQuantizer (RTN, asym, g128)": None,
            "onnxruntime MatMulNBitsQuantizer (RTN, asym, g128), accuracy_level 4": 4}


@dataclass
class Row:
    """One format: its file sizes (trained / speed model), perplexity and decode tokens/s by thread count."""

    name: str
    size_mb: float | None = None
    speed_size_mb: float | None = None
    perplexity: float | None = None
    tokens_per_s: dict[int, float] = field(default_factory=dict)
    #: The row its tokens/s are compared with (the float file of the same runtime).
    baseline: str = "float ONNX"


ROWS: dict[str, Row] = {}


def add_row(name: str, **values: Any) -> Row:
    """Create or update the row ``name`` of the one table."""
    row = ROWS.setdefault(name, Row(name))
    for key, value in values.items():
        setattr(row, key, value)
    return row


# ===================================================================== files
def _prompt(length: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def export_decoder(model: torch.nn.Module, path: Path, example: dict[str, torch.Tensor]) -> Path:
    """The (quantized or float) decoder as ONNX with its key/value cache, verified against PyTorch."""
    from quark_brevitas.export import export_onnx_qcdq

    report = export_onnx_qcdq(model, example, path, past_key_values=True)
    logging.info("%s: %.1f MB, max |ORT - PyTorch| %.2g (%s)", path.name, report.file_size / 1e6,
                 report.max_abs_diff, report.verified_by)
    return path


def ort_quantizer_file(float_file: Path, path: Path, accuracy_level: int | None = None) -> Path:
    """onnxruntime's own MatMulNBitsQuantizer (RTN, block 128, its defaults; ``accuracy_level`` if given) applied
    to our float ONNX file."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(float_file)), block_size=BLOCK, accuracy_level=accuracy_level)
    quantizer.process()
    onnx.save_model(quantizer.model.model, str(path))
    return path


def ort_files(float_file: Path, work: Path, prefix: str) -> dict[str, Path]:
    """The rows of :data:`ORT_ROWS`: onnxruntime's quantizer files made from ``float_file``."""
    return {name: ort_quantizer_file(float_file, work / f"{prefix}_ort_rtn{'' if level is None else level}.onnx",
                                     level) for name, level in ORT_ROWS.items()}


def with_accuracy_level(path: Path, level: int, out: Path) -> Path:
    """A copy of ``path`` whose MatMulNBits nodes compute at ``level`` (4: int8 activations quantized on the fly,
    faster, but no longer what the quantized model computes: for comparison only, never written by the export)."""
    import onnx

    proto = onnx.load(str(path))
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = level
    onnx.save_model(proto, str(out))
    return out


def with_int8_group_inputs(config: Any) -> Any:
    """``config`` with every Linear input quantized dynamically to symmetric int8 per group of :data:`BLOCK` input
    features: what onnxruntime's MatMulNBits computes at accuracy_level 4 (the export then writes that level)."""
    from dataclasses import replace

    from quark_brevitas import QTensorConfig
    from quark_brevitas.types import Dtype, QSchemeType

    inputs = QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_group, group_size=BLOCK, is_dynamic=True)
    return replace(config, global_quant_config=replace(config.global_quant_config, input_tensors=inputs))


def quantize(model: torch.nn.Module, recipe: str, calib: list[dict[str, torch.Tensor]],
             int8_inputs: bool = False) -> torch.nn.Module:
    from quark_brevitas import ModelQuantizer

    config = llm.recipe_config(recipe)
    return ModelQuantizer(with_int8_group_inputs(config) if int8_inputs else config).quantize_model(model, calib)


# ===================================================================== running the files
def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()  # onnxruntime's defaults: what a user gets
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _empty_pasts(session: Any, batch: int) -> dict[str, np.ndarray]:
    pasts = {}
    for graph_input in session.get_inputs():
        if graph_input.name.startswith("past_key_values."):
            heads, head_dim = graph_input.shape[1], graph_input.shape[3]
            pasts[graph_input.name] = np.zeros((batch, heads, 0, head_dim), np.float32)
    return pasts


def _step(session: Any, names: list[str], feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip(names, session.run(None, feed)))


def decode_tokens_per_s(session: Any, prompt: np.ndarray, new_tokens: int) -> float:
    """Greedy decoding of ``new_tokens`` after ``prompt`` (batch 1); tokens/s of the one-token steps."""
    names = [o.name for o in session.get_outputs()]
    feed = {"input_ids": prompt, "attention_mask": np.ones_like(prompt), **_empty_pasts(session, 1)}
    outputs = _step(session, names, feed)
    mask = feed["attention_mask"]
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = outputs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        feed = {"input_ids": token, "attention_mask": mask}
        feed.update({name.replace("present.", "past_key_values."): value for name, value in outputs.items()
                     if name.startswith("present.")})
        outputs = _step(session, names, feed)
    return new_tokens / (time.perf_counter() - start)


def profile_ops(path: Path, prompt: np.ndarray, new_tokens: int, threads: int) -> tuple[float, dict[str, float]]:
    """Where a decode step's time goes (onnxruntime's profiler): milliseconds per one-token step of the whole run
    and of each op type's kernels (the prompt step excluded)."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = str(path.with_suffix("")) + "_profile"
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    decode_tokens_per_s(session, prompt, new_tokens)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[0]["ts"] + runs[0]["dur"]
    per_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] > start:
            op = event["args"]["op_name"]
            per_op[op] = per_op.get(op, 0.0) + event["dur"] / 1000 / (len(runs) - 1)
    return sum(r["dur"] for r in runs[1:]) / 1000 / (len(runs) - 1), per_op


def render_profile(profiles: dict[str, tuple[float, dict[str, float]]], top: int = 6) -> str:
    """One column per file: ms per decode step, in total and for the op types that take the most time."""
    ops: dict[str, float] = {}
    for _, per_op in profiles.values():
        for op, ms in per_op.items():
            ops[op] = max(ops.get(op, 0.0), ms)
    shown = sorted(ops, key=ops.get, reverse=True)[:top]
    rows = [["whole step (model_run)", *[f"{total:.1f}" for total, _ in profiles.values()]]]
    rows += [[op, *[f"{per_op.get(op, 0.0):.1f}" for _, per_op in profiles.values()]] for op in shown]
    rows.append(["all other ops", *[f"{sum(ms for op, ms in per_op.items() if op not in shown):.1f}"
                                   for _, per_op in profiles.values()]])
    return format_table(["ms per decode step (1 thread)", *profiles], rows)


PROFILES: dict[str, tuple[float, dict[str, float]]] = {}


def onnx_perplexity(path: Path, windows: list[dict[str, torch.Tensor]]) -> float:
    """Perplexity of the file's logits (each window one prompt step with an empty past)."""
    from quark_brevitas.hf.lm import PerplexityMeter

    session = _session(path, 1)
    names = [o.name for o in session.get_outputs()]
    meter = PerplexityMeter()
    for batch in windows:
        ids = batch["input_ids"].numpy()
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), **_empty_pasts(session, ids.shape[0])}
        meter.add(torch.from_numpy(_step(session, names, feed)["logits"]), batch)
    return meter.perplexity


def _mb(path: Path) -> float:
    return path.stat().st_size / 1e6


# ===================================================================== sections
def section_perplexity(work: Path, eval_sequences: int, calib_sequences: int, gptq: bool) -> None:
    """The trained Llama: float, ours (RTN, GPTQ) and onnxruntime's quantizer, perplexity in onnxruntime."""
    import transformers

    folder = llm.trained_llama(200)
    splits = llm.token_splits()
    evaluation = llm.windows(splits["eval"], eval_sequences, 8)
    calib = llm.windows(splits["calib"], calib_sequences, 4)
    example = {"input_ids": evaluation[0]["input_ids"][:2, :16]}
    example["attention_mask"] = torch.ones_like(example["input_ids"])

    def fresh() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()

    float_file = export_decoder(fresh(), work / "trained_float.onnx", example)
    files = {"float ONNX": float_file, **ort_files(float_file, work, "trained")}
    recipes = {"ours RTN W4 g128, MatMulNBits": "rtn_w4_g128"}
    if gptq:
        recipes["ours GPTQ W4 g128, MatMulNBits"] = "gptq_w4_g128"
    for name, recipe in recipes.items():
        files[name] = export_decoder(quantize(fresh(), recipe, calib), work / f"trained_{recipe}.onnx", example)
    last = list(recipes)[-1]
    files[LEVEL4] = with_accuracy_level(files[last], 4, work / "trained_level4.onnx")  # GPTQ's when it ran
    for name, recipe in A8_ROWS.items():
        if recipe in recipes.values():
            files[name] = export_decoder(quantize(fresh(), recipe, calib, int8_inputs=True),
                                         work / f"trained_{recipe}_a8.onnx", example)
    for name, path in files.items():
        add_row(name, size_mb=_mb(path), perplexity=onnx_perplexity(path, evaluation))
        logging.info("%s: perplexity %.3f", name, ROWS[name].perplexity)


def section_speed(work: Path, threads: list[int], repeats: int, new_tokens: int, profile: bool = False) -> None:
    """The 1024-wide Llama with random weights: decode tokens/s of float, ours and onnxruntime's quantizer."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=llm.VOCAB, hidden_size=SPEED_WIDTH,
                                      intermediate_size=SPEED_INTERMEDIATE, num_hidden_layers=SPEED_BLOCKS,
                                      num_attention_heads=SPEED_HEADS, num_key_value_heads=SPEED_HEADS,
                                      max_position_embeddings=PROMPT + NEW_TOKENS + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    float_state = {name: value.clone() for name, value in model.state_dict().items()}
    example = _prompt(8, llm.VOCAB)
    float_file = export_decoder(model, work / "speed_float.onnx", example)
    files = {"float ONNX": float_file, **ort_files(float_file, work, "speed")}
    quant = quantize(model, "rtn_w4_g128", [_prompt(32, llm.VOCAB, seed=1)])
    ours = export_decoder(quant, work / "speed_ours.onnx", example)
    del quant, model
    for name in ("ours RTN W4 g128, MatMulNBits", "ours GPTQ W4 g128, MatMulNBits"):
        files[name] = ours  # GPTQ changes the codes, not the kernels or the file's size
    files[LEVEL4] = with_accuracy_level(ours, 4, work / "speed_level4.onnx")
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(float_state)
    quant = quantize(model, "rtn_w4_g128", [_prompt(32, llm.VOCAB, seed=1)], int8_inputs=True)
    ours_a8 = export_decoder(quant, work / "speed_ours_a8.onnx", example)
    del quant, model
    for name in A8_ROWS:
        files[name] = ours_a8  # GPTQ changes the codes, not the kernels or the file's size
    prompt = _prompt(PROMPT, llm.VOCAB, seed=2)["input_ids"].numpy()
    unique = {path: [name for name, p in files.items() if p == path] for path in dict.fromkeys(files.values())}
    if profile:
        for path in unique:
            PROFILES[path.stem.removeprefix("speed_")] = profile_ops(path, prompt, min(new_tokens, 32), 1)
    for n_threads in threads:
        sessions = {path: _session(path, n_threads) for path in unique}
        for session in sessions.values():  # warm-up: first runs allocate and pre-pack
            decode_tokens_per_s(session, prompt, 4)
        samples: dict[Path, list[float]] = {path: [] for path in unique}
        order = list(unique)
        for r in range(repeats):
            for path in order[r % len(order):] + order[:r % len(order)]:
                samples[path].append(decode_tokens_per_s(sessions[path], prompt, new_tokens))
        for path, names in unique.items():
            median = statistics.median(samples[path])
            logging.info("%s, %d thread(s): %s tokens/s", path.name, n_threads,
                         ", ".join(f"{s:.1f}" for s in samples[path]))
            for name in names:
                add_row(name, speed_size_mb=_mb(path)).tokens_per_s[n_threads] = median
    reason = llamacpp.missing()
    if reason is not None:
        print(f"llama.cpp tokens/s: skipped: {reason}")
        return
    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config.presets import get_preset

    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(float_state)
    quant = ModelQuantizer(get_preset("gguf_q4_0")).quantize_model(model, None)
    rows = llamacpp.speed_rows(model, quant, work, prompt[0].tolist(), new_tokens, threads, repeats)
    for name, (path, speeds) in rows.items():
        add_row(name, speed_size_mb=_mb(path), baseline="float GGUF (F32), llama.cpp").tokens_per_s.update(speeds)


def render(threads: list[int]) -> str:
    header = ["format", "file MB (trained 4x256)", "file MB (1024 x 8)", "perplexity (trained)",
              *[f"tokens/s, {t} thread{'s' if t > 1 else ''}" for t in threads]]
    def speed(row: Row, t: int) -> str:
        if t not in row.tokens_per_s:
            return "-"
        float_speed = ROWS[row.baseline].tokens_per_s if row.baseline in ROWS else {}
        ratio = f" ({row.tokens_per_s[t] / float_speed[t]:.2f}x)" if t in float_speed else ""
        return f"{row.tokens_per_s[t]:.1f}{ratio}"

    rows = [[row.name, "-" if row.size_mb is None else f"{row.size_mb:.1f}",
             "-" if row.speed_size_mb is None else f"{row.speed_size_mb:.1f}",
             "-" if row.perplexity is None else f"{row.perplexity:.3f}", *[speed(row, t) for t in threads]]
            for row in ROWS.values()]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (numbers not comparable)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes per file and thread count")
    parser.add_argument("--eval", type=int, default=64, help="held-out sequences of 128 tokens for perplexity")
    parser.add_argument("--calib", type=int, default=128, help="calibration sequences of 128 tokens (GPTQ)")
    parser.add_argument("--no-gptq", action="store_true", help="skip the GPTQ row of the trained Llama")
    parser.add_argument("--skip", choices=["perplexity", "speed", "formats"], action="append", default=[])
    parser.add_argument("--profile", action="store_true",
                        help="also print where a decode step's time goes, per op type (onnxruntime's profiler)")
    parser.add_argument("--keep", type=Path, help="write the ONNX files here (kept) instead of a temporary folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("quark_brevitas", "transformers", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    repeats, new_tokens = (2, 16) if args.quick else (args.repeats, NEW_TOKENS)
    with tempfile.TemporaryDirectory(prefix="llm_deploy_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "perplexity" not in args.skip:
            section_perplexity(work, 8 if args.quick else args.eval, 8 if args.quick else args.calib,
                               gptq=not args.no_gptq)
        if "formats" not in args.skip:
            section_formats(work, 8 if args.quick else args.eval, 8 if args.quick else args.calib,
                            not args.no_gptq, add_row)
        if "speed" not in args.skip:
            section_speed(work, args.threads, repeats, new_tokens, profile=args.profile)
    print(render(args.threads))
    if PROFILES:
        print()
        print(render_profile(PROFILES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
