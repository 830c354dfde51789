"""Export a quantized model to ONNX QCDQ and run the file with plain onnxruntime.

``ModelExporter(path).export_onnx_model(model, example_input)`` writes a self-contained ONNX file
in the QCDQ style (QuantizeLinear/DequantizeLinear pairs around each quantized tensor, with a Clip
where the integer range is narrower than the storage type; int8 weights and int32 biases stored as
integers), runs it in onnxruntime and checks it against PyTorch before returning a
report. The file needs nothing from this library to run: below it is loaded with onnxruntime
directly, as a deployment would, and its accuracy is measured on the test set.

Run: ``python examples/export_onnx.py`` (offline, < 1 minute).
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from quark_brevitas import ModelExporter, ModelQuantizer
from quark_brevitas.cli.digits import evaluate, evaluate_predictions, example_input, load_digits_data, train_digits_cnn
from quark_brevitas.config.presets import get_preset

torch.set_num_threads(1)  # the model is tiny; extra threads only add overhead

# Train the digits CNN and quantize it to W8A8 (int8 weights and inputs, int32 biases).
data = load_digits_data()
float_model = train_digits_cnn(data)
quant_model = ModelQuantizer(get_preset("w8a8")).quantize_model(float_model, data.calib)

with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "digits_w8a8.onnx"

    # Export. The example input fixes the input shape; the batch dimension stays dynamic.
    report = ModelExporter(path).export_onnx_model(quant_model, example_input(data))
    print(f"wrote {path.name}: {report.file_size} bytes, opset {report.opset}, "
          f"weights {'/'.join(report.weight_dtypes)}, biases {'/'.join(report.bias_dtypes)}; "
          f"verified max |onnxruntime - PyTorch| = {report.max_abs_diff:.2e}")

    # What the graph contains.
    ops = collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)
    print("ONNX operators:", ", ".join(f"{op} x{count}" for op, count in sorted(ops.items())))

    # Run it with onnxruntime, without this library.
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    images = example_input(data, batch=4)
    ort_logits = session.run(None, {input_name: images.numpy()})[0]
    with torch.no_grad():
        torch_logits = quant_model(images).numpy()
    print(f"4 test images: onnxruntime predicts {ort_logits.argmax(1).tolist()}, "
          f"PyTorch {torch_logits.argmax(1).tolist()}, max |difference| {np.abs(ort_logits - torch_logits).max():.2e}")

    # Accuracy of the file on the whole test set, next to the PyTorch models'.
    ort_accuracy = evaluate_predictions(lambda x: session.run(None, {input_name: x})[0], data.test)
    print(f"accuracy: float {evaluate(float_model, data.test):.2f} %, quantized PyTorch "
          f"{evaluate(quant_model, data.test):.2f} %, quantized onnxruntime {ort_accuracy:.2f} %")
