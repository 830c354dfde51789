"""ONNX tensor element types and the torch dtypes that hold them.

The one ONNX <-> torch table of the export: constant folding evaluates ``QuantizeLinear`` in torch and
writes the result as an ONNX tensor, the blocked weights store float8 codes, the runtime and the report
ask whether a file holds float8 tensors. Which torch dtype holds which fp8 format is Brevitas's
business and comes from :func:`quark_brevitas.brevitas_adapter.float8_dtype`; only the mapping to
ONNX's own type codes lives here.
"""

from __future__ import annotations

import onnx
import torch
from onnx import TensorProto

from quark_brevitas.brevitas_adapter import float8_dtype

#: ONNX float8 type -> (exponent bits, mantissa bits, FNUZ flavour).
FLOAT8_FORMATS: dict[int, tuple[int, int, bool]] = {
    TensorProto.FLOAT8E4M3FN: (4, 3, False),
    TensorProto.FLOAT8E4M3FNUZ: (4, 3, True),
    TensorProto.FLOAT8E5M2: (5, 2, False),
    TensorProto.FLOAT8E5M2FNUZ: (5, 2, True),
}
FLOAT8_ONNX_TYPES = frozenset(FLOAT8_FORMATS)


def _float8_torch_type(onnx_type: int) -> torch.dtype:
    exponent_bits, mantissa_bits, fnuz = FLOAT8_FORMATS[onnx_type]
    dtype = float8_dtype(exponent_bits, mantissa_bits, fnuz=fnuz)
    if dtype is None:  # pragma: no cover - the adapter's table covers every ONNX float8 type
        raise LookupError(f"no torch dtype for ONNX {TensorProto.DataType.Name(onnx_type)}")
    return dtype


#: ONNX quantized element type -> the torch dtype holding it (integer and float8 codes).
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.UINT16: torch.uint16,
    TensorProto.INT32: torch.int32,
    **{onnx_type: _float8_torch_type(onnx_type) for onnx_type in FLOAT8_FORMATS},
}
#: The inverse of :data:`ONNX_TO_TORCH`.
TORCH_TO_ONNX: dict[torch.dtype, int] = {dtype: onnx_type for onnx_type, dtype in ONNX_TO_TORCH.items()}


def uses_float8(model: onnx.ModelProto) -> bool:
    """Whether the model holds float8 tensors (initializers, inputs, outputs or annotated values)."""
    if any(init.data_type in FLOAT8_ONNX_TYPES for init in model.graph.initializer):
        return True
    infos = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    return any(vi.type.tensor_type.elem_type in FLOAT8_ONNX_TYPES for vi in infos)
