"""Tiny Hugging Face language models built from transformers configs (nothing is downloaded), token batches, and
the weight-only recipes the LLM algorithm tests share.

The models are a few layers deep and 64 wide, randomly initialised; :func:`with_outliers` scales a few channels of
every norm so that activations have the outlier channels SmoothQuant and AWQ exist for (as trained LLMs do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec
from quark_brevitas.types import Dtype, QSchemeType

VOCAB = 128
INT4_G32 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)
UINT4_G32 = QuantizationSpec(dtype=Dtype.uint4, symmetric=False, qscheme=QSchemeType.per_group, group_size=32)


def weight_only_config(weight: QuantizationSpec, algo: object = None, exclude: tuple[str, ...] = ("lm_head",)
                       ) -> Config:
    """``weight`` on every layer but ``exclude``, no pre-quantization step, ``algo`` (if any) after quantization."""
    return Config(QuantizationConfig(weight=weight), pre_quant_opt_config=[],
                  algo_config=[algo] if algo is not None else [], exclude=list(exclude))


def llm_config(weight: QuantizationSpec, algo: object = None, pre: list | None = None,
               act: QuantizationSpec | None = None, **kwargs: Any) -> Config:
    """``weight`` (and ``act`` on the inputs, if given) on every layer but ``lm_head``, ``pre`` before quantization,
    ``algo`` (one algorithm or a list) after it: the LLM algorithm tests' recipes, in Quark's terms."""
    return Config(QuantizationConfig(weight=weight, input_tensors=act), pre_quant_opt_config=pre or [],
                  algo_config=algo, exclude=["lm_head"], **kwargs)

#: Quark's scaling layers for Llama, as its documentation writes them (names relative to a decoder layer).
LLAMA_SCALING_LAYERS = [
    {"prev_op": "input_layernorm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
     "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
    {"prev_op": "post_attention_layernorm", "layers": ["mlp.gate_proj", "mlp.up_proj"], "inp": "mlp.gate_proj",
     "module2inspect": "mlp"},
    {"prev_op": "mlp.up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
]


def with_outliers(model: nn.Module, seed: int = 0) -> nn.Module:
    """Scale 4 channels of every norm weight by 8 (activation outliers), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter) and weight.dim() == 1 and "norm" in type(module).__name__.lower():
                channels = torch.randperm(weight.numel(), generator=generator)[:4]
                weight[channels] *= 8
    return model


def tiny_llama(layers: int = 2, kv_heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    return with_outliers(transformers.LlamaForCausalLM(config).eval())


def tiny_opt(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=layers,
                                    num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=64)
    return with_outliers(transformers.OPTForCausalLM(config).eval())


def tiny_gpt2(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return with_outliers(transformers.GPT2LMHeadModel(config).eval())


def tiny_bert(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, max_position_embeddings=64)
    return with_outliers(transformers.BertModel(config).eval())


def token_batches(count: int = 4, batch: int = 4, length: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """Batches of token ids (``[batch, length]``), as a Quark LLM calibration DataLoader yields them."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator) for _ in range(count)]


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(tokens)
    return (output.logits if hasattr(output, "logits") else output[0]).float()


def incremental_logits(model: nn.Module, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """``model``'s logits on ``tokens`` computed through its cache: the first ``prompt`` tokens at once, then one
    token a step with the cache fed back (what a decoding loop computes; to compare with one full forward)."""
    from quark_brevitas.calibration.data import cache_keyword

    with torch.no_grad():
        step = model(tokens[:, :prompt], use_cache=True)
        cache, pieces = step.past_key_values, [step.logits]
        for t in range(prompt, tokens.shape[1]):
            step = model(tokens[:, t:t + 1], **{cache_keyword(model): cache}, use_cache=True)
            pieces.append(step.logits)
    return torch.cat(pieces, dim=1)


def relative_error(model: nn.Module, reference: nn.Module, batches: list[torch.Tensor]) -> float:
    """``||model - reference|| / ||reference||`` over the main outputs of ``batches``."""
    errors = [(logits(model, b) - logits(reference, b)).norm() ** 2 for b in batches]
    norms = [logits(reference, b).norm() ** 2 for b in batches]
    return float((sum(errors) / sum(norms)) ** 0.5)


def bpe_tokenizer(folder: Path, *, pad: bool = False) -> Any:
    """A byte-level BPE tokenizer of fewer than ``VOCAB`` tokens saved in ``folder`` (GGUF files carry one; llama.cpp
    needs it), with ``<s>`` / ``</s>`` and, where ``pad``, a ``<pad>`` token (id 0: families whose config's default
    pad id lies beyond a tiny vocabulary take it from the file)."""
    import pytest

    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    # The text's own characters as the alphabet (byte level's 256 would not leave room for merges in 128 tokens).
    special = ["<pad>", "<s>", "</s>"] if pad else ["<s>", "</s>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                **({"pad_token": "<pad>"} if pad else {}))
    fast.save_pretrained(folder)
    return fast
