"""llama.cpp's K-quant mixes (``Q4_K_M``, ``Q5_K_M``, ``Q3_K_M``, ``Q2_K``, ``Q6_K``) as configs.

A mix gives most Linear layers one K-quant type and some tensors a higher one, by the per-tensor rules of
llama.cpp's quantizer (``llama_tensor_get_type`` in ``src/llama-quant.cpp``) for dense Llama-style models:

- the output head (``lm_head``): Q6_K;
- ``attn_v`` (``v_proj``): Q4_K_M / Q5_K_M: Q6_K in the layers where ``use_more_bits`` (the first and last eighth
  of the layers and every third one between); Q3_K_M: Q5_K in the first two layers, else Q4_K; Q2_K: Q4_K when
  the model has at least 4 query heads per key/value head, else Q3_K;
- ``ffn_down`` (``down_proj``): Q4_K_M / Q5_K_M: Q6_K where ``use_more_bits``; Q3_K_M: Q5_K in the first
  sixteenth of the layers, else Q4_K; Q2_K: Q3_K;
- ``attn_output`` (``o_proj``): Q3_K_M: Q4_K; Q2_K: Q3_K.

The rules depend on the number of layers (and query heads per key/value head), so a mix is built for a model:
:func:`gguf_mix_config` (the presets ``gguf_q4_k_m`` ... take them from the model folder on the command line).
The grids are the ``scale_type=gguf_k`` ones of :mod:`quark_brevitas.config.kquants`; embeddings stay float.
"""

from __future__ import annotations

from typing import Any

from quark_brevitas.config.enums import QSchemeType, ScaleType
from quark_brevitas.config.kquants import KQUANT_TYPES
from quark_brevitas.config.model_config import Config
from quark_brevitas.config.specs import QuantizationConfig, QuantizationSpec
from quark_brevitas.errors import ConfigError

__all__ = ["GGUF_MIXES", "gguf_kquant_layer", "gguf_mix_config", "gguf_mix_types"]

#: mix -> the type of every Linear layer no rule names.
GGUF_MIXES = {"Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K"}


def gguf_kquant_layer(qtype: str) -> QuantizationConfig:
    """The Linear layer config of one K-quant type (what the ``gguf_q*_k`` presets give every Linear layer)."""
    kquant = KQUANT_TYPES[qtype]
    return QuantizationConfig(weight=QuantizationSpec(
        bit_width=kquant.bit_width, qscheme=QSchemeType.per_group, group_size=kquant.group_size,
        scale_type=ScaleType.gguf_k, narrow_range=False))


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _attn_v(mix: str, layer: int, layers: int, gqa: int) -> str | None:
    if mix in ("Q4_K_M", "Q5_K_M"):
        return "Q6_K" if _use_more_bits(layer, layers) else None
    if mix == "Q3_K_M":
        return "Q5_K" if layer < 2 else "Q4_K"
    if mix == "Q2_K":
        return "Q4_K" if gqa >= 4 else "Q3_K"
    return None


def _ffn_down(mix: str, layer: int, layers: int) -> str | None:
    if mix in ("Q4_K_M", "Q5_K_M"):
        return "Q6_K" if _use_more_bits(layer, layers) else None
    if mix == "Q3_K_M":
        return "Q5_K" if layer < layers // 16 else "Q4_K"
    return "Q3_K" if mix == "Q2_K" else None


def gguf_mix_types(mix: str, layers: int, gqa: int = 1) -> dict[str, str]:
    """``{module-name pattern: K-quant type}`` of the tensors ``mix`` gives another type than its base type, for
    a Llama-style decoder of ``layers`` layers and ``gqa`` query heads per key/value head."""
    if mix not in GGUF_MIXES:
        raise ConfigError("mix", f"unknown GGUF mix {mix!r}; allowed: {', '.join(GGUF_MIXES)}")
    types = {"lm_head": "Q6_K"}
    for layer in range(layers):
        rules = {"self_attn.v_proj": _attn_v(mix, layer, layers, gqa), "mlp.down_proj": _ffn_down(mix, layer, layers),
                 "self_attn.o_proj": {"Q3_K_M": "Q4_K", "Q2_K": "Q3_K"}.get(mix)}
        for suffix, qtype in rules.items():
            if qtype is not None and qtype != GGUF_MIXES[mix]:
                types[f"*layers.{layer}.{suffix}"] = qtype
    return types


def gguf_mix_config(mix: str, model_config: Any) -> Config:
    """A Config quantizing a decoder as llama.cpp's ``mix`` does (see the module docstring); ``model_config`` is
    the model's Hugging Face config (or anything with ``num_hidden_layers``, ``num_attention_heads`` and
    optionally ``num_key_value_heads``)."""
    from torch import nn  # the layer-type key; torch is loaded only when a config is built

    from quark_brevitas.config.algorithms import Preprocess

    layers = getattr(model_config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError("model_config", "a GGUF mix needs the model's num_hidden_layers (its per-layer rules "
                                          "depend on it); give the model's config")
    heads = int(getattr(model_config, "num_attention_heads", 1) or 1)
    gqa = heads // int(getattr(model_config, "num_key_value_heads", None) or heads)
    overrides = {pattern: gguf_kquant_layer(qtype) for pattern, qtype in gguf_mix_types(mix, layers, gqa).items()}
    return Config(QuantizationConfig(), layer_type_quant_config={nn.Linear: gguf_kquant_layer(GGUF_MIXES[mix])},
                  layer_quant_config=overrides, pre_quant_opt_config=[Preprocess()])
