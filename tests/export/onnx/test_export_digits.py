"""Done-when check: the exported digits model's predictions match PyTorch's in onnxruntime."""

from __future__ import annotations

import onnx
import pytest
from helpers.onnx_check import assert_onnx_predictions_match

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig, QuantType
from quark_brevitas.cli.digits import example_input
from quark_brevitas.types import QSchemeType

FP8 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3)
LAYERS = {
    "W8A8": QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)),
    "W4pcA8": QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel),
                           input_tensors=QTensorConfig(), bias=QTensorConfig(bit_width=32)),
    "FP8": QLayerConfig(weight=FP8, input_tensors=FP8),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_exported_predictions_match_pytorch(digits_model, digits_data, tmp_path, name: str) -> None:
    quant = ModelQuantizer(Config(global_quant_config=LAYERS[name])).quantize_model(digits_model, digits_data.calib)
    path = tmp_path / "digits.onnx"
    report = ModelExporter(path).export_onnx_model(quant, example_input(digits_data))
    assert report.max_abs_diff <= report.tolerance
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.onnx"]

    assert_onnx_predictions_match(quant, path, digits_data.test)

    weights = [i for i in onnx.load(str(path)).graph.initializer if len(i.dims) >= 2]
    expected = onnx.TensorProto.FLOAT8E4M3FN if name == "FP8" else onnx.TensorProto.INT8
    assert weights and all(w.data_type == expected for w in weights)
