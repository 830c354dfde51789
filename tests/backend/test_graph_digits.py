"""The digits residual CNN through Backend.graph: QAT accuracy in PyTorch and in FINN's converted file, and the
W8A8 file on onnxruntime's integer kernels."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from helpers.finn import run_finn
from helpers.graph_zoo import GRAPH_ZOO, QAT_RECIPE, ResidualCNN, finn_config, input_batch, randomised

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.cli.digits import evaluate, fine_tune, load_digits_data
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import export_onnx_qcdq, export_qonnx
from quark_brevitas.qat import prepare_qat


def _digits_qat(bits: int, tmp_path_factory):
    """The residual CNN trained on digits, quantized by ``finn_config(bits)`` and trained by ``QAT_RECIPE[bits]``;
    (float accuracy, QAT accuracy, the QONNX file, the test images)."""
    torch.manual_seed(0)
    data = load_digits_data()
    model = ResidualCNN()
    fine_tune(model, data, epochs=15, lr=3e-3)
    float_accuracy = evaluate(model, data.test)
    quant = ModelQuantizer(finn_config(bits, model)).quantize_model(model, data.calib)
    prepare_qat(quant)
    epochs, lr = QAT_RECIPE[bits]
    fine_tune(quant, data, epochs=epochs, lr=lr)
    xt = torch.cat([batch[0] for batch in data.test])
    path = tmp_path_factory.mktemp("digits") / f"w{bits}a{bits}.onnx"
    export_qonnx(quant.eval(), xt, path)  # verified against PyTorch on every test image
    return float_accuracy, evaluate(quant, data.test), path, xt


@pytest.fixture(scope="module")
def digits_w4a4(tmp_path_factory):
    return _digits_qat(4, tmp_path_factory)


@pytest.fixture(scope="module")
def digits_w2a2(tmp_path_factory):
    return _digits_qat(2, tmp_path_factory)


@pytest.mark.slow
def test_digits_residual_cnn_w4a4_qat_within_one_point_of_float(digits_w4a4) -> None:
    float_accuracy, qat_accuracy, _, _ = digits_w4a4
    assert qat_accuracy >= float_accuracy - 1.0, (float_accuracy, qat_accuracy)


@pytest.mark.slow
def test_digits_residual_cnn_w2a2_qat_within_three_points_of_float(digits_w2a2) -> None:
    float_accuracy, qat_accuracy, _, _ = digits_w2a2
    assert qat_accuracy >= float_accuracy - 3.0, (float_accuracy, qat_accuracy)


@pytest.mark.slow
@pytest.mark.parametrize("trained", ["digits_w4a4", "digits_w2a2"])
def test_finn_converted_digits_file_predicts_as_pytorch(finn, trained, request) -> None:
    _, _, path, xt = request.getfixturevalue(trained)
    result = run_finn(finn, path, xt.numpy())
    # FINN's file computes the QONNX file's values bit for bit (the presets' exact arithmetic), so it has the
    # PyTorch model's predictions and accuracy on every test image
    assert result["diff_streamline"] == 0.0 and result["argmax_agree"] == 1.0, result
    assert result["float_compute_inputs"] == [], result


def test_graph_w8a8_file_runs_conv_add_pool_on_integer_kernels(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = input_batch(32)
    quant = ModelQuantizer(get_preset("finn_w8a8")).quantize_model(randomised(GRAPH_ZOO["residual_cnn"]()), [x])
    report = export_onnx_qcdq(quant, x[:8], tmp_path / "m.onnx")
    assert report.max_abs_diff < 1e-3
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(node.op_type for node in onnx.load(tmp_path / "opt.onnx").graph.node)
    assert ops["QLinearConv"] == 3 and ops["Conv"] == 0, ops
    assert ops["QLinearAdd"] == 1 and ops["Add"] == 0, ops
    assert ops["QLinearGlobalAveragePool"] == 1 and ops["GlobalAveragePool"] == 0, ops
    assert not np.isnan(report.max_abs_diff)
