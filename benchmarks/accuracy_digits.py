"""Accuracy and time of each spec family and algorithm on the digits CNN, printed as a table.

Run: ``python -m benchmarks.accuracy_digits``. Targets (issue 2): W8A8 and W4 per-channel A8 lose
less than 1 accuracy point against the float model.
"""

from __future__ import annotations

import time

import torch

from benchmarks.tables import format_table
from quark_brevitas import Config, ModelQuantizer, ParamType, QLayerConfig, QTensorConfig, QuantType, algos
from quark_brevitas.cli.digits import evaluate, load_digits_data, train_digits_cnn
from quark_brevitas.types import QSchemeType, ScaleType

A8 = QTensorConfig()
B32 = QTensorConfig(bit_width=32)
FP8 = QTensorConfig(quant_type=QuantType.float_quant, exponent_bit_width=4, mantissa_bit_width=3)
W4PC = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel)
W3PC = QTensorConfig(bit_width=3, qscheme=QSchemeType.per_channel)

CASES: list[tuple[str, QLayerConfig, list]] = [
    ("W8A8 (target: < 1 pt loss)", QLayerConfig(weight=QTensorConfig(), input_tensors=A8, bias=B32), []),
    ("W4 per-channel A8 (target: < 1 pt loss)", QLayerConfig(weight=W4PC, input_tensors=A8, bias=B32), []),
    ("W8A8 per-channel MSE", QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel,
                                                                param_type=ParamType.mse), input_tensors=A8), []),
    ("W8A8 asymmetric", QLayerConfig(weight=QTensorConfig(symmetric=False),
                                     input_tensors=QTensorConfig(symmetric=False)), []),
    ("W8A8 power-of-two scales", QLayerConfig(weight=QTensorConfig(scale_type=ScaleType.pof2),
                                              input_tensors=QTensorConfig(scale_type=ScaleType.pof2)), []),
    ("FP8 e4m3 W+A", QLayerConfig(weight=FP8, input_tensors=FP8), []),
    ("W3 per-channel A8", QLayerConfig(weight=W3PC, input_tensors=A8), []),
    ("W3 per-channel A8 + GPTQ", QLayerConfig(weight=W3PC, input_tensors=A8), [algos.GPTQ()]),
    ("W3 per-channel A8 + GPFQ", QLayerConfig(weight=W3PC, input_tensors=A8), [algos.GPFQ()]),
    ("W3 per-channel A8 + BiasCorrection", QLayerConfig(weight=W3PC, input_tensors=A8), [algos.BiasCorrection()]),
]


def main() -> None:
    data = load_digits_data()
    model = train_digits_cnn(data)
    inputs = torch.cat([x for x, _ in data.test])
    with torch.no_grad():
        reference = model(inputs)
    float_acc = evaluate(model, data.test)
    rows = [("float", f"{float_acc:.2f}", "-", "-", "-")]
    for name, layer, post in CASES:
        start = time.perf_counter()
        quant = ModelQuantizer(Config(global_quant_config=layer, algo_config=post)).quantize_model(model, data.calib)
        seconds = time.perf_counter() - start
        acc = evaluate(quant, data.test)
        with torch.no_grad():
            mse = float(((quant(inputs) - reference) ** 2).mean())
        rows.append((name, f"{acc:.2f}", f"{acc - float_acc:+.2f}", f"{mse:.4f}", f"{seconds:.1f}"))
    header = ("config", "accuracy %", "vs float", "logits MSE", "quantize s")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
