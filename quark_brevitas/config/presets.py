"""Named, ready-made quantization configs for the command line and quick experiments.

``get_preset("w8a8")`` returns a fresh :class:`~quark_brevitas.config.Config`; ``PRESETS`` maps each
name to the function that builds it and ``DESCRIPTIONS`` gives one line per preset. ``w8a8`` is the
command line's default. Every preset keeps the default pre-quantization step (``Preprocess``). The
``bert_*`` presets are recipes for transformer encoders (measured on all-MiniLM-L6-v2 by
``benchmarks/bert_deploy.py``); they quantize the Linear layers and the embedding tables (weights only).
"""

from __future__ import annotations

from collections.abc import Callable

from quark_brevitas.config import Config, ParamType, QLayerConfig, QTensorConfig, QuantType
from quark_brevitas.config import algorithms as algos
from quark_brevitas.config.enums import Dtype, QSchemeType, ScaleType
from quark_brevitas.config.gguf_mixes import gguf_mix_config
from quark_brevitas.config.kquants import KQUANT_BY_BITS
from quark_brevitas.errors import ConfigError

__all__ = ["DEFAULT_PRESET", "DESCRIPTIONS", "MODEL_PRESETS", "PRESETS", "get_preset"]

DEFAULT_PRESET = "w8a8"

_INT8 = QTensorConfig()  # int8 per-tensor symmetric, float scale from statistics
_INT32_BIAS = QTensorConfig(bit_width=32)
_FP8_E4M3 = QTensorConfig(quant_type=QuantType.float_quant, bit_width=8, exponent_bit_width=4, mantissa_bit_width=3)


def _w8a8() -> Config:
    return Config(QLayerConfig(weight=_INT8, input_tensors=_INT8, bias=_INT32_BIAS))


def _w8a8_per_channel() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel)
    return Config(QLayerConfig(weight=weight, input_tensors=_INT8, bias=_INT32_BIAS))


def _w4a8_gptq() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)
    return Config(QLayerConfig(weight=weight, input_tensors=_INT8, bias=_INT32_BIAS), algo_config=[algos.GPTQ()])


def _w4_weight_only() -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4, param_type=ParamType.mse)
    return Config(QLayerConfig(weight=weight))


# ---------------------------------------------------------------- transformer (BERT-style encoder) recipes
# Only the Linear layers and the embedding tables are quantized (at their types' levels, so other layer types a
# container maps stay float); Softmax, LayerNorm, GELU, the residual adds and attention's two score
# matmuls stay float: they are cheap, and onnxruntime has no integer kernel that fuses them. Activations are
# asymmetric uint8: a BERT's Linear inputs are one-sided after GELU and carry outlier channels, where
# symmetric int8 loses half its codes (measured on all-MiniLM-L6-v2: README, "Hugging Face transformers").
_UINT8 = QTensorConfig(dtype=Dtype.uint8)
_UINT8_PER_TOKEN = QTensorConfig(dtype=Dtype.uint8, is_dynamic=True, qscheme=QSchemeType.per_channel)
_W8_PER_CHANNEL = QTensorConfig(qscheme=QSchemeType.per_channel)
_W4_G32 = QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)


# The embedding tables (word, position, token type) get int8 per-tensor weights: the word table is most of a small
# encoder's file (all-MiniLM-L6-v2: 11.7M of its 22.7M parameters), and the QCDQ exporter gathers the int8 rows
# before dequantizing them (one scale for the whole table is what lets it), as onnxruntime's quantize_dynamic does.
_EMBEDDING = QLayerConfig(weight=_INT8)


def _linear_only(layer: QLayerConfig, pre: list[algos.AlgorithmConfig] | None = None,
                 post: list[algos.AlgorithmConfig] | None = None, *, embeddings: bool = False) -> Config:
    """Linear layers get ``layer``; with ``embeddings``, the embedding tables get int8 weights too (encoders: the
    ONNX exporter gathers int8 rows; GGUF has no int8 per-tensor embedding type, so its presets leave them float)."""
    from torch import nn  # the layer-type keys; torch is loaded only when a preset is built

    types = {nn.Linear: layer, nn.Embedding: _EMBEDDING} if embeddings else {nn.Linear: layer}
    return Config(QLayerConfig(), layer_type_quant_config=types,
                  pre_quant_opt_config=[algos.Preprocess(), *(pre or [])], algo_config=list(post or []))


def _bert_w8a8() -> Config:
    layer = QLayerConfig(weight=_W8_PER_CHANNEL, input_tensors=_UINT8, bias=_INT32_BIAS)
    return _linear_only(layer, pre=[algos.ActivationEqualization()], embeddings=True)


def _bert_w8a8_dynamic() -> Config:
    # A scale per token computed at run time: no bias quantization (its scale would change per token).
    return _linear_only(QLayerConfig(weight=_W8_PER_CHANNEL, input_tensors=_UINT8_PER_TOKEN), embeddings=True)


def _bert_w4_g32() -> Config:
    return _linear_only(QLayerConfig(weight=_W4_G32), post=[algos.GPTQ()], embeddings=True)


# ---------------------------------------------------------------- GGUF (llama.cpp) block formats
# Linear layers only, weights in groups of 32 input channels with float16 scales (what GGUF blocks store), so that
# quark_brevitas.export.export_gguf writes them exactly; add algo_config=[algos.GPTQ()] or [algos.AWQ()] to round
# them with an algorithm instead of to nearest. Each preset uses the codes its GGUF type has, whatever the default
# grid for the bit width: Q4_0 all sixteen -8..7 (llama.cpp's quantizer puts each block's largest weight on -8),
# Q8_0 only -127..127 (llama.cpp divides by 127); Q4_1 is asymmetric (0..15 and an offset).
_GGUF_NARROW_RANGE = {Dtype.int4: False, Dtype.int8: True, Dtype.uint4: None}


def _gguf(dtype: Dtype) -> Callable[[], Config]:
    def build() -> Config:
        weight = QTensorConfig(dtype=dtype, qscheme=QSchemeType.per_group, group_size=32, scale_type=ScaleType.float16,
                               narrow_range=_GGUF_NARROW_RANGE[dtype])
        return _linear_only(QLayerConfig(weight=weight))

    return build


# GGUF K-quants: int2..int6 symmetric weights per group of 16 (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K) on their full code
# range, the group scales snapped per 256 input channels to integer multiples of one float16 number (gguf_k).
def _gguf_kquant(bit_width: int) -> Callable[[], Config]:
    def build() -> Config:
        group_size = KQUANT_BY_BITS[bit_width].group_size
        weight = QTensorConfig(bit_width=bit_width, qscheme=QSchemeType.per_group, group_size=group_size,
                               scale_type=ScaleType.gguf_k, narrow_range=False)
        return _linear_only(QLayerConfig(weight=weight))

    return build


def _gguf_mix(mix: str) -> Callable[..., Config]:
    def build(model_config: object = None) -> Config:
        if model_config is None:
            raise ConfigError("preset", f"preset gguf_{mix.lower()} follows llama.cpp's per-layer rules, which depend "
                              "on the model's number of layers: give the model (quark-brevitas quantize --model DIR, "
                              "or get_preset(name, model.config) / gguf_mix_config(mix, model.config))")
        return gguf_mix_config(mix, model_config)

    return build


def _fp8() -> Config:
    # No bias quantization: an integer bias needs integer input and weight scales.
    return Config(QLayerConfig(weight=_FP8_E4M3, input_tensors=_FP8_E4M3))


# ---------------------------------------------------------------- FINN (whole networks, Backend.graph)
# Every tensor reaching a compute layer is quantized (docs/how-to/graph-finn.md): per-tensor symmetric activations
# (unsigned behind ReLUs, signed elsewhere, zero point 0), per-channel symmetric weights. At 2 and 4 bits (the FPGA
# widths) the arithmetic is FINN's exactly: power-of-two scales and int32 biases on the accumulator's grid make
# every product and sum in the file exact in float32, and activations round ties up as FINN's thresholds do
# (RoundType.half_up), so FINN's converted model computes the file's values bit for bit. finn_w8a8 is also the
# onnxruntime target (QCDQ on integer kernels, whose QuantizeLinear rounds ties to even): float scales and float
# biases (FINN absorbs them into the next thresholds).
def _finn(bits: int) -> Callable[[], Config]:
    def build() -> Config:
        from quark_brevitas.config.enums import Backend, RoundType, ScaleType

        exact = {"scale_type": ScaleType.pof2_round} if bits < 8 else {}
        weight = QTensorConfig(bit_width=bits, qscheme=QSchemeType.per_channel, **exact)
        activation = QTensorConfig(bit_width=bits, **exact, **({"round_method": RoundType.half_up} if exact else {}))
        bias = _INT32_BIAS if exact else None
        return Config(QLayerConfig(weight=weight, input_tensors=activation, bias=bias), backend=Backend.graph)

    return build


PRESETS: dict[str, Callable[..., Config]] = {
    "w8a8": _w8a8,
    "w8a8_per_channel": _w8a8_per_channel,
    "w4a8_gptq": _w4a8_gptq,
    "w4_weight_only": _w4_weight_only,
    "fp8": _fp8,
    "bert_w8a8": _bert_w8a8,
    "bert_w8a8_dynamic": _bert_w8a8_dynamic,
    "bert_w4_g32": _bert_w4_g32,
    "gguf_q4_0": _gguf(Dtype.int4),
    "gguf_q4_1": _gguf(Dtype.uint4),
    "gguf_q8_0": _gguf(Dtype.int8),
    "gguf_q6_k": _gguf_kquant(6),
    "gguf_q5_k": _gguf_kquant(5),
    "gguf_q4_k": _gguf_kquant(4),
    "gguf_q3_k": _gguf_kquant(3),
    "gguf_q2_k": _gguf_kquant(2),
    "gguf_q6_k_mix": _gguf_mix("Q6_K"),
    "gguf_q5_k_m": _gguf_mix("Q5_K_M"),
    "gguf_q4_k_m": _gguf_mix("Q4_K_M"),
    "gguf_q3_k_m": _gguf_mix("Q3_K_M"),
    "gguf_q2_k_mix": _gguf_mix("Q2_K"),
    "finn_w8a8": _finn(8),
    "finn_w4a4": _finn(4),
    "finn_w2a2": _finn(2),
}

#: The presets built for a model (``get_preset(name, model_config)``).
MODEL_PRESETS = ("gguf_q6_k_mix", "gguf_q5_k_m", "gguf_q4_k_m", "gguf_q3_k_m", "gguf_q2_k_mix")

DESCRIPTIONS: dict[str, str] = {
    "w8a8": "int8 per-tensor weights, int8 per-tensor inputs, int32 bias (default)",
    "w8a8_per_channel": "int8 per-channel weights, int8 per-tensor inputs, int32 bias",
    "w4a8_gptq": "int4 per-channel weights rounded by GPTQ, int8 inputs, int32 bias",
    "w4_weight_only": "int4 per-channel weights with MSE scales; activations stay float",
    "fp8": "fp8 e4m3 per-tensor weights and inputs; bias stays float",
    "bert_w8a8": "transformers: Linear layers and int8 embedding tables; int8 per-channel weights, uint8 "
                 "asymmetric inputs, int32 bias, ActivationEqualization",
    "bert_w8a8_dynamic": "transformers: Linear layers and int8 embedding tables; int8 per-channel weights, uint8 "
                         "inputs with a scale per token computed at run time",
    "bert_w4_g32": "transformers: Linear layers and int8 embedding tables; int4 weights per group of 32 rounded "
                   "by GPTQ; activations stay float",
    "gguf_q4_0": "GGUF Q4_0: Linear layers only, int4 symmetric weights (codes -8..7) per group of 32, float16 scales",
    "gguf_q4_1": "GGUF Q4_1: Linear layers only, uint4 asymmetric weights per group of 32, float16 scales and offsets",
    "gguf_q8_0": "GGUF Q8_0: Linear layers only, int8 symmetric weights (codes -127..127) per group of 32, "
                 "float16 scales",
    "gguf_q6_k": "GGUF Q6_K: Linear layers only, int6 symmetric weights per group of 16, per 256 input channels "
                 "int8 multiples of one float16 scale",
    "gguf_q5_k": "GGUF Q5_K: Linear layers only, int5 symmetric weights per group of 32, per 256 input channels "
                 "6-bit multiples of one float16 scale",
    "gguf_q4_k": "GGUF Q4_K: Linear layers only, int4 symmetric weights per group of 32, per 256 input channels "
                 "6-bit multiples of one float16 scale",
    "gguf_q3_k": "GGUF Q3_K: Linear layers only, int3 symmetric weights per group of 16, per 256 input channels "
                 "6-bit multiples of one float16 scale",
    "gguf_q2_k": "GGUF Q2_K: Linear layers only, int2 symmetric weights per group of 16, per 256 input channels "
                 "4-bit multiples of one float16 scale",
    "gguf_q6_k_mix": "llama.cpp's Q6_K file: gguf_q6_k everywhere (the head Q6_K too); needs the model",
    "gguf_q5_k_m": "llama.cpp's Q5_K_M mix: Q5_K, Q6_K for attn_v / ffn_down in some layers and the head; needs the "
                   "model",
    "gguf_q4_k_m": "llama.cpp's Q4_K_M mix: Q4_K, Q6_K for attn_v / ffn_down in some layers and the head; needs the "
                   "model",
    "gguf_q3_k_m": "llama.cpp's Q3_K_M mix: Q3_K, Q4_K/Q5_K for attn_v, ffn_down, attn_output, Q6_K head; needs the "
                   "model",
    "gguf_q2_k_mix": "llama.cpp's Q2_K mix: Q2_K, Q3_K/Q4_K for attn_v, ffn_down, attn_output, Q6_K head; needs the "
                     "model",
    "finn_w8a8": "Backend.graph for FINN: every tensor int8 (unsigned after ReLU), int8 per-channel weights",
    "finn_w4a4": "Backend.graph for FINN: every tensor 4-bit (unsigned after ReLU), int4 per-channel weights; "
                 "power-of-two scales, ties rounded up (FINN's arithmetic exactly)",
    "finn_w2a2": "Backend.graph for FINN: every tensor 2-bit (unsigned after ReLU), int2 per-channel weights; "
                 "power-of-two scales, ties rounded up (FINN's arithmetic exactly)",
}


def get_preset(name: str, model_config: object = None) -> Config:
    """A fresh Config for preset ``name``; :class:`ConfigError` listing the presets if unknown. The GGUF mixes
    (``gguf_q4_k_m`` ...) need the model's config (``model_config``: its layer count); the others ignore it."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ConfigError("", f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}") from None
    return build(model_config) if name in MODEL_PRESETS else build()
