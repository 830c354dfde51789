"""The LLM algorithms on a GPU: time and peak memory on a Llama built from a config (one table).

Run: ``python -m benchmarks.gpu`` on a machine with CUDA (``--device cpu --hidden 128 --blocks 2`` for a smoke run
anywhere). The model is a Llama-architecture decoder with random weights (default 2048 wide, intermediate 5632,
16 heads, 8 blocks, vocabulary 32000: about 0.55 B parameters) built directly on the device in ``--dtype``
(bfloat16 by default): device and dtype follow the model, as in a user's script. Calibration: ``--rows`` random
sequences of ``--seq`` tokens, batch 8. Each recipe quantizes a fresh copy block by block (W4 per group of 128,
``lm_head`` kept in float) and the table prints wall seconds, the device's peak memory (``torch.cuda``'s allocator;
RSS on the CPU) and the relative error of the quantized model's logits against the float model's on a held-out
batch. Random weights make the error a sanity check only (accuracy is judged on the real MiniLM elsewhere); the
time and memory are what this table is for.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections.abc import Callable

import torch
import transformers

from benchmarks.tables import format_table  # noqa: E402
from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    AWQConfig,
    Config,
    GPTQConfig,
    QronosConfig,
    QuantizationConfig,
    QuantizationSpec,
)
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

W4_G128 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=128)


def _config(*algorithms: object) -> Config:
    return Config(QuantizationConfig(weight=W4_G128), pre_quant_opt_config=[], algo_config=list(algorithms),
                  exclude=["lm_head"])


RECIPES: dict[str, Callable[[], Config]] = {
    "round to nearest": lambda: _config(),
    "GPTQConfig": lambda: _config(GPTQConfig(sym=True, group_size=128)),
    "AWQConfig": lambda: _config(AWQConfig(sym=True, group_size=128)),
    "QronosConfig": lambda: _config(QronosConfig()),
}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 11 // 4,
        num_hidden_layers=args.blocks, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 128))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype=getattr(torch, args.dtype)).eval()


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GiB (a process-wide peak)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (8, args.seq), generator=generator) for _ in range(args.rows // 8)]
    held_out = torch.randint(0, args.vocab, (4, args.seq), generator=generator).to(device)
    float_model = build_model(args)
    reference = _logits(float_model, held_out)
    params = sum(p.numel() for p in float_model.parameters()) / 1e9
    del float_model
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"Llama {args.hidden} wide, {args.blocks} blocks, {params:.2f} B parameters, {args.dtype} on {name}; "
          f"calibration {args.rows} x {args.seq} tokens; W4 per group 128, lm_head float\n")
    rows = []
    for recipe in args.recipes:
        model = build_model(args)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        quantized = ModelQuantizer(RECIPES[recipe]()).quantize_model(model, batches, inplace=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        error = float((_logits(quantized, held_out) - reference).norm() / reference.norm())
        rows.append([recipe, f"{seconds:.1f}", f"{_peak_memory_gib(device):.2f}", f"{error:.4f}"])
        print(format_table(["recipe", "wall s", "peak memory GiB", "logits rel. error"], rows[-1:]), flush=True)
        del model, quantized
    print()
    print(format_table(["recipe", "wall s", "peak memory GiB", "logits rel. error"], rows))


if __name__ == "__main__":
    main()
