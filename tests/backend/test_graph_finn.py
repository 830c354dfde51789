"""FINN's own front end (ConvertQONNXtoFINN + Streamline) on the graph backend's QONNX files.

FINN is not on PyPI: the test runs where a FINN front-end source is given, ``FINN_SRC`` (a directory with FINN's
``setup.sh`` and ``finn_check.py``, as ``../shared/finn`` next to the repository in CI) and is skipped with the reason
elsewhere. ``setup.sh`` unpacks FINN and the qonnx it pins into a virtualenv of their own (``FINN_FRONTEND`` or its
default cache folder), once per module (the ``finn`` fixture of ``conftest.py``); ``finn_check.py``
(``helpers.finn.run_finn``) converts and streamlines the file as FINN's builder does and prints the difference to
the file's own execution and the MatMul/Conv nodes left with a non-integer input.
"""

from __future__ import annotations

import pytest
from helpers.finn import run_finn
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import export_qonnx


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("name", sorted(GRAPH_ZOO))
def test_finn_converts_zoo_exactly_with_integer_compute(finn, name: str, bits: int, tmp_path) -> None:
    x = input_batch(32)
    quant = ModelQuantizer(get_preset(f"finn_w{bits}a{bits}")).quantize_model(randomised(GRAPH_ZOO[name]()),
                                                                                [x[:16], x[16:]])
    export_qonnx(quant, x[:1], tmp_path / "m.onnx")
    result = run_finn(finn, tmp_path / "m.onnx", x.numpy())
    assert "error" not in result, result
    assert result["rel_streamline"] <= 1e-4, result
    assert result["float_compute_inputs"] == [], result
    if name != "encoder_decoder":  # a pixel map: equal values tie, and float rounding may pick another of them
        assert result["argmax_agree"] == 1.0, result
