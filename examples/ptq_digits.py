"""Post-training quantization of a small CNN with Quark's Brevitas-flavoured API.

The script trains the built-in digits CNN (scikit-learn's 8x8 digits, a few seconds on CPU),
quantizes it to int4 per-channel weights / int8 inputs / int32 biases with Preprocess (BatchNorm
merge + graph equalization) and GPTQ, compares accuracies and exports a verified ONNX QCDQ file.

Code written for ``quark.torch.extensions.brevitas`` only needs its imports changed::

    from quark.torch.extensions.brevitas.api import ModelQuantizer, ModelExporter      # Quark
    from quark_brevitas import ModelQuantizer, ModelExporter                           # here

Run: ``python examples/ptq_digits.py`` (offline, < 1 minute).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.algos import GPTQ, Preprocess
from quark_brevitas.cli.digits import evaluate, example_input, load_digits_data, train_digits_cnn
from quark_brevitas.types import QSchemeType

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
torch.set_num_threads(1)  # the model is tiny; extra threads only add overhead

# 1. A trained float model and its data: (images, target) batches, as Quark's examples use.
data = load_digits_data()
float_model = train_digits_cnn(data)


# 2. Describe the quantization. QTensorConfig = one tensor, QLayerConfig = one layer's tensors.
def w_a8_config(weight_bits: int, gptq: bool) -> Config:
    weight = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=weight_bits)  # one scale per out channel
    activation = QTensorConfig(qscheme=QSchemeType.per_tensor, bit_width=8)  # int8, scale from calibration
    bias = QTensorConfig(bit_width=32)  # int32, scale = input scale x weight scale
    return Config(
        global_quant_config=QLayerConfig(weight=weight, input_tensors=activation, bias=bias),
        pre_quant_opt_config=[Preprocess()],  # BatchNorm merge + weight equalization, before quantizing
        algo_config=[GPTQ()] if gptq else [],  # after calibration: round weights to compensate the error
    )


# 3. Quantize (the float model is copied, not modified). The calibration loader may be a DataLoader
#    or a plain list of batches; GPTQ iterates it once per layer. GPTQ matters most at very low bit
#    widths, so 2-bit weights are tried too, with and without it.
print(f"{'float':<22} {evaluate(float_model, data.test):6.2f} %")
quantized = {}
for bits in (4, 2):
    for gptq in (False, True):
        model = ModelQuantizer(w_a8_config(bits, gptq)).quantize_model(float_model, data.calib)
        quantized[bits, gptq] = model
        label = f"w{bits}a8 {'+ GPTQ' if gptq else 'round-to-nearest'}"
        print(f"{label:<22} {evaluate(model, data.test):6.2f} %")

# 4. Export to ONNX QCDQ. The exporter runs the file in onnxruntime and checks it against PyTorch
#    (it raises ExportMismatchError if they differ by more than one quantization step).
with tempfile.TemporaryDirectory() as tmp:
    report = ModelExporter(Path(tmp) / "digits_w4a8.onnx").export_onnx_model(quantized[4, True], example_input(data))
    print(f"exported {report.path.name}: opset {report.opset}, {report.file_size} bytes, "
          f"max |onnxruntime - PyTorch| = {report.max_abs_diff:.2e} <= tolerance {report.tolerance:.2e}")
