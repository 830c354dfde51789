"""Block-by-block checkpoints of tiny decoder families under the GGUF presets, the input of the streamed-export
tests (``tests/export/test_export_readback.py``, ``test_tokenizer_readback.py``).

Llama and Mistral hold 9 tensors a block, Qwen2 and GPT-2 12: the families differ where a streamed export numbers
its spill files; ``qwen2-narrow`` (hidden 32) gives spill files of equal sizes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from helpers.llm_models import VOCAB, token_batches
from quark_brevitas import Config, QLayerConfig
from quark_brevitas.config.presets import get_preset
from quark_brevitas.hf.streaming import quantize_pretrained

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": VOCAB}
_NARROW = {**SIZES, "hidden_size": 32, "intermediate_size": 64}
FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)),
    # hidden 32: spill files of equal sizes, where the old numbering wrote other layers' weights without an error
    "qwen2-narrow": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_NARROW)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
}
#: The folder formats of a streamed safetensors export.
FOLDERS = ("compressed-tensors", "quark")


def family_config(family: str, preset: str) -> Config:
    """The preset; for GPT-2 its layer config on the Conv1D projections too (the presets cover nn.Linear only)."""
    if family != "gpt2":
        return get_preset(preset)
    layer = get_preset(preset).layer_type_quant_config["Linear"]
    return Config(QLayerConfig(), layer_type_quant_config={"Linear": layer, "Conv1D": layer}, pre_quant_opt_config=[])


def streamed_checkpoint(family: str, preset: str, root: Path) -> Path:
    """A block-by-block checkpoint (``root/ckpt``) of the tiny ``family`` model, whose float folder is deleted
    afterwards."""
    torch.manual_seed(0)
    FAMILIES[family]().eval().save_pretrained(root / "float")
    checkpoint = quantize_pretrained(root / "float", family_config(family, preset),
                                     [{"input_ids": t} for t in token_batches(1, batch=2, length=16)], root / "ckpt")
    shutil.rmtree(root / "float")
    return checkpoint
