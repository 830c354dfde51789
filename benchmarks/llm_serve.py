"""Serving-side quantization (issue 30): the KV cache of the trained Llama in FP8 E4M3 and int8 against a float
cache, and what the cache costs per token.

Run: ``python -m benchmarks.llm_serve`` (a few CPU minutes at one thread). The model is the 4 x 256 Llama that
``benchmarks/llm.py`` trains on the standard library's docstrings (its cache, ``benchmarks/.cache/llm``, is reused;
trained there if missing). Perplexity on 64 held-out sequences of 128 tokens; calibration on 32 other sequences of
128 tokens.

Rows (each quantized with ``ModelQuantizer`` from the same calibration data):

* ``float``: the float model.
* ``KV fp8 / int8 (pre-RoPE)``: float weights, the cache quantized as Quark's ``kv_cache_quant_config`` does by
  default (the k_proj / v_proj outputs, static per tensor, K and V sharing one scale per layer: the template's
  ``kv_cache_group``).
* ``KV fp8 / int8 (post-RoPE)``: the same after RoPE (``kv_cache_post_rope=True``, how vLLM applies k_scale).
* ``fp8 weights+inputs, float KV`` / ``..., KV fp8``: ``LLMTemplate.get("llama").get_config(scheme="fp8",
  kv_cache_scheme="fp8")`` with ``kv_cache_post_rope=True``; the float-KV figure is the same quantized model with its
  KV quantizers switched off (:func:`quark_brevitas.model_parts.kv_cache.kv_quantization_disabled`), so the difference
  is the cache's alone.

The issue's targets (FP8 KV within 0.5 % of the float-KV model, int8 KV within 1 %) are printed from the run's
rows, with KV bytes per token (keys and values of every layer, one token, at the cache's element size).

ONNX decoding (``--onnx``, also in the default run): the trained Llama exported with ``past_key_values=True``
(:func:`quark_brevitas.export.export_onnx_qcdq`) as the float model, and with its KV cache quantized after RoPE to
int8 and to FP8 E4M3 (float weights, the calibration above), each once with the cache stored quantized between steps
(``INT8`` / ``FLOAT8E4M3FN`` codes, the default) and once as a float cache (``quantized_cache=False``). Each file is
decoded greedily in onnxruntime (:func:`quark_brevitas.export.onnx.decode.greedy_decode`, one intra-op thread, the
cache kept in onnxruntime's buffers between steps): a batch of ``DECODE_BATCH`` held-out prompts of each length in
``PROMPTS`` (the longer one beyond the 128 positions the model was trained on: the speed, the bytes and the agreement
with PyTorch do not need a good model there), then ``STEPS`` tokens. Printed per file: the KV-cache bytes per token
measured on the file's presents, decode tokens/s
(the one-token steps; median of ``ROUNDS`` runs, the files taken in turn within each round and the order rotated, so
the shared machine's noise falls on all alike) and its ratio to the same model's float cache, and whether the greedy
tokens are PyTorch's (the quantized model's own incremental decoding with its DynamicCache) with the largest logit
difference over the steps.

Attention (``--attention``, also in the default run): the float model in eager attention, the FP8 cache alone and
with FP8 query / probability quantization (Quark's ``softmax_quant_spec`` and q_proj output spec), before and after
RoPE, and ``get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")`` (post-RoPE) against the same
quantized model with its attention, then also its cache, quantizers switched off.

MoE (``--moe``, also in the default run): a random Mixtral and a random Qwen2-MoE (4 blocks, 256 wide, 8 experts of
512, top-2; Qwen2-MoE's shared expert 512 wide) from their configs, experts unfused
(:func:`quark_brevitas.model_parts.moe.unfuse_experts`), GPTQ int4 per group of 128 block by block on 32 random
sequences of 128 tokens, in place, after a small warm-up quantization (imports and first uses are not the engine's
memory): the coverage line the pipeline logs for each block (tokens, routings per expert, the experts all-expert
calibration fed), the wall seconds per block GPTQ logs (the machine is shared: the CPU seconds of the whole call are
printed too), one block's weights in bytes and the peak resident memory of the process above its level before the
call, as allocated-and-alive bytes and as resident memory (:class:`_PeakMemory`), against the issue's bound of twice
one block; the allocated-and-alive bytes still held after the run (the quantized blocks' Brevitas modules) are part
of that peak and printed too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
from benchmarks import llm  # noqa: E402  (benchmarks/llm.py: corpus, tokenizer, trained model)

CALIB, EVAL = 32, 64
DECODE_BATCH, PROMPTS, STEPS, ROUNDS = 4, (64, 896), 128, 5


def _perplexity(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    from quark_brevitas.hf.lm import PerplexityMeter

    meter = PerplexityMeter()
    with torch.no_grad():
        for batch in batches:
            meter.add(model(**batch).logits, batch)
    return meter.perplexity


def _kv_config(dtype: Any, post_rope: bool) -> Any:
    from quark_brevitas.config import Config, QLayerConfig, QTensorConfig

    spec = QTensorConfig(dtype=dtype, is_dynamic=False, percentile=100.0)
    return Config(QLayerConfig(), pre_quant_opt_config=[],
                  kv_cache_quant_config={"*k_proj": QLayerConfig(output_tensors=spec),
                                         "*v_proj": QLayerConfig(output_tensors=spec)},
                  kv_cache_group=["*k_proj", "*v_proj"], kv_cache_post_rope=post_rope)


def kv_bytes_per_token(config: Any, element_bytes: float) -> float:
    """Keys and values of every layer for one token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes


class _PeakMemory:
    """Peak memory of the process above its level at ``__enter__``, sampled every 5 ms on a thread, two ways:

    * ``live``: bytes the C allocator has handed out and not taken back (glibc's ``mallinfo2``: in-use heap chunks
      plus mmapped ones; every tensor on the CPU is allocated there): what the engine holds at once.
    * ``resident``: the resident set (``/proc/self/statm``), which also counts freed memory glibc keeps in its
      heaps (fragmentation by the many small tensors of GPTQ's column loop): what the system sees.

    Without glibc only ``resident`` is measured (``live`` stays ``None``)."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                             "usmblks", "fsmblks", "uordblks", "fordblks",
                                                             "keepcost")]

        try:
            self.libc: Any = ctypes.CDLL("libc.so.6")
            self.libc.mallinfo2.restype = MallInfo2
        except (OSError, AttributeError) as exc:
            print(f"(glibc's mallinfo2 is not available: {exc}; only the resident set is measured)")
            self.libc = None
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> tuple[int, int | None]:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * self.page
        if self.libc is None:
            return resident, None
        info = self.libc.mallinfo2()
        return resident, info.uordblks + info.hblkhd

    def _poll(self) -> None:
        while self.running:
            self._update()
            time.sleep(0.005)

    def _update(self) -> None:
        resident, live = self._sample()
        self.peak_resident = max(self.peak_resident, resident)
        if live is not None:
            self.peak_live = max(self.peak_live, live)

    def __enter__(self) -> _PeakMemory:
        import gc

        gc.collect()
        self.base_resident, self.base_live = self._sample()
        self.peak_resident, self.peak_live = self.base_resident, self.base_live or 0
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self._update()

    @property
    def resident(self) -> int:
        return self.peak_resident - self.base_resident

    @property
    def live(self) -> int | None:
        return None if self.base_live is None else self.peak_live - self.base_live

    def after_live(self) -> int:
        """Allocated-and-alive bytes above the level at ``__enter__`` once the run is over (collected): what its
        result holds (0 without glibc)."""
        import gc

        gc.collect()
        if self.libc is None or self.base_live is None:
            return 0
        return self._sample()[1] - self.base_live


def _moe_model(family: str, blocks: int = 4, width: int = 256) -> Any:
    """A random MoE model from its config, experts unfused: 8 experts of 2 x ``width`` (top-2); Qwen2-MoE's shared
    expert is as wide as one expert."""
    import transformers

    from quark_brevitas.model_parts.moe import unfuse_experts

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=width, num_hidden_layers=blocks, num_attention_heads=4,
                  num_key_value_heads=4, num_experts_per_tok=2, max_position_embeddings=128)
    if family == "Mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=2 * width,
                                                                           num_local_experts=8))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=2 * width, moe_intermediate_size=2 * width,
            shared_expert_intermediate_size=2 * width, num_experts=8))
    unfuse_experts(model)
    return model.eval()


def moe() -> None:
    """The MoE rows (see the module docstring)."""
    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
    from quark_brevitas.config.algorithms import GPTQConfig
    from quark_brevitas.types import Dtype, QSchemeType

    routings: list[str] = []
    times: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "token routings per expert" in message:
                routings.append(message)
            elif "GPTQConfig: model.layers." in message and " done in " in message:
                times.append(message.split("GPTQConfig: ", 1)[1])

    weight = QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=128)
    quant_config = Config(QLayerConfig(weight=weight), pre_quant_opt_config=[], algo_config=[GPTQConfig()],
                          exclude=["lm_head"])
    generator = torch.Generator().manual_seed(0)
    calib = [{"input_ids": torch.randint(0, 4096, (4, 128), generator=generator)} for _ in range(8)]
    # First uses (imports, Brevitas's injectors) on a small model, so that the figures are the engine's.
    gptq_log = logging.getLogger("quark_brevitas.algorithms.gptq")
    gptq_log.disabled = True  # its few-token warnings are not the run's
    ModelQuantizer(quant_config).quantize_model(_moe_model("Mixtral", 2, 128), calib[:1], blocks=True, inplace=True)
    gptq_log.disabled = False
    handler = Collect(level=logging.INFO)
    for name in ("quark_brevitas.model_parts.moe", "quark_brevitas.algorithms.gptq"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    for family in ("Mixtral", "Qwen2-MoE"):
        routings.clear()
        times.clear()
        model = _moe_model(family)
        block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        memory = _PeakMemory()
        start = time.process_time()
        with memory:  # in place: the quantized blocks replace the float ones, no second copy of the model
            ModelQuantizer(quant_config).quantize_model(model, calib, blocks=True, inplace=True)
        seconds = time.process_time() - start
        after = memory.after_live()
        live = "not measured" if memory.live is None else \
            f"{memory.live / 2**20:.1f} MiB = {memory.live / block_bytes:.2f} x one block " \
            f"(target < 2 x: {'met' if memory.live < 2 * block_bytes else 'NOT met'}; of which the quantized " \
            f"blocks' own structures, still held after the run: {after / 2**20:.1f} MiB)"
        print(f"\nMoE: random {family} 4 x 256, 8 experts of 512 (top-2"
              f"{', a shared expert of 512' if family == 'Qwen2-MoE' else ''}), GPTQ int4 g128 block by block "
              f"(in place), 32 x 128 tokens: {seconds:.1f} CPU s; one block's weights {block_bytes / 2**20:.1f} MiB; "
              f"peak above the float model: allocated and alive {live}; resident {memory.resident / 2**20:.1f} MiB "
              f"= {memory.resident / block_bytes:.2f} x one block")
        for line in routings:
            print(f"  {line}")
        for line in times:
            print(f"  {line}")
        del model


def _decode_rows(models: dict[str, torch.nn.Module], files: dict[str, tuple[str, Path]], sessions: dict[str, Any],
                 prompt: torch.Tensor) -> None:
    """Decode ``prompt`` with every file (in turn within each round, the order rotated) and print the rows."""
    from quark_brevitas.export.onnx.decode import greedy_decode, torch_greedy_decode

    rates: dict[str, list[float]] = {label: [] for label in files}
    results = {}
    labels = list(files)
    for round_ in range(ROUNDS):
        for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
            result = greedy_decode(files[label][1], prompt, steps=STEPS, session=sessions[label])
            rates[label].append(prompt.shape[0] * STEPS / sum(result.seconds[1:]))
            results[label] = result
    reference = {name: torch_greedy_decode(quant, prompt, steps=STEPS) for name, quant in models.items()}
    length = prompt.shape[1]
    print(f"\nprompt {length} tokens, context up to {length + STEPS}")
    print(f"{'file':<34} {'KV bytes/token':>14} {'tokens/s':>9} {'vs float cache':>15} {'tokens = PyTorch':>17} "
          f"{'max |dlogit|':>12}")
    for label, result in results.items():
        name = files[label][0]
        rate = sorted(rates[label])[ROUNDS // 2]
        base = sorted(rates[f"{name} model, float cache"])[ROUNDS // 2]
        per_token = result.cache_bytes / (prompt.shape[0] * (length + STEPS))
        tokens, logits = reference[name]
        diff = max(float((a - b[:, -1].float()).abs().max()) for a, b in zip(result.logits, logits))
        same = "yes" if torch.equal(result.tokens, tokens) else \
            f"no ({int((result.tokens != tokens).sum())} differ)"
        print(f"{label:<34} {per_token:>14.0f} {rate:>9.1f} {rate / base:>14.2f}x {same:>17} {diff:>12.2e}")


def onnx_decode(model: torch.nn.Module | None = None, calib: list[dict[str, torch.Tensor]] | None = None) -> None:
    """The ONNX decoding rows (see the module docstring)."""
    import tempfile

    import onnxruntime as ort
    import transformers

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.export import export_onnx_qcdq
    from quark_brevitas.types import Dtype

    torch.set_num_threads(1)
    splits = llm.token_splits()
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(llm.trained_llama(200)).eval()
    if calib is None:
        calib = llm.windows(splits["calib"], CALIB, 4)
    print(f"\nONNX decoding in onnxruntime {ort.__version__} (CPU, 1 thread): trained Llama {llm.WIDTH} wide, "
          f"{model.config.num_hidden_layers} blocks, batch {DECODE_BATCH}, {STEPS} greedy steps; tokens/s: median of "
          f"{ROUNDS} rounds")
    example = {"input_ids": splits["eval"][None, :8].repeat(2, 1), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    models = {"float": model}
    for name, dtype in (("int8", Dtype.int8), ("fp8", Dtype.fp8_e4m3)):
        models[f"KV {name}"] = ModelQuantizer(_kv_config(dtype, True)).quantize_model(model, calib)
    files: dict[str, tuple[str, Path]] = {}
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory(prefix="llm_serve_onnx_") as tmp:
        for name, quant in models.items():
            kinds = [("float cache", False)] + ([(f"{name.split()[1]} cache", None)] if name != "float" else [])
            for cache, quantized in kinds:
                path = Path(tmp) / f"{name.replace(' ', '_')}_{cache.replace(' ', '_')}.onnx"
                start = time.perf_counter()
                report = export_onnx_qcdq(quant, example, path, past_key_values=True, quantized_cache=quantized)
                files[f"{name} model, {cache}"] = (name, path)
                print(f"exported the {name} model, {cache} (opset {report.opset}, cache "
                      f"{'/'.join(report.cache_dtypes)}, verified max |ORT - PyTorch| {report.max_abs_diff:.2e}) in "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
        sessions = {label: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    for label, (_, path) in files.items()}
        for length in PROMPTS:
            _decode_rows(models, files, sessions, torch.stack([splits["eval"][i * length:(i + 1) * length]
                                                               for i in range(DECODE_BATCH)]))
    print(f"KV bytes per token from the config: float32 {kv_bytes_per_token(model.config, 4):.0f}, "
          f"int8/fp8 {kv_bytes_per_token(model.config, 1):.0f}")


def _trained_data() -> tuple[Path, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """One thread, warnings only; the trained Llama's folder, calibration windows and held-out windows (the
    perplexity rows of :func:`main` and :func:`attention`)."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    splits = llm.token_splits()
    return llm.trained_llama(200), llm.windows(splits["calib"], CALIB, 4), llm.windows(splits["eval"], EVAL, 8)


def main() -> None:
    import transformers

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config.template import LLMTemplate
    from quark_brevitas.model_parts.kv_cache import kv_quantization_disabled
    from quark_brevitas.types import Dtype

    folder, calib, evaluation = _trained_data()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows: dict[str, float] = {"float": _perplexity(model, evaluation)}
    seconds: dict[str, float] = {}
    for name, dtype in (("fp8", Dtype.fp8_e4m3), ("int8", Dtype.int8)):
        for post in (False, True):
            label = f"KV {name} ({'post' if post else 'pre'}-RoPE)"
            start = time.process_time()
            quant = ModelQuantizer(_kv_config(dtype, post)).quantize_model(model, calib)
            seconds[label] = time.process_time() - start
            rows[label] = _perplexity(quant, evaluation)
    for kv in ("fp8", "int8"):
        config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme=kv)
        config.kv_cache_post_rope = True
        start = time.process_time()
        quant = ModelQuantizer(config).quantize_model(model, calib)
        seconds[f"fp8 weights+inputs, KV {kv}"] = time.process_time() - start
        rows[f"fp8 weights+inputs, KV {kv}"] = _perplexity(quant, evaluation)
        with kv_quantization_disabled(quant):
            rows[f"fp8 weights+inputs, float KV ({kv} model)"] = _perplexity(quant, evaluation)

    print(f"Trained Llama {folder.name}: perplexity on {EVAL} x {llm.SEQ} held-out tokens, calibration "
          f"{CALIB} x {llm.SEQ} (torch {torch.__version__}, 1 thread)")
    print(f"{'row':<44} {'perplexity':>10} {'vs float KV':>12} {'CPU s':>7}")
    for label, value in rows.items():
        base = rows["float"]
        if label.startswith("fp8 weights+inputs, KV"):
            base = rows[f"fp8 weights+inputs, float KV ({label.rsplit(' ', 1)[1]} model)"]
        delta = "" if label == "float" or "float KV" in label else f"{100 * (value / base - 1):+.3f} %"
        print(f"{label:<44} {value:>10.4f} {delta:>12} {seconds.get(label, 0.0):>7.1f}")
    hf = model.config
    print(f"KV bytes per token: float32 {kv_bytes_per_token(hf, 4):.0f}, bfloat16 {kv_bytes_per_token(hf, 2):.0f}, "
          f"fp8/int8 {kv_bytes_per_token(hf, 1):.0f} (+ 2 float32 scales per layer, {8 * hf.num_hidden_layers} "
          "bytes per model)")
    for kv, limit in (("fp8", 0.5), ("int8", 1.0)):
        for post in ("pre", "post"):
            change = 100 * (rows[f"KV {kv} ({post}-RoPE)"] / rows["float"] - 1)
            print(f"target: {kv} KV ({post}-RoPE) within {limit} % of float KV: {change:+.3f} % -> "
                  f"{'met' if abs(change) <= limit else 'NOT met'}")
        on_quant = 100 * (rows[f"fp8 weights+inputs, KV {kv}"] /
                          rows[f"fp8 weights+inputs, float KV ({kv} model)"] - 1)
        print(f"target: {kv} KV on the fp8 model within {limit} % of its float KV: {on_quant:+.3f} % -> "
              f"{'met' if abs(on_quant) <= limit else 'NOT met'}")


def _attention_config(dtype: Any, post_rope: bool) -> Any:
    """:func:`_kv_config` with the query and the probabilities quantized too (Quark's spelling of
    ``attention_scheme``: ``softmax_quant_spec`` and the q_proj output spec)."""
    from dataclasses import replace

    from quark_brevitas.config import QLayerConfig, QTensorConfig

    spec = QTensorConfig(dtype=dtype, is_dynamic=False, percentile=100.0)
    config = _kv_config(dtype, post_rope)
    return replace(config, softmax_quant_spec=spec, layer_quant_config={**config.layer_quant_config,
                                                                        "*q_proj": QLayerConfig(output_tensors=spec)})


def attention() -> None:
    """The attention rows (``--attention``): FP8 KV cache with and without FP8 query / probability quantization
    (``attention_scheme``), against the float model, in one run."""
    import transformers

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config.template import LLMTemplate
    from quark_brevitas.model_parts.attention import attention_quantization_disabled
    from quark_brevitas.model_parts.kv_cache import kv_quantization_disabled
    from quark_brevitas.types import Dtype

    folder, calib, evaluation = _trained_data()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    rows: dict[str, float] = {"float (eager attention)": _perplexity(model, evaluation)}
    for post in (False, True):
        where = "post" if post else "pre"
        rows[f"KV fp8 ({where}-RoPE)"] = _perplexity(
            ModelQuantizer(_kv_config(Dtype.fp8_e4m3, post)).quantize_model(model, calib), evaluation)
        rows[f"KV fp8 + attention fp8 ({where}-RoPE)"] = _perplexity(
            ModelQuantizer(_attention_config(Dtype.fp8_e4m3, post)).quantize_model(model, calib), evaluation)
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")
    config.kv_cache_post_rope = True
    quant = ModelQuantizer(config).quantize_model(model, calib)
    rows["fp8 template, KV fp8 + attention fp8"] = _perplexity(quant, evaluation)
    with attention_quantization_disabled(quant):
        rows["fp8 template, KV fp8, float attention"] = _perplexity(quant, evaluation)
        with kv_quantization_disabled(quant):
            rows["fp8 template, float KV and attention"] = _perplexity(quant, evaluation)
    print(f"Trained Llama {folder.name}: perplexity on {EVAL} x {llm.SEQ} held-out tokens, calibration "
          f"{CALIB} x {llm.SEQ} (torch {torch.__version__}, 1 thread)")
    print(f"{'row':<44} {'perplexity':>10} {'vs float':>10} {'vs its float KV+attn':>22}")
    base = rows["float (eager attention)"]
    own = rows["fp8 template, float KV and attention"]
    for label, value in rows.items():
        delta = "" if label.startswith("float") else f"{100 * (value / base - 1):+.3f} %"
        mine = f"{100 * (value / own - 1):+.3f} %" if label.startswith("fp8 template") else ""
        print(f"{label:<44} {value:>10.4f} {delta:>10} {mine:>22}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "--moe" in sys.argv[1:]:
        torch.set_num_threads(1)
        moe()
    elif "--onnx" in sys.argv[1:]:
        onnx_decode()
    elif "--attention" in sys.argv[1:]:
        attention()
    else:
        main()
        onnx_decode()
        attention()
        moe()
