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

- BERT (llama.cpp's ``bert``: no output head): the token embedding takes the head's rule (Q6_K).

A tensor whose rows are no whole K-quant super-block (256 input channels) but whole blocks of 32 gets the type
llama.cpp's quantizer falls back to (read from the files its ``llama_model_quantize`` writes): Q6_K -> Q8_0,
Q5_K -> Q5_1, Q4_K -> Q5_0, Q3_K and Q2_K -> Q4_0 (all-MiniLM-L6-v2's 384-wide layers).

The rules depend on the number of layers (and query heads per key/value head), so a mix is built for a model:
:func:`gguf_mix_config` (the presets ``gguf_q4_k_m`` ... take them from the model folder on the command line).
The grids are the ``scale_type=gguf_k`` ones of :mod:`quark_brevitas.config.kquants`, asymmetric (a minimum per
sub-block, as llama.cpp's quantizer fills them) for Q2_K, Q4_K and Q5_K; embeddings stay float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quark_brevitas.config.enums import QSchemeType, ScaleType
from quark_brevitas.config.kquants import KQUANT_SUPER_BLOCK, KQUANT_TYPES
from quark_brevitas.config.model_config import Config
from quark_brevitas.config.specs import QuantizationConfig, QuantizationSpec
from quark_brevitas.errors import ConfigError

__all__ = ["GGUF_FALLBACK", "GGUF_MIXES", "MixLayout", "gguf_kquant_layer", "gguf_mix_config", "gguf_mix_types"]

#: mix -> the type of every Linear layer no rule names.
GGUF_MIXES = {"Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K"}
#: K-quant -> the 32-channel type llama.cpp's quantizer writes instead where rows are no whole super-block.
GGUF_FALLBACK = {"Q6_K": "Q8_0", "Q5_K": "Q5_1", "Q4_K": "Q5_0", "Q3_K": "Q4_0", "Q2_K": "Q4_0"}
#: 32-channel type -> (bit width, symmetric): float16 scales (and offsets) per group of 32.
_BLOCK_TYPES = {"Q8_0": (8, True), "Q5_0": (5, True), "Q5_1": (5, False), "Q4_0": (4, True)}
_BLOCK = 32


@dataclass(frozen=True)
class MixLayout:
    """Where llama.cpp's per-tensor roles are in one Hugging Face family: the pattern of a block's modules
    (``{i}``: the layer index), role -> module suffix, the head (``None``: the family has none, so the token
    embedding, ``embedding``, takes the head's type as in llama.cpp) and patterns left float."""

    block: str
    roles: dict[str, str]
    head: str | None = "lm_head"
    embedding: str | None = None
    exclude: tuple[str, ...] = ()


_LLAMA = MixLayout("*layers.{i}.", {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"})
#: model_type -> layout (Llama-style decoders share one).
MIX_LAYOUTS = {"bert": MixLayout("*encoder.layer.{i}.", {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "ffn_up": "intermediate.dense", "ffn_down": "output.dense"},
    head=None, embedding="*embeddings.word_embeddings", exclude=("*pooler.dense",))}


def _block_layer(qtype: str) -> QuantizationConfig:
    """Q5_0 / Q4_0 take llama.cpp's signed scale (``scale_type=gguf_0``: each group's largest-magnitude weight on
    code -2^(b-1), a finer step than max|w| / (2^(b-1) - 1/2)); Q8_0 is max|w| / 127 in llama.cpp as here."""
    bits, symmetric = _BLOCK_TYPES[qtype]
    signed = qtype in ("Q5_0", "Q4_0")
    return QuantizationConfig(weight=QuantizationSpec(
        bit_width=bits, symmetric=symmetric, qscheme=QSchemeType.per_group, group_size=_BLOCK,
        scale_type=ScaleType.gguf_0 if signed else ScaleType.float16,
        narrow_range=(qtype == "Q8_0") if symmetric else None))


def gguf_kquant_layer(qtype: str, symmetric: bool | None = None) -> QuantizationConfig:
    """The layer config of one GGUF type: a K-quant's ``gguf_k`` grid, or a 32-channel fallback type's float16 grid
    (Q8_0, Q5_0, Q5_1, Q4_0). Q2_K / Q4_K / Q5_K get llama.cpp's asymmetric grid (a minimum per sub-block) unless
    ``symmetric=True`` (the signed grid of the ``gguf_q2_k`` / ``gguf_q4_k`` / ``gguf_q5_k`` presets)."""
    if qtype in _BLOCK_TYPES:
        return _block_layer(qtype)
    kquant = KQUANT_TYPES[qtype]
    asymmetric = kquant.with_minimum and not symmetric
    return QuantizationConfig(weight=QuantizationSpec(
        bit_width=kquant.bit_width, symmetric=not asymmetric, qscheme=QSchemeType.per_group,
        group_size=kquant.group_size, scale_type=ScaleType.gguf_k, narrow_range=None if asymmetric else False))


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


def _fallback(qtype: str, width: int | None) -> str:
    """``qtype``, or llama.cpp's 32-channel type for it when rows of ``width`` are no whole super-block (rows of
    no whole 32 either: llama.cpp writes F16, left to the exporter's own fallback)."""
    if width is None or width % KQUANT_SUPER_BLOCK == 0 or width % _BLOCK or qtype not in GGUF_FALLBACK:
        return qtype
    return GGUF_FALLBACK[qtype]


def gguf_mix_types(mix: str, layers: int, gqa: int = 1, layout: MixLayout = _LLAMA,
                   widths: dict[str, int] | None = None) -> dict[str, str]:
    """``{module-name pattern: GGUF type}`` of the tensors ``mix`` gives another type than its base type, for a
    model of ``layers`` layers and ``gqa`` query heads per key/value head whose modules ``layout`` names;
    ``widths`` (``{"hidden": ..., "intermediate": ...}``: input channels of the layers, ``ffn_down``'s is the
    intermediate size) adds llama.cpp's fallback types of rows that are no whole super-block."""
    if mix not in GGUF_MIXES:
        raise ConfigError("mix", f"unknown GGUF mix {mix!r}; allowed: {', '.join(GGUF_MIXES)}")
    base = GGUF_MIXES[mix]
    widths = widths or {}
    hidden = widths.get("hidden")
    head_type = _fallback("Q6_K", hidden)
    types = {layout.head: head_type} if layout.head else {layout.embedding: head_type} if layout.embedding else {}
    for layer in range(layers):
        rules = {"attn_v": _attn_v(mix, layer, layers, gqa), "ffn_down": _ffn_down(mix, layer, layers),
                 "attn_output": {"Q3_K_M": "Q4_K", "Q2_K": "Q3_K"}.get(mix)}
        for role, suffix in layout.roles.items():
            width = widths.get("intermediate" if role == "ffn_down" else "hidden")
            qtype = _fallback(rules.get(role) or base, width)
            if qtype != base:
                types[layout.block.format(i=layer) + suffix] = qtype
    return types


def gguf_mix_config(mix: str, model_config: Any) -> Config:
    """A Config quantizing a model as llama.cpp's ``mix`` does (see the module docstring); ``model_config`` is
    the model's Hugging Face config (or anything with ``num_hidden_layers``, ``num_attention_heads`` and
    optionally ``num_key_value_heads``, ``hidden_size``, ``intermediate_size`` and ``model_type``)."""
    from torch import nn  # the layer-type key; torch is loaded only when a config is built

    from quark_brevitas.config.algorithms import Preprocess

    layers = getattr(model_config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError("model_config", "a GGUF mix needs the model's num_hidden_layers (its per-layer rules "
                                          "depend on it); give the model's config")
    heads = int(getattr(model_config, "num_attention_heads", 1) or 1)
    gqa = heads // int(getattr(model_config, "num_key_value_heads", None) or heads)
    layout = MIX_LAYOUTS.get(getattr(model_config, "model_type", None), _LLAMA)
    widths = {key: value for key, value in (("hidden", getattr(model_config, "hidden_size", None)),
                                            ("intermediate", getattr(model_config, "intermediate_size", None)))
              if isinstance(value, int)}
    types = gguf_mix_types(mix, layers, gqa, layout, widths)
    overrides = {pattern: gguf_kquant_layer(qtype) for pattern, qtype in types.items()}
    return Config(QuantizationConfig(), layer_type_quant_config={nn.Linear: gguf_kquant_layer(GGUF_MIXES[mix])},
                  layer_quant_config=overrides, pre_quant_opt_config=[Preprocess()], exclude=list(layout.exclude))
