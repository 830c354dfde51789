"""Quark's quantization enums (reference 000: ``quark.torch.quantization.config.type``), and the three
enums of Quark's Brevitas extension config (reference 003: ``QuantType``, ``ParamType``, ``Backend``).

Every enum and member of the references exists here under the same name, so code written for
Quark runs after changing only its imports (``quark_brevitas.types`` re-exports this module, and
:mod:`quark_brevitas.config` the reference 003 enums, as ``quark.torch.extensions.brevitas.config``
does). This module is the bottom of the config package: it imports nothing, so every other module
(the dtype tables, the dataclasses, the checks, the Brevitas translation table) can use the enums.
Members carry string values so that configs serialise to readable JSON/YAML. Whether a member is
*supported* is decided by :mod:`quark_brevitas.config.checks` (and honoured by the translation table
in :mod:`quark_brevitas.quantizers`); unsupported members are rejected at config-verification time with
a message, never silently mapped to something else.
"""

from __future__ import annotations

from enum import Enum


class QSchemeType(Enum):
    """Granularity of the quantization parameters."""

    per_tensor = "per_tensor"
    per_channel = "per_channel"
    per_group = "per_group"


class ZeroPointType(Enum):
    """The dtype of the zero point."""

    int32 = "int32"
    float32 = "float32"


class Dtype(Enum):
    """Data types used for quantized tensors."""

    int8 = "int8"
    uint8 = "uint8"
    int4 = "int4"
    uint4 = "uint4"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"
    fp6_e3m2 = "fp6_e3m2"
    fp6_e2m3 = "fp6_e2m3"
    fp4 = "fp4"
    mx = "mx"
    mx6 = "mx6"
    mx9 = "mx9"


class ScaleType(Enum):
    """How scale values are represented."""

    float = "float"
    pof2 = "pof2"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    #: GGUF K-quant scales: per 256 input channels, one float16 number times integer sub-scales (Q3_K, Q6_K).
    gguf_k = "gguf_k"
    #: GGUF's symmetric 32-channel types as llama.cpp's quantizer fills them (Q4_0, Q5_0): a float16 scale per
    #: group, signed, so that the group's largest-magnitude weight lands on the most negative code.
    gguf_0 = "gguf_0"
    #: Power-of-two scales with the exponent rounded to the nearest integer (``2^round(log2 s)``), as Quark's
    #: power-of-two observers compute it; ``pof2`` rounds it up (``2^ceil(log2 s)``: nothing clipped at
    #: calibration, at the price of up to twice the step). Per tensor and per channel. The FINN presets use it: a
    #: learned scale then sits at the power of two nearest to where QAT would put it (2-bit digits CNN: 98.0 %
    #: against 94.7 % with ``pof2``).
    pof2_round = "pof2_round"


class RoundType(Enum):
    """Rounding methods used when mapping to the quantized grid."""

    round = "round"
    floor = "floor"
    half_even = "half_even"
    #: Nearest, ties up (toward +inf): FINN's ``MultiThreshold`` rule, ``x >= (k + 1/2) * scale`` (quark_brevitas's
    #: addition). Computed as ``round_half_even(x / scale + 2^-16)``, which is the same for every value on a grid
    #: of at least 2^-15 steps, and which a QONNX file states exactly (``Add(x, scale * 2^-16)`` in front of a
    #: ``Quant`` that rounds half to even) when the scale is a power of two. Static int activations only.
    half_up = "half_up"


class DeviceType(Enum):
    """Target devices for deployment."""

    CPU = "cpu"
    IPU = "ipu"


class QuantizationMode(Enum):
    """Eager (module replacement) or FX graph mode."""

    eager_mode = "eager_mode"
    fx_graph_mode = "fx_graph_mode"


class TQTThresholdInitMeth(Enum):
    """Threshold initialisation of the TQT algorithm (Table 2 of arXiv:1903.08066)."""

    _3SD = "_3sd"
    _LL_J = "_ll_j"


class QuantType(Enum):
    """The fundamental data type of the quantized values: integers or (OCP) floating point."""

    int_quant = "int_quant"
    float_quant = "float_quant"


class ParamType(Enum):
    """How scale and zero point are determined: statistics (max / percentile) or MSE search."""

    stats = "stats"
    mse = "mse"


class Backend(Enum):
    """The backend target for quantization.

    - ``layerwise``: only quantizes inputs, weights, biases (and optionally outputs) of compute-heavy
      layers, which are replaced one by one by their Brevitas counterparts.
    - ``graph``: traces the model (FX) and quantizes every tensor reaching a compute layer: inputs, activation
      outputs, requantization after ops that leave the grid, shared scales on add/concat inputs
      (Quark's ``QuantizationMode.fx_graph_mode``; docs/how-to/graph-finn.md).
    """

    layerwise = "layerwise"
    graph = "graph"


__all__ = [
    "Backend",
    "DeviceType",
    "Dtype",
    "ParamType",
    "QSchemeType",
    "QuantType",
    "QuantizationMode",
    "RoundType",
    "ScaleType",
    "TQTThresholdInitMeth",
    "ZeroPointType",
]
