"""GGUF K-quants (issue 31): our Q2_K .. Q6_K files of the trained Llama beside llama.cpp's own quantizer.

Run: ``python -m benchmarks.gguf_kquants`` (a few minutes; ``--quick`` for fewer evaluation windows). It needs
the trained Llama of ``benchmarks/llm.py`` (trained and cached on first use) and, for the llama.cpp columns,
llama-cpp-python (the optional extra ``[llamacpp]``); without it those columns say why they are empty.

Per type (Q2_K .. Q6_K) and recipe (ours: round to nearest with max|w| scales, with MSE-searched scales, GPTQ on the
same grid; llama.cpp: ``llama_model_quantize`` of our F32 file, every tensor but the embedding at the type, like
ours): bits per weight of the K-quant tensors, file size, perplexity of the quantized model in PyTorch, of the file
loaded by transformers' GGUF loader, and of the file computed by llama.cpp (its own kernels: activations are
quantized to 8 bits per block in its products, so that column is close to, not equal to, the float result).

The trained Llama's ``down_proj`` has 688 input channels, no whole K-quant super-block (nor 32-channel block): our
recipes leave it float (F32 in the file), llama.cpp's quantizer writes it F16, so llama.cpp's files are smaller by
that difference; the bits-per-weight column counts the K-quant tensors only.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    llamacpp,  # noqa: E402
    llm,  # noqa: E402
)
from benchmarks.llm_deploy_hf import hf_perplexity  # noqa: E402
from benchmarks.tables import format_table  # noqa: E402

#: preset -> (GGUF type, llama.cpp's ftype for its quantizer, ggml type id).
#: mix preset -> (llama.cpp's name, its ftype); llama.cpp's own per-tensor rules (its head: Q6_K).
MIXES = {"gguf_q4_k_m": ("Q4_K_M", 15), "gguf_q3_k_m": ("Q3_K_M", 12)}
TYPES = {"gguf_q6_k": ("Q6_K", 18, 14), "gguf_q5_k": ("Q5_K", 16, 13), "gguf_q4_k": ("Q4_K", 14, 12),
         "gguf_q3_k": ("Q3_K", 11, 11), "gguf_q2_k": ("Q2_K", 10, 10)}
GGML_F32 = 0


def with_mse_scales(config: Any) -> Any:
    """``config`` with MSE-searched scales in every layer config that has one to search (not the signed Q5_0 / Q4_0
    block scale, ``scale_type=gguf_0``, of the mixes' 32-channel fallback types, nor the asymmetric K grids, whose
    scales and minimums come from a least-squares search already)."""
    import dataclasses

    from quark_brevitas import QLayerConfig
    from quark_brevitas.types import ParamType, ScaleType

    for level in (config.layer_type_quant_config, config.layer_quant_config):
        for key, layer in level.items():
            spec = layer.weight
            if spec.scale_type is not ScaleType.gguf_0 and not (spec.scale_type is ScaleType.gguf_k
                                                                 and spec.symmetric is False):
                level[key] = QLayerConfig(weight=dataclasses.replace(layer.weight, param_type=ParamType.mse))
    return config


def _config(preset: str, recipe: str, model_config: Any) -> Any:
    from quark_brevitas.config import GPTQConfig
    from quark_brevitas.config.presets import get_preset

    config = get_preset(preset, model_config)
    config.exclude = ["*down_proj"]  # 688 input channels: no whole K-quant block (llama.cpp: F16)
    config.pre_quant_opt_config = []
    if recipe == "GPTQ":
        config.algo_config = [GPTQConfig(damp_percent=0.01, desc_act=True)]
    if recipe in ("RTN mse", "GPTQ"):  # MSE-searched group scales, in every layer config of the preset
        with_mse_scales(config)
    return config


def k_quant_bits_per_weight(path: Path) -> float:
    """Bits per weight of the file's K-quant (and fallback-quantized) tensors."""
    import gguf

    bits = elements = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.tensor_type.name not in ("F32", "F16"):
            bits += int(tensor.n_bytes) * 8
            elements += int(tensor.n_elements)
    return bits / elements


def llama_cpp_quantize(source: Path, out: Path, ftype: int, ggml_type: int | None = None, *,
                       embedding_f32: bool = True) -> Path:
    """llama.cpp's own quantizer (``llama_model_quantize``) of ``source`` at ``ftype``: with ``ggml_type``, every
    tensor at that type (``pure``), else its mix's own per-tensor rules; the token embedding kept F32 as in our
    decoder files (``embedding_f32``), or typed by llama.cpp's rules (our BERT mixes quantize it as llama.cpp does)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    if embedding_f32:
        params.token_embedding_type = GGML_F32
    params.pure = ggml_type is not None
    if ggml_type is not None:
        params.output_tensor_type = ggml_type
    params.nthread = 1
    out.parent.mkdir(parents=True, exist_ok=True)
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")
    return out


def main(argv: list[str] | None = None) -> int:
    import transformers

    from quark_brevitas import ModelQuantizer
    from quark_brevitas.export import export_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 evaluation windows instead of 32")
    parser.add_argument("--types", default=",".join([*MIXES, *TYPES]), help="presets, comma-separated")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    folder = llm.trained_llama(200)
    splits = llm.token_splits()
    evaluation = llm.windows(splits["eval"], 8 if args.quick else 32, 8)
    calib = llm.windows(splits["calib"], 32, 4)
    no_llama = llamacpp.missing()

    def fresh() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()

    def loader_ppl(path: Path) -> float:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        return hf_perplexity(model, evaluation)

    def cpp_ppl(path: Path) -> str:
        return f"{llamacpp.perplexity(path, evaluation):.3f}" if no_llama is None else "n/a"

    class Rows(list):  # each row printed as it is measured (a long run shows its progress)
        def append(self, row: list[str]) -> None:
            print(" | ".join(row), file=sys.stderr, flush=True)
            super().append(row)

    rows: list[list[str]] = Rows()
    work = Path(tempfile.mkdtemp(prefix="gguf_bench_"))
    float_file = llamacpp.float_gguf(fresh(), folder, work / "float")
    rows.append(["float", "F32", "32.00", f"{float_file.stat().st_size / 1e6:.2f}",
                 f"{hf_perplexity(fresh(), evaluation):.3f}", f"{loader_ppl(float_file):.3f}", cpp_ppl(float_file)])
    model_config = fresh().config
    for preset in args.types.split(","):
        qtype, ftype, ggml_type = TYPES[preset] if preset in TYPES else (*MIXES[preset], None)
        for recipe in ("RTN", "RTN mse", "GPTQ"):
            quant = ModelQuantizer(_config(preset, recipe, model_config)).quantize_model(fresh(), calib)
            path = export_gguf(quant, work / f"{preset}_{recipe.replace(' ', '_')}", tokenizer_path=folder)
            ours, loaded = hf_perplexity(quant, evaluation), loader_ppl(path)
            rows.append([f"ours {recipe}", qtype, f"{k_quant_bits_per_weight(path):.3f}",
                         f"{path.stat().st_size / 1e6:.2f}", f"{ours:.3f}",
                         f"{loaded:.3f} ({100 * (loaded / ours - 1):+.4f} %)", cpp_ppl(path)])
        if no_llama is None:
            theirs = llama_cpp_quantize(float_file, work / f"llamacpp_{qtype}" / "model.gguf", ftype, ggml_type)
            rows.append(["llama.cpp quantize", qtype, f"{k_quant_bits_per_weight(theirs):.3f}",
                         f"{theirs.stat().st_size / 1e6:.2f}", "-", f"{loader_ppl(theirs):.3f}", cpp_ppl(theirs)])
    header = ["recipe", "type", "bits/weight (K-quant tensors)", "file MB", "perplexity (PyTorch)",
              "perplexity (transformers GGUF loader)", "perplexity (llama.cpp)"]
    print(format_table(header, rows))
    if no_llama is not None:
        print(f"llama.cpp columns empty: {no_llama}")
    print(f"evaluation: {sum(b['input_ids'].numel() for b in evaluation)} tokens; files in {work}")
    return 0 if all(math.isfinite(float(r[4])) for r in rows if r[4] != "-") else 1


if __name__ == "__main__":
    raise SystemExit(main())
