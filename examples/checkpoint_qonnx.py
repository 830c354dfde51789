"""Save a quantized model, rebuild it without data, export QONNX and extract integer weights.

``save_quantized`` writes the quantized state as safetensors plus the Config as JSON (no pickle);
``load_quantized`` rebuilds the quantized model from the float architecture alone -- no calibration
data -- with bit-identical outputs. ``ModelExporter(...).export_qonnx_model`` writes QONNX (the format
of FINN and hls4ml) and checks it by executing it with the qonnx package, and ``integer_weights``
gives each layer's integer weights, scale and zero point for C/FPGA flows.

Run: ``python examples/checkpoint_qonnx.py`` (offline, < 1 minute; needs the ``qonnx`` extra).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from quark_brevitas import (
    ModelExporter,
    ModelQuantizer,
    integer_weights,
    load_quantized,
    save_integer_weights,
    save_quantized,
)
from quark_brevitas.cli.digits import DigitsCNN, example_input, load_digits_data, train_digits_cnn
from quark_brevitas.config.presets import get_preset

torch.set_num_threads(1)  # the model is tiny; extra threads only add overhead

data = load_digits_data()
quant_model = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(train_digits_cnn(data), data.calib)
images = example_input(data, batch=64)

with tempfile.TemporaryDirectory() as tmp:
    # Save, then rebuild from an untrained copy of the architecture: the checkpoint holds every value.
    checkpoint = save_quantized(quant_model, Path(tmp) / "digits_w4a8", example_input=example_input(data))
    print("checkpoint files:", ", ".join(sorted(p.name for p in checkpoint.iterdir())))
    loaded = load_quantized(DigitsCNN(), checkpoint)
    with torch.no_grad():
        identical = torch.equal(loaded(images), quant_model(images))
    print(f"reloaded model bit-identical on {images.shape[0]} test images: {identical}")

    # QONNX, executed by the qonnx package and compared with PyTorch before the call returns.
    report = ModelExporter(Path(tmp) / "digits_w4a8_qonnx.onnx").export_qonnx_model(loaded, example_input(data))
    nodes = ", ".join(f"{op} x{count}" for op, count in report.quant_nodes.items())
    print(f"QONNX: {report.file_size} bytes, {nodes}; max |qonnx - PyTorch| = {report.max_abs_diff:.2e} "
          f"(tolerance {report.tolerance:.2e})")

    # Integer weights: (int_weight - zero_point) * scale is exactly the quantized weight.
    weights = integer_weights(loaded)
    for name, entry in weights.items():
        print(f"{name}: {entry.format} codes {tuple(entry.int_weight.shape)} in [{int(entry.int_weight.min())}, "
              f"{int(entry.int_weight.max())}], scale per {'tensor' if entry.axis is None else f'axis {entry.axis}'}")
    path = save_integer_weights(weights, Path(tmp) / "digits_w4a8_weights.npz", format="npz")
    print(f"integer weights written to {path.name} ({path.stat().st_size} bytes)")
