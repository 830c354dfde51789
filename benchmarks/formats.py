"""Accuracy of every number format at each bit width, on the digits CNN and a small transformer, and
the size of the exported ONNX file, printed as a table.

Run: ``python -m benchmarks.formats`` (about a minute on 2 cores). Both models are trained on the
scikit-learn digits (the transformer reads each 8x8 image as 8 tokens of 8 pixels). Weight formats are
applied to every Linear/Conv weight with the activations left in float (weight-only), then exported with
:func:`quark_brevitas.export.export_onnx_qcdq` (verified in onnxruntime; per-group, MX, fp6 and fp4 weights
as blocked ``DequantizeLinear``, opset 21); the last rows quantize activations too. ``-`` in a size column:
the format has no ONNX form onnxruntime runs (the reason is printed below the table).
"""

from __future__ import annotations

import logging
import pathlib
import re
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.models import EncoderLayer
from benchmarks.tables import format_table
from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.cli.digits import evaluate, example_input, fit, load_digits_data, train_digits_cnn
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export import export_onnx_qcdq
from quark_brevitas.types import Dtype, QSchemeType, RoundType

PC, PG = QSchemeType.per_channel, QSchemeType.per_group


def _int(bits: int, **kw) -> QTensorConfig:
    return QTensorConfig(bit_width=bits, **{"qscheme": PC, **kw})


def _mx(element: Dtype) -> QTensorConfig:
    return QTensorConfig(dtype=Dtype.mx, mx_element_dtype=element)


WEIGHT_FORMATS: list[tuple[str, int, QTensorConfig]] = [
    ("int per-channel", 8, _int(8)),
    ("int per-channel", 4, _int(4)),
    ("int per-channel", 3, _int(3)),
    ("int per-channel", 2, _int(2)),
    ("int per-group g32", 8, _int(8, qscheme=PG, group_size=32)),
    ("int per-group g32", 4, QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=32)),
    ("int per-group g128", 4, QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=128)),
    ("uint per-group g32", 4, QTensorConfig(dtype=Dtype.uint4, qscheme=PG, group_size=32)),
    ("int per-group g32", 3, _int(3, qscheme=PG, group_size=32)),
    ("int per-group g32", 2, _int(2, qscheme=PG, group_size=32)),
    ("int4 per-group g32, floor rounding", 4,
     QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=32, round_method=RoundType.floor)),
    ("MXINT8", 8, _mx(Dtype.int8)),
    ("MXFP8 e4m3", 8, _mx(Dtype.fp8_e4m3)),
    ("MXFP8 e5m2", 8, _mx(Dtype.fp8_e5m2)),
    ("MXFP6 e3m2", 6, _mx(Dtype.fp6_e3m2)),
    ("MXFP6 e2m3", 6, _mx(Dtype.fp6_e2m3)),
    ("MXFP4 e2m1", 4, _mx(Dtype.fp4)),
    ("fp8 e4m3 per-channel", 8, QTensorConfig(dtype=Dtype.fp8_e4m3, qscheme=PC)),
    ("fp8 e5m2 per-channel", 8, QTensorConfig(dtype=Dtype.fp8_e5m2, qscheme=PC)),
    ("fp6 e3m2 per-channel", 6, QTensorConfig(dtype=Dtype.fp6_e3m2, qscheme=PC)),
    ("fp6 e2m3 per-channel", 6, QTensorConfig(dtype=Dtype.fp6_e2m3, qscheme=PC)),
    ("fp4 e2m1 per-channel", 4, QTensorConfig(dtype=Dtype.fp4, qscheme=PC)),
    ("fp4 e2m1 per-group g32", 4, QTensorConfig(dtype=Dtype.fp4, qscheme=PG, group_size=32)),
]

A8 = QTensorConfig()
# Weights everywhere; activations at the inputs of Linear layers (per-token and MX activations need them).
ACTIVATION_FORMATS: list[tuple[str, int, QTensorConfig, QTensorConfig]] = [
    ("W4 g32 + A8 static", 4, QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=32), A8),
    ("MXINT8 + A8 static", 8, _mx(Dtype.int8), A8),
    ("W8 per-channel + A8 dynamic per-tensor", 8, _int(8), QTensorConfig(is_dynamic=True)),
    ("W8 per-channel + uint8 dynamic per-token", 8, _int(8), QTensorConfig(dtype=Dtype.uint8, is_dynamic=True,
                                                                          qscheme=PC)),
    ("MXFP8 W + A", 8, _mx(Dtype.fp8_e4m3), _mx(Dtype.fp8_e4m3)),
    ("MXINT8 W + A", 8, _mx(Dtype.int8), _mx(Dtype.int8)),
    ("MXFP6 e2m3 W + A", 6, _mx(Dtype.fp6_e2m3), _mx(Dtype.fp6_e2m3)),
    ("MXFP4 W + A", 4, _mx(Dtype.fp4), _mx(Dtype.fp4)),
]


# ------------------------------------------------------------------------------------------- the transformer


class DigitsTransformer(nn.Module):
    """8 tokens (image rows) of 8 pixels -> Linear embedding + positions -> 2 blocks -> mean -> classes."""

    def __init__(self, d_model: int = 64, heads: int = 4, ff: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.position = nn.Parameter(torch.zeros(1, 8, d_model))
        self.blocks = nn.Sequential(*[EncoderLayer(d_model, heads, ff) for _ in range(layers)])
        self.head = nn.Linear(d_model, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(images.reshape(images.shape[0], 8, 8)) + self.position
        return self.head(self.blocks(tokens).mean(dim=1))


def train_transformer(data) -> nn.Module:
    torch.manual_seed(0)
    model = DigitsTransformer()
    loader = DataLoader(data.train.dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    fit(model, loader, epochs=25, lr=2e-3, desc="train digits transformer")
    return model


# ------------------------------------------------------------------------------------------- measuring


def _measure(model: nn.Module, layer: QLayerConfig, data, out: pathlib.Path, name: str,
             notes: dict[str, str]) -> tuple[str, str]:
    """(accuracy, ONNX size) of ``model`` quantized with ``layer``; ``-`` and a note when it cannot be done."""
    layer, by_type = layer if isinstance(layer, tuple) else (layer, {})
    # The transformer's forward is not FX-traceable as Preprocess wants it: no pre-quantization steps.
    pre = [] if isinstance(model, DigitsTransformer) else Config(layer).pre_quant_opt_config
    config = Config(layer, pre_quant_opt_config=pre, layer_type_quant_config=by_type)
    try:
        quant = ModelQuantizer(config).quantize_model(model, data.calib)
    except QuarkBrevitasError as exc:
        notes[name] = str(exc).split(": ", 1)[-1]
        return "-", "-"
    accuracy = f"{evaluate(quant, data.test):.2f}"
    try:
        report = export_onnx_qcdq(quant, example_input(data), out / "m.onnx")
        size = f"{report.file_size / 1024:.1f}"
    except QuarkBrevitasError as exc:
        notes.setdefault(name, str(exc))
        size = "-"
    return accuracy, size


def main() -> None:
    logging.getLogger("quark_brevitas").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = load_digits_data()
    cnn, transformer = train_digits_cnn(data), train_transformer(data)
    notes: dict[str, str] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        sizes = []
        for model in (cnn, transformer):
            torch.onnx.export(model, (example_input(data),), str(out / "f.onnx"), dynamo=False,
                              input_names=["input"])
            sizes.append(f"{(out / 'f.onnx').stat().st_size / 1024:.1f}")
        rows.append(("float", "32", f"{evaluate(cnn, data.test):.2f}", sizes[0],
                     f"{evaluate(transformer, data.test):.2f}", sizes[1]))
        cases = [(name, bits, QLayerConfig(weight=spec)) for name, bits, spec in WEIGHT_FORMATS]
        cases += [(f"{name} (A: Linear inputs)", bits, (QLayerConfig(weight=weight), {"Linear": QLayerConfig(
            input_tensors=act)})) for name, bits, weight, act in ACTIVATION_FORMATS]
        for name, bits, layer in cases:
            cnn_acc, cnn_size = _measure(cnn, layer, data, out, f"{name} (CNN)", notes)
            tf_acc, tf_size = _measure(transformer, layer, data, out, f"{name} (transformer)", notes)
            rows.append((name, str(bits), cnn_acc, cnn_size, tf_acc, tf_size))
    header = ("format (weights, or weights + activations)", "bits", "CNN acc %", "CNN ONNX KiB",
              "transformer acc %", "transformer ONNX KiB")
    print(f"digits test split, {len(data.test.dataset)} images; ONNX sizes of the verified QCDQ export")
    print(format_table(header, rows))
    reasons: dict[str, list[str]] = {}
    for name, note in notes.items():
        reason = re.sub(r" \((act|weight) quantizer '[^']*' \(\w+\)\)", "", note).split(". ")[0]
        reasons.setdefault(reason, []).append(name)
    for reason, names in reasons.items():
        print(f"\n- {reason}:\n    " + "\n    ".join(names))
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
