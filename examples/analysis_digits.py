"""See where accuracy goes on the digits CNN: layer-by-layer error, sensitivity ranking, automatic mixed precision.

Run: ``python examples/analysis_digits.py [OUTPUT_DIR]`` (about 20 s; the plots need ``pip install
'quark_brevitas[plot]'``). Writes ``layers.{json,csv,png}``, ``sensitivity.{json,csv,png}`` and
``mixed_precision.yaml`` (run it with ``quark-brevitas quantize --config OUTPUT_DIR/mixed_precision.yaml``) into
OUTPUT_DIR, by default a new folder in the system's temporary directory (never the repository); the last line
says where.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from quark_brevitas import ModelQuantizer
from quark_brevitas.analysis import (
    CANDIDATES,
    auto_mixed_precision,
    compare_layers,
    layer_table,
    model_size,
    plot_layer_sqnr,
    plot_sensitivity,
    sensitivity,
    sensitivity_table,
    write_rows,
)
from quark_brevitas.cli.digits import evaluate, load_digits_data, train_digits_cnn
from quark_brevitas.config.presets import get_preset


def main(output: Path) -> None:
    data = load_digits_data()
    model = train_digits_cnn(data)
    config = get_preset("w4a8_gptq")

    # 1. Layer by layer: SQNR of each layer's weight, input and output, in the model and alone.
    quant = ModelQuantizer(config).quantize_model(model, data.calib)
    layers = compare_layers(model, quant, data.calib, max_batches=4)
    print(layer_table(layers), end="\n\n")
    write_rows(layers, output, "layers")
    plot_layer_sqnr(layers, output / "layers.png")

    # 2. Sensitivity: one layer quantized at a time, and all layers but one (cheap mode: quantized once).
    # Default metric: SQNR of the model's output; pass eval_fn=lambda m: my_accuracy(m) for your own.
    ranking = sensitivity(model, config, data.calib)
    print(sensitivity_table(ranking), end="\n\n")
    write_rows(ranking, output, "sensitivity")
    plot_sensitivity(ranking, output / "sensitivity.png")

    # 3. One format per layer under the average weight bits of uniform W4A8 per-channel (about 4.1).
    candidates = [CANDIDATES[name] for name in ("w8a8", "w4a8", "w3a8", "w2a8")]
    budget = model_size(model, get_preset("w4a8_gptq")).average_weight_bits
    mixed = auto_mixed_precision(model, candidates, data.calib, budget_bits=budget)
    (output / "mixed_precision.yaml").write_text(mixed.to_yaml())
    accuracy = evaluate(ModelQuantizer(mixed).quantize_model(model, data.calib), data.test)
    print(f"mixed precision: {model_size(model, mixed).average_weight_bits:.3f} average weight bits (budget "
          f"{budget:.3f}), test accuracy {accuracy:.2f} % (float {evaluate(model, data.test):.2f} %)")
    print(f"wrote {output}/")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="quark_brevitas_analysis_")))
