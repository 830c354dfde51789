"""PTQ vs QAT vs float on the digits CNN at low bit widths, printed as a table.

Run: ``python -m benchmarks.qat_digits`` (about a minute). Target (issue 6): where PTQ loses more
than 5 points, a few epochs of QAT recover to within 1.5 points of the float model.
"""

from __future__ import annotations

import copy
import time

from benchmarks.tables import format_table
from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.cli.digits import evaluate, fine_tune, load_digits_data, train_digits_cnn
from quark_brevitas.qat import QATConfig, prepare_qat
from quark_brevitas.types import QSchemeType, ScaleType, TQTThresholdInitMeth

EPOCHS = 6


def layer(w_bits: int, a_bits: int, scale_type: ScaleType = ScaleType.float) -> QLayerConfig:
    return QLayerConfig(weight=QTensorConfig(bit_width=w_bits, qscheme=QSchemeType.per_channel, scale_type=scale_type),
                        input_tensors=QTensorConfig(bit_width=a_bits, scale_type=scale_type))


CASES = [
    ("W2A8, learned float scales", layer(2, 8), QATConfig()),
    ("W2A4, learned float scales", layer(2, 4), QATConfig()),
    ("W3A3, learned float scales", layer(3, 3), QATConfig()),
    ("W2A4, fixed float scales", layer(2, 4), QATConfig(learn_scales=False)),
    ("W4A4 TQT, calibrated init", layer(4, 4, ScaleType.pof2), QATConfig()),
    ("W4A4 TQT, _3SD init", layer(4, 4, ScaleType.pof2), QATConfig(threshold_init=TQTThresholdInitMeth._3SD)),
    ("W4A4 TQT, _LL_J init", layer(4, 4, ScaleType.pof2), QATConfig(threshold_init=TQTThresholdInitMeth._LL_J)),
    ("W2A4 TQT, calibrated init", layer(2, 4, ScaleType.pof2), QATConfig()),
]


def main() -> None:
    data = load_digits_data()
    float_model = train_digits_cnn(data)
    float_acc = evaluate(float_model, data.test)
    rows = [("float", f"{float_acc:.2f}", f"{float_acc:.2f}", "-", "-", "-")]
    for name, layer_config, qat_config in CASES:
        model = ModelQuantizer(Config(global_quant_config=layer_config)).quantize_model(float_model, data.calib)
        ptq = evaluate(model, data.test)
        start = time.perf_counter()
        prepare_qat(model, copy.deepcopy(qat_config), data.calib)
        fine_tune(model, data, epochs=EPOCHS, lr=3e-3)
        qat = evaluate(model, data.test)
        rows.append((name, f"{ptq:.2f}", f"{qat:.2f}", f"{ptq - float_acc:+.2f}", f"{qat - float_acc:+.2f}",
                     f"{time.perf_counter() - start:.1f}"))
    header = ("config", "PTQ %", "QAT %", "PTQ vs float", "QAT vs float", f"QAT s ({EPOCHS} ep)")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
