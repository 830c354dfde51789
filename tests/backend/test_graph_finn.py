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
import torch
from helpers.finn import run_finn
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.backend.graph import finn_config
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import export_qonnx


def seeded(name: str, seed: int = 0) -> torch.nn.Module:
    """Zoo model ``name`` with seeded random weights (and BatchNorm statistics), leaving the global RNG as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return randomised(GRAPH_ZOO[name](), seed)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("name", sorted(GRAPH_ZOO))
def test_finn_converts_zoo_exactly_with_integer_compute(finn, name: str, bits: int, tmp_path) -> None:
    """The ``finn_w*a*`` preset as is (float output): FINN's converted and streamlined model computes the file's
    values bit for bit (power-of-two scales make the file's arithmetic exact, ties round up in both), so the
    arg-max is the same on every input, exact ties of the output included, and every MatMul/Conv input is
    integer."""
    x = input_batch(32)
    quant = ModelQuantizer(get_preset(f"finn_w{bits}a{bits}")).quantize_model(seeded(name), [x[:16], x[16:]])
    export_qonnx(quant, x[:1], tmp_path / "m.onnx")
    result = run_finn(finn, tmp_path / "m.onnx", x.numpy())
    assert "error" not in result, result
    assert result["diff_streamline"] == 0.0, result
    assert result["argmax_agree"] == 1.0, result
    assert result["float_compute_inputs"] == [], result


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("name", sorted(GRAPH_ZOO))
def test_finn_quantized_output_gives_identical_codes_and_argmax(finn, name: str, bits: int, tmp_path) -> None:
    """The preset with the model's output quantized (``finn_config(bits, model, output_bits=8)``): both files
    produce values on one grid, so the arg-max (first of equal values) is identical on every input, ties
    included. A difference of one output step would be at least 1/128 of the output's magnitude, so the 1e-4
    bound means identical codes."""
    x = input_batch(32)
    model = seeded(name)
    quant = ModelQuantizer(finn_config(bits, model, output_bits=8)).quantize_model(model, [x[:16], x[16:]])
    export_qonnx(quant, x[:1], tmp_path / "m.onnx")
    result = run_finn(finn, tmp_path / "m.onnx", x.numpy())
    assert "error" not in result, result
    assert result["rel_streamline"] <= 1e-4, result
    assert result["float_compute_inputs"] == [], result
    assert result["argmax_agree"] == 1.0, result
