"""FINN's own front end (ConvertQONNXtoFINN + Streamline) on the graph backend's QONNX files.

FINN is not on PyPI: the test runs where a FINN front-end source is given, ``FINN_SRC`` (a directory with FINN's
``setup.sh`` and ``finn_check.py``, as ``../shared/finn`` next to the repository in CI) and is skipped with the reason
elsewhere. ``setup.sh`` unpacks FINN and the qonnx it pins into a virtualenv of their own (``FINN_FRONTEND`` or its
default cache folder); ``finn_check.py`` converts and streamlines the file as FINN's builder does and prints the
difference to the file's own execution and the MatMul/Conv nodes left with a non-integer input.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import export_qonnx

ROOT = Path(__file__).resolve().parents[2]


def finn_source() -> Path | None:
    """The FINN front-end folder: ``FINN_SRC``, else ``../shared/finn`` beside the repository."""
    for candidate in (os.environ.get("FINN_SRC"), ROOT.parent / "shared" / "finn"):
        if candidate and (Path(candidate) / "finn_check.py").is_file() and (Path(candidate) / "setup.sh").is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def finn() -> tuple[Path, dict[str, str]]:
    source = finn_source()
    if source is None:
        pytest.skip("no FINN front end: set FINN_SRC to a folder with FINN's setup.sh and finn_check.py "
                    "(../shared/finn in CI)")
    args = ["bash", str(source / "setup.sh")] + ([os.environ["FINN_FRONTEND"]] if "FINN_FRONTEND" in os.environ
                                                  else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=True)
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return source, found


def run_finn(finn: tuple[Path, dict[str, str]], onnx_path: Path, inputs: np.ndarray) -> dict:
    source, env = finn
    np.save(onnx_path.with_suffix(".npy"), inputs)
    done = subprocess.run([env["FINN_PY"], str(source / "finn_check.py"), str(onnx_path),
                           str(onnx_path.with_suffix(".npy"))], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": env["FINN_PATH"], "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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
