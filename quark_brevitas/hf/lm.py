"""Language-model workflow: text into calibration batches, perplexity, sentence embeddings, generation, and
the ``quark-brevitas quantize --model DIR`` run that ties them together.

:func:`quantize_folder` quantizes a Hugging Face folder (a causal LM, or an encoder such as BERT) from a
plain-text calibration file and measures what quantization cost on held-out text: perplexity before and after
for a causal LM, the cosine between float and quantized mean-pooled sentence embeddings for an encoder. A model
made of blocks takes the bounded-memory path (:func:`quark_brevitas.hf.streaming.quantize_pretrained`, with
streamed evaluation); any other model is loaded, quantized in memory and saved with
:func:`~quark_brevitas.checkpoint.save_quantized`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.algorithms import GPTQ
from quark_brevitas.config.enums import QSchemeType
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.tokenizer_files import TOKENIZER_COPIED, TOKENIZER_FILES, load_tokenizer
from quark_brevitas.extras import require

logger = logging.getLogger(__name__)

__all__ = ["TOKENIZER_FILES", "LLMReport", "PerplexityMeter", "copy_tokenizer", "default_llm_config", "generate_text",
           "is_causal_lm", "load_tokenizer", "mean_pooled", "quantize_folder", "sentence_batches", "split_held_out",
           "text_batches"]

#: Re-exported: the tables live with the exporters that copy tokenizers too.
_TOKENIZER_COPIED = TOKENIZER_COPIED


def default_llm_config() -> Config:
    """The LLM command line's default: int4 weights per group of 128 rounded by GPTQ, activations in float
    (no FX pre-processing: Hugging Face models cannot be traced). It pads a layer narrower than 128 channels or not
    a multiple of them (``pad_groups``, logged): a default must run on any model; a config the user gives pads only
    when it says so."""
    weight = QTensorConfig(qscheme=QSchemeType.per_group, group_size=128, bit_width=4, pad_groups=True)
    return Config(QLayerConfig(weight=weight), pre_quant_opt_config=[], algo_config=[GPTQ()])


def copy_tokenizer(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files of the folder ``source`` into ``target`` byte for byte (each atomically, see
    :mod:`quark_brevitas.outputs`); returns the names copied.

    Why copies, not ``tokenizer.save_pretrained``: transformers re-serialises what it loaded, and for some
    classes that is another tokenizer. Qwen2's adds ``<|endoftext|>`` as a new id when the vocabulary lacks it,
    so a tokenizer that fitted the model's embedding no longer does, and the GGUF export of the checkpoint then
    refuses the tokenizer the user gave. The checkpoint keeps what the user gave."""
    from quark_brevitas.outputs import write_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    copied = [name for name in _TOKENIZER_COPIED if (source / name).is_file()]
    for name in copied:
        write_file(target / name, lambda tmp, name=name: shutil.copyfile(source / name, tmp))
    return copied


# ===================================================================== text into batches
def split_held_out(text: str, fraction: float = 0.1) -> tuple[str, str]:
    """``(calibration, held-out)``: the last ``fraction`` of the text (cut at a line break) is held out."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    cut = int(len(text) * (1 - fraction))
    newline = text.rfind("\n", 0, cut)
    cut = newline if newline > 0 else cut
    return text[:cut], text[cut:]


def text_batches(tokenizer: Any, text: str, *, seq_len: int = 128, batch_size: int = 4,
                 max_sequences: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The text as consecutive token windows of ``seq_len`` (the tail that does not fill one is dropped),
    ``batch_size`` windows per batch: the usual calibration and perplexity data of causal LMs."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    count = len(ids) // seq_len
    if max_sequences is not None:
        count = min(count, max_sequences)
    if count == 0:
        raise QuarkBrevitasError(f"the text has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    windows = ids[:count * seq_len].view(count, seq_len)
    return [{"input_ids": chunk, "attention_mask": torch.ones_like(chunk)} for chunk in windows.split(batch_size)]


def sentence_batches(tokenizer: Any, sentences: Sequence[str], *, max_length: int = 64, batch_size: int = 16
                     ) -> list[dict[str, torch.Tensor]]:
    """Sentences padded to ``max_length`` tokens, ``batch_size`` per batch (encoder inputs)."""
    if not sentences:
        raise QuarkBrevitasError("no sentences to batch")
    return [dict(tokenizer(list(sentences[i:i + batch_size]), padding="max_length", truncation=True,
                           max_length=max_length, return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def text_sentences(text: str, *, min_chars: int = 20) -> list[str]:
    """Non-empty lines of at least ``min_chars`` characters (the sentences an encoder is measured on)."""
    return [line.strip() for line in text.splitlines() if len(line.strip()) >= min_chars]


# ===================================================================== measures
class PerplexityMeter:
    """Accumulates next-token negative log-likelihood over batches: ``add(logits, batch)`` per batch, then
    :attr:`perplexity` (exp of the mean over every predicted token whose position is not padding)."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.tokens = 0

    def add(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))[:, 1:].bool()
        losses = nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        self.nll += float(losses[mask].sum())
        self.tokens += int(mask.sum())

    @property
    def perplexity(self) -> float:
        if self.tokens == 0:
            raise QuarkBrevitasError("perplexity of no tokens")
        return math.exp(self.nll / self.tokens)


def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings: the mean of the token states over the attention mask (sentence-transformers'
    pooling for all-MiniLM-L6-v2)."""
    mask = attention_mask[..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


def _hidden(output: Any) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def generate_text(model: nn.Module, tokenizer: Any, prompt: str, *, max_new_tokens: int = 32) -> str:
    """Greedy continuation of ``prompt`` by ``model.generate`` (the prompt not repeated)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def is_causal_lm(hf_config: Any) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (getattr(hf_config, "architectures", None) or []))


# ===================================================================== the workflow
@dataclass
class LLMReport:
    """What :func:`quantize_folder` did and measured (also written to ``OUTPUT/report.json``)."""

    model: str
    kind: str  # "causal LM" or "encoder"
    config_source: str
    output: str
    path: str  # "block by block" or "in memory"
    calibration_batches: int
    evaluation_batches: int
    metric: str
    float_value: float
    quant_value: float
    times_s: dict[str, float] = field(default_factory=dict)
    sample: str | None = None

    def rows(self) -> list[tuple[str, str]]:
        rows = [("model", f"{self.model} ({self.kind})"), ("config", self.config_source),
                ("path", self.path),
                ("calibration / evaluation batches", f"{self.calibration_batches} / {self.evaluation_batches}"),
                (f"{self.metric} float", f"{self.float_value:.4f}"),
                (f"{self.metric} quantized", f"{self.quant_value:.4f}"),
                ("checkpoint", self.output),
                ("time: quantize / evaluate", f"{self.times_s.get('quantize', 0):.1f} s / "
                                              f"{self.times_s.get('evaluate', 0):.1f} s")]
        if self.sample is not None:
            rows.append(("generated", repr(self.sample)))
        return rows


class _Measure:
    """Collects a model's outputs on the evaluation batches into one number."""

    def __init__(self, causal: bool, batches: list[dict[str, torch.Tensor]],
                 reference: list[torch.Tensor] | None = None) -> None:
        self.causal, self.batches, self.reference = causal, batches, reference
        self.meter = PerplexityMeter()
        self.embeddings: list[torch.Tensor] = []

    def __call__(self, position: int, output: Any) -> None:
        batch = self.batches[position]
        if self.causal:
            self.meter.add(output.logits, batch)
        else:
            self.embeddings.append(mean_pooled(_hidden(output), batch["attention_mask"]))

    @property
    def value(self) -> float:
        if self.causal:
            return self.meter.perplexity
        if self.reference is None:
            return 1.0
        cosines = [nn.functional.cosine_similarity(e, r, dim=-1) for e, r in zip(self.embeddings, self.reference)]
        return float(torch.cat(cosines).mean())


def quantize_folder(model_dir: str | os.PathLike[str], calib_text: str, output: str | os.PathLike[str], *,
                    config: Config | None = None, config_source: str = "default (int4 per-group 128 + GPTQ)",
                    eval_text: str | None = None, seq_len: int = 128, batch_size: int = 4,
                    calib_sequences: int = 128, eval_sequences: int = 32, prompt: str | None = None,
                    max_new_tokens: int = 32, resume: bool = True, offload: str | None = None,
                    overwrite: bool = False, tokenizer_dir: str | os.PathLike[str] | None = None) -> LLMReport:
    """Quantize the Hugging Face model in ``model_dir`` on ``calib_text`` into ``output`` and measure it on
    held-out text (``eval_text``, or the last tenth of ``calib_text``); see the module docstring. The tokenizer
    is ``model_dir``'s unless ``tokenizer_dir`` names another folder.

    ``output`` must not be ``model_dir``, and must not hold files quark_brevitas did not write unless
    ``overwrite`` (checked before any work; see :mod:`quark_brevitas.outputs`)."""
    transformers = require("transformers", "a Hugging Face model folder")

    from quark_brevitas.blocks.stack import RUN_STACK, find_block_stack
    from quark_brevitas.hf import streaming
    from quark_brevitas.outputs import add_file, add_folder, check_output_dir, reserve

    model_dir = Path(model_dir)
    output = check_output_dir(output, overwrite=overwrite, sources=[model_dir])  # before the slow work
    with reserve(output):  # a second run on it is refused, an unwritable one fails: before the slow work
        config = config if config is not None else default_llm_config()
        tokenizer_folder = model_dir if tokenizer_dir is None else Path(tokenizer_dir)
        tokenizer = load_tokenizer(tokenizer_folder, model_dir)
        skeleton, hf_config = streaming.load_skeleton(model_dir)
        causal = is_causal_lm(hf_config)
        if eval_text is None:
            calib_text, eval_text = split_held_out(calib_text)
        if causal:
            calib = text_batches(tokenizer, calib_text, seq_len=seq_len, batch_size=batch_size,
                                 max_sequences=calib_sequences)
            evaluation = text_batches(tokenizer, eval_text, seq_len=seq_len, batch_size=batch_size,
                                      max_sequences=eval_sequences)
        else:
            calib = sentence_batches(tokenizer, text_sentences(calib_text)[:calib_sequences], max_length=seq_len)
            evaluation = sentence_batches(tokenizer, text_sentences(eval_text)[:eval_sequences], max_length=seq_len)
        blockwise = find_block_stack(skeleton, policy=RUN_STACK) is not None
        del skeleton
        times: dict[str, float] = {}
        start = time.perf_counter()
        reference = _Measure(causal, evaluation)
        if blockwise:
            streaming.evaluate_pretrained(model_dir, evaluation, reference)
            times["evaluate"] = time.perf_counter() - start
            start = time.perf_counter()
            streaming.quantize_pretrained(model_dir, config, calib, output, resume=resume, offload=offload,
                                          overwrite=overwrite)
            times["quantize"] = time.perf_counter() - start
            copy_tokenizer(tokenizer_folder, output / streaming.FLOAT_MODEL_DIR)  # as given
            start = time.perf_counter()
            measured = _Measure(causal, evaluation, reference.embeddings)
            streaming.evaluate_pretrained(output, evaluation, measured)
            quant_model = streaming.load_pretrained_quantized(output) if prompt is not None and causal else None
        else:
            from quark_brevitas.api import ModelQuantizer
            from quark_brevitas.checkpoint import save_quantized

            float_model = transformers.AutoModel.from_pretrained(model_dir) if not causal else \
                transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            float_model.eval()
            _run(float_model, evaluation, reference)
            times["evaluate"] = time.perf_counter() - start
            start = time.perf_counter()
            quant_model = ModelQuantizer(config).quantize_model(float_model, calib)
            times["quantize"] = time.perf_counter() - start
            save_quantized(quant_model, output, overwrite=overwrite)
            add_folder(output, streaming.FLOAT_MODEL_DIR,  # as given; for export's example input and GGUF
                       lambda folder: copy_tokenizer(tokenizer_folder, folder))
            start = time.perf_counter()
            measured = _Measure(causal, evaluation, reference.embeddings)
            _run(quant_model, evaluation, measured)
        times["evaluate"] += time.perf_counter() - start
        sample = generate_text(quant_model, tokenizer, prompt, max_new_tokens=max_new_tokens) \
            if prompt is not None and causal and quant_model is not None else None
        report = LLMReport(model=str(model_dir), kind="causal LM" if causal else "encoder", config_source=config_source,
                           output=str(output), path="block by block" if blockwise else "in memory",
                           calibration_batches=len(calib), evaluation_batches=len(evaluation),
                           metric="perplexity" if causal else "embedding cosine vs float",
                           float_value=reference.value, quant_value=measured.value, times_s=times, sample=sample)
        add_file(output, "report.json", lambda p: p.write_text(json.dumps(report.__dict__, indent=2) + "\n"))
        return report


def _run(model: nn.Module, batches: list[dict[str, torch.Tensor]], measure: _Measure) -> None:
    from quark_brevitas.calibration.data import CalibrationData

    CalibrationData(batches).forward(model, "Evaluating", on_output=measure)
