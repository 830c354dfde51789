"""The GGUF and compressed-tensors rows of ``benchmarks/llm_deploy.py`` (issue 18, item 6): what transformers
computes when it loads each file, on the trained Llama.

* **GGUF Q4_0** (int4 symmetric per group of 32, codes -8..7 as GGUF stores them, float16 scales): ours
  round-to-nearest (preset ``gguf_q4_0``), ours GPTQ (the same preset with ``GPTQConfig``: act order, damp 0.01;
  Brevitas's whole-model ``algos.GPTQ`` measured worse here, 368.21 against 367.75 on 2026-11-26), and the
  ``gguf`` package's own round-to-nearest Q4_0 of the same float
  model (``gguf.quants.quantize``: what llama.cpp's ``quantize`` tool computes for Q4_0) written to the same
  tensors. The trained Llama's MLP is 688 wide, not a multiple of 32, so ``down_proj`` stays float in every GGUF
  row (llama.cpp too falls back to a float type for rows that are not whole blocks); in the compressed-tensors
  rows too (it reads whole groups of 128 only; the ONNX rows quantize it with a last partial group). Perplexity:
  transformers loading the file (``from_pretrained(dir, gguf_file=...)``, which dequantizes to float).
* **compressed-tensors** W4 per group of 128, symmetric (GPTQ, RTN) and asymmetric (RTN): transformers loading
  our folder (the ``compressed-tensors`` package decompresses it).
* the same GGUF files in llama.cpp (perplexity of what llama.cpp computes), where ``llama-cpp-python`` is
  installed (:mod:`llamacpp`; its tokens/s rows come with the speed section).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import llamacpp, llm

AddRow = Callable[..., Any]
#: The trained Llama's down_proj has 688 input channels: not whole GGUF blocks of 32 nor groups of 128, which
#: neither llama.cpp nor compressed-tensors reads, so it stays float in these rows.
PARTIAL_GROUPS = ["*down_proj"]


def hf_perplexity(model: torch.nn.Module, windows: list[dict[str, torch.Tensor]]) -> float:
    """transformers' own shifted cross-entropy over the windows (weighted by predicted tokens)."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in windows:
            count = batch["input_ids"][:, 1:].numel()
            total += float(model(**batch, labels=batch["input_ids"]).loss) * count
            tokens += count
    return math.exp(total / tokens)


def _gguf_config(gptq: bool, mse: bool = False) -> Any:
    """Preset ``gguf_q4_0`` (RTN), with ``GPTQConfig``, and with MSE-searched weight scales instead of max/7.5."""
    import dataclasses

    from quark_brevitas import QLayerConfig
    from quark_brevitas.config import GPTQConfig
    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.types import ParamType

    config = get_preset("gguf_q4_0")
    config.exclude = list(PARTIAL_GROUPS)
    config.pre_quant_opt_config = []
    config.algo_config = [GPTQConfig(damp_percent=0.01, desc_act=True)] if gptq else []
    if mse:
        (key, layer), = config.layer_type_quant_config.items()
        config.layer_type_quant_config[key] = QLayerConfig(
            weight=dataclasses.replace(layer.weight, param_type=ParamType.mse))
    return config


def _ct_config(recipe: str) -> Any:
    from quark_brevitas import Config, QLayerConfig, QTensorConfig
    from quark_brevitas.types import Dtype, QSchemeType

    if recipe != "rtn_w4_g128_asym":
        config = llm.recipe_config(recipe)
    else:
        weight = QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=128)
        config = Config(QLayerConfig(weight=weight), pre_quant_opt_config=[])
    config.exclude = list(PARTIAL_GROUPS)
    return config


def gguf_package_q4_0(ours: Path, float_model: torch.nn.Module, out: Path) -> Path:
    """The ``gguf`` package's round-to-nearest Q4_0 of ``float_model``, written to exactly the tensors that are
    Q4_0 in our file ``ours`` (everything else as F32), with our exporter's names, metadata and tokenizer."""
    import gguf

    from quark_brevitas.export.gguf.writer import GGUFTensor, collect_gguf_tensors, plan_gguf, write_gguf

    quantized = {t.name for t in gguf.GGUFReader(str(ours)).tensors if t.tensor_type.name == "Q4_0"}
    config = float_model.config
    plan = plan_gguf(config, None, Path(config.name_or_path))
    with torch.no_grad():
        tensors = collect_gguf_tensors(float_model, plan.family, plan.name_map, config)  # all F32, Q/K permuted
    rtn = [GGUFTensor(t.name, gguf.quants.quantize(t.data, gguf.GGMLQuantizationType.Q4_0), "Q4_0")
           if t.name in quantized else t for t in tensors]
    return write_gguf(plan, config, rtn, out)


def _gguf_loaded(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def _size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*.safetensors")]
    return sum(p.stat().st_size for p in files) / 1e6


def section_formats(work: Path, eval_sequences: int, calib_sequences: int, gptq: bool, add_row: AddRow) -> None:
    """GGUF and compressed-tensors rows on the trained Llama (perplexity of what transformers loads)."""
    import transformers

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.export import export_gguf, export_safetensors

    folder = llm.trained_llama(200)
    splits = llm.token_splits()
    evaluation = llm.windows(splits["eval"], eval_sequences, 8)
    calib = llm.windows(splits["calib"], calib_sequences, 4)

    def fresh() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()

    def row(name: str, path: Path, model: torch.nn.Module, ours: torch.nn.Module | None = None) -> None:
        ppl = hf_perplexity(model, evaluation)
        add_row(name, size_mb=_size_mb(path), perplexity=ppl)
        exact = "" if ours is None else f" (our PyTorch model: {hf_perplexity(ours, evaluation):.4f})"
        logging.info("%s: perplexity %.4f%s, %.2f MB", name, ppl, exact, _size_mb(path))

    row("float (transformers)", folder / "model.safetensors", fresh())
    gguf_recipes = {"GGUF Q4_0, ours RTN": (False, False), "GGUF Q4_0, ours RTN, MSE scales": (False, True)}
    if gptq:
        gguf_recipes.update({"GGUF Q4_0, ours GPTQ": (True, False), "GGUF Q4_0, ours GPTQ, MSE scales": (True, True)})
    ours_file = None
    gguf_files: dict[str, Path] = {}
    for name, (use_gptq, mse) in gguf_recipes.items():
        quant = ModelQuantizer(_gguf_config(use_gptq, mse)).quantize_model(fresh(), calib if use_gptq else None)
        path = export_gguf(quant, work / name.replace(" ", "_").replace(",", ""))
        ours_file = ours_file or path
        gguf_files[name] = path
        row(name, path, _gguf_loaded(path), quant)
    rtn = gguf_package_q4_0(ours_file, fresh(), work / "gguf_package_q4_0")
    gguf_files["GGUF Q4_0, gguf package RTN (llama.cpp quantize)"] = rtn
    row("GGUF Q4_0, gguf package RTN (llama.cpp quantize)", rtn, _gguf_loaded(rtn))

    ct_recipes = {"compressed-tensors W4 g128 sym, ours RTN": "rtn_w4_g128",
                  "compressed-tensors W4 g128 asym, ours RTN": "rtn_w4_g128_asym"}
    if gptq:
        ct_recipes["compressed-tensors W4 g128 sym, ours GPTQ"] = "gptq_w4_g128"
    for name, recipe in ct_recipes.items():
        quant = ModelQuantizer(_ct_config(recipe)).quantize_model(fresh(), calib if "gptq" in recipe else None)
        path = export_safetensors(quant, work / f"ct_{recipe}")
        row(name, path, transformers.AutoModelForCausalLM.from_pretrained(path).eval(), quant)

    reason = llamacpp.missing()
    if reason is not None:
        print(f"llama.cpp perplexity: skipped: {reason}")
        return
    for name, path in gguf_files.items():
        ppl = llamacpp.perplexity(path, evaluation)
        add_row(f"{name}, in llama.cpp", size_mb=_size_mb(path), perplexity=ppl)
        logging.info("%s in llama.cpp: perplexity %.4f", name, ppl)
