"""FINN's front end (ConvertQONNXtoFINN + Streamline), run in a virtualenv of its own, for the graph backend tests.

FINN is not on PyPI: the tests run where a FINN front-end source is given, ``FINN_SRC`` (a directory with FINN's
``setup.sh`` and ``finn_check.py``, as ``../shared/finn`` next to the repository in CI) and are skipped with the
reason elsewhere. The ``finn`` fixture of ``tests/backend/conftest.py`` sets it up once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What :func:`setup_finn` returns: the front-end folder and the variables ``setup.sh`` printed
#: (``FINN_PY``, ``FINN_PATH``).
FinnFrontEnd = tuple[Path, dict[str, str]]


def finn_source() -> Path | None:
    """The FINN front-end folder: ``FINN_SRC``, else ``../shared/finn`` beside the repository."""
    for candidate in (os.environ.get("FINN_SRC"), ROOT.parent / "shared" / "finn"):
        if candidate and (Path(candidate) / "finn_check.py").is_file() and (Path(candidate) / "setup.sh").is_file():
            return Path(candidate)
    return None


def setup_finn() -> FinnFrontEnd:
    """Unpack FINN and the qonnx it pins (``setup.sh``, into ``FINN_FRONTEND`` or its default cache folder);
    skips the calling test with the reason where no front end is given."""
    source = finn_source()
    if source is None:
        pytest.skip("no FINN front end: set FINN_SRC to a folder with FINN's setup.sh and finn_check.py "
                    "(../shared/finn in CI)")
    args = ["bash", str(source / "setup.sh")] + ([os.environ["FINN_FRONTEND"]] if "FINN_FRONTEND" in os.environ
                                                  else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=True)
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return source, found


def run_finn(finn: FinnFrontEnd, onnx_path: Path, inputs: np.ndarray) -> dict:
    """``finn_check.py`` on ``onnx_path``: converts and streamlines the file as FINN's builder does and reports the
    difference to the file's own execution on ``inputs`` and the MatMul/Conv nodes left with a non-integer input."""
    source, env = finn
    np.save(onnx_path.with_suffix(".npy"), inputs)
    done = subprocess.run([env["FINN_PY"], str(source / "finn_check.py"), str(onnx_path),
                           str(onnx_path.with_suffix(".npy"))], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": env["FINN_PATH"], "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
