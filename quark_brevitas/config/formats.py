"""The ``dtype`` short form of a QuantizationSpec: which fields each element dtype implies.

Quark lets a spec say ``dtype=int4`` or ``dtype=mx, mx_element_dtype=fp4`` instead of spelling out
``quant_type``, ``bit_width``, exponent and mantissa widths (and, for MX, the block granularity).
This module is the one table of what each short form means (:data:`DTYPE_FIELDS`, the MX tables,
:data:`REJECTED_DTYPES` with the reason each unsupported member is refused). It holds data only and
depends on the enums alone, so the spec dataclass (:mod:`quark_brevitas.config.specs`, whose
:func:`~quark_brevitas.config.specs.resolve_dtype` applies the table) and the checks can both read it.
"""

from __future__ import annotations

from typing import Any

from quark_brevitas.config.enums import Dtype, ParamType, QSchemeType, QuantType, ScaleType

__all__ = [
    "DTYPE_FIELDS",
    "MIN_MAX_OBSERVERS",
    "OBSERVER_FIELDS",
    "REJECTED_OBSERVERS",
    "MX_BLOCK_SIZE",
    "MX_ELEMENT_DTYPES",
    "MX_FIELDS",
    "REJECTED_DTYPES",
]

_INT, _FLOAT = QuantType.int_quant, QuantType.float_quant

#: The fields each element dtype implies.
DTYPE_FIELDS: dict[Dtype, dict[str, Any]] = {
    Dtype.int8: {"quant_type": _INT, "bit_width": 8},
    Dtype.int4: {"quant_type": _INT, "bit_width": 4},
    Dtype.uint8: {"quant_type": _INT, "bit_width": 8, "symmetric": False},
    Dtype.uint4: {"quant_type": _INT, "bit_width": 4, "symmetric": False},
    Dtype.fp8_e4m3: {"quant_type": _FLOAT, "bit_width": 8, "exponent_bit_width": 4, "mantissa_bit_width": 3},
    Dtype.fp8_e5m2: {"quant_type": _FLOAT, "bit_width": 8, "exponent_bit_width": 5, "mantissa_bit_width": 2},
    Dtype.fp6_e3m2: {"quant_type": _FLOAT, "bit_width": 6, "exponent_bit_width": 3, "mantissa_bit_width": 2},
    Dtype.fp6_e2m3: {"quant_type": _FLOAT, "bit_width": 6, "exponent_bit_width": 2, "mantissa_bit_width": 3},
    Dtype.fp4: {"quant_type": _FLOAT, "bit_width": 4, "exponent_bit_width": 2, "mantissa_bit_width": 1},
}

#: Element formats of OCP MX (``dtype=mx``), and what ``mx`` itself implies besides them.
MX_ELEMENT_DTYPES = (Dtype.int8, Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp4)
MX_BLOCK_SIZE = 32
MX_FIELDS: dict[str, Any] = {"qscheme": QSchemeType.per_group, "group_size": MX_BLOCK_SIZE,
                             "scale_type": ScaleType.pof2, "symmetric": True}

#: Dtype members that are not quantization formats quark_brevitas can honour, and why.
REJECTED_DTYPES: dict[Dtype, str] = {
    Dtype.bfloat16: "bfloat16 is a plain cast, not a quantizer with a scale: Brevitas has none. Cast the "
    "model (model.to(torch.bfloat16)) or keep the tensor in float (spec None)",
    Dtype.float16: "float16 is a plain cast, not a quantizer with a scale: Brevitas has none. Cast the model "
    "(model.half()) or keep the tensor in float (spec None)",
    Dtype.mx6: "mx6 (shared micro-exponents: 2-element sub-blocks with a 1-bit micro-exponent under an 8-bit "
    "block exponent) has no Brevitas quantizer and cannot be composed from one; use dtype=mx with "
    "mx_element_dtype fp6_e3m2 or fp6_e2m3 (OCP MXFP6)",
    Dtype.mx9: "mx9 (shared micro-exponents: 2-element sub-blocks with a 1-bit micro-exponent under an 8-bit "
    "block exponent) has no Brevitas quantizer and cannot be composed from one; use dtype=mx with "
    "mx_element_dtype int8 (OCP MXINT8) or fp8_e4m3 (MXFP8)",
}


# ===================================================================== Quark's observer classes
P, S = QSchemeType, ScaleType
#: What each of Quark's observer classes (``QTensorConfig.observer_cls``, by class name) says in this library's
#: fields: its granularity, ``param_type`` (min-max and percentile statistics: ``stats``; MSE searches: ``mse``)
#: and power-of-two scales. Fields the spec sets otherwise contradict the observer (a ConfigError).
OBSERVER_FIELDS: dict[str, dict[str, Any]] = {
    "PerTensorMinMaxObserver": {"qscheme": P.per_tensor, "param_type": ParamType.stats},
    "PerChannelMinMaxObserver": {"qscheme": P.per_channel, "param_type": ParamType.stats},
    "PerGroupMinMaxObserver": {"qscheme": P.per_group, "param_type": ParamType.stats},
    "PerTensorPowOf2MinMaxObserver": {"qscheme": P.per_tensor, "param_type": ParamType.stats, "scale_type": S.pof2},
    "PerChannelPowOf2MinMaxObserver": {"qscheme": P.per_channel, "param_type": ParamType.stats, "scale_type": S.pof2},
    "PerTensorPowOf2MinMSEObserver": {"qscheme": P.per_tensor, "param_type": ParamType.mse, "scale_type": S.pof2},
    "PerChannelPowOf2MinMSEObserver": {"qscheme": P.per_channel, "param_type": ParamType.mse, "scale_type": S.pof2},
    "PerTensorMSEObserver": {"qscheme": P.per_tensor, "param_type": ParamType.mse},
    "PerTensorPercentileObserver": {"qscheme": P.per_tensor, "param_type": ParamType.stats},
    "PerBlockMXObserver": {"qscheme": P.per_group, "param_type": ParamType.stats, "scale_type": S.pof2},
    "PerBlockMXBufferReuseObserver": {"qscheme": P.per_group, "param_type": ParamType.stats, "scale_type": S.pof2},
}
#: The min-max observers: static activations then calibrate on the maximum (percentile 100), not on the default
#: percentile of ``param_type=stats``.
MIN_MAX_OBSERVERS = frozenset(name for name in OBSERVER_FIELDS if "MinMax" in name and "MSE" not in name)
#: Quark's observers without an equivalent here, with the reason.
REJECTED_OBSERVERS: dict[str, str] = {
    "PlaceholderObserver": "it stands for Quark's float16/bfloat16 casts, which have no quantizer; leave the "
                           "tensor's spec None to keep it in float",
    "PerTensorHistogramObserver": "Brevitas has no histogram search; use PerTensorPercentileObserver or "
                                  "PerTensorMSEObserver (param_type stats or mse)",
    "PerTensorHistogramObserverPro": "Brevitas has no histogram search; use PerTensorPercentileObserver or "
                                     "PerTensorMSEObserver (param_type stats or mse)",
    "PerBlockMXDiffsObserver": "its MX scale rule is Quark's own; use PerBlockMXObserver",
    "PerBlockBFPObserver": "block floating point (BFP16) is not supported",
    "PerBlock2DMinMaxObserver": "2-D block scales are not supported; use PerGroupMinMaxObserver",
}
