"""llama.cpp (llama-cpp-python, the optional ``[llamacpp]`` extra) on a quantized decoder's GGUF file: the one
way the GGUF family tests ask llama.cpp for logits, so dense and mixture-of-experts families are judged alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers.llm_models import bpe_tokenizer, token_batches
from quark_brevitas.export import export_gguf


def llama_cpp_logits(llama_cpp: Any, quant: torch.nn.Module, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Export ``quant`` (with the tests' byte-level BPE tokenizer) and run llama.cpp on 64 seeded tokens, one
    thread: ``(llama.cpp's logits [64, vocab], the tokens)``. ``llama_cpp``: the imported module (the caller skips
    when it is absent)."""
    bpe_tokenizer(tmp_path / "tok", pad=True)
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    tokens = token_batches(1, batch=1, length=64, seed=3)[0][0]
    runner = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    runner.eval(tokens.tolist())
    return torch.tensor(np.asarray(runner.scores[:len(tokens)]), dtype=torch.float32), tokens
