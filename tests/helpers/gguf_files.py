"""Comparing GGUF files tensor by tensor (streamed exports against whole-model ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def same_tensors(written_path: str | Path, expected_path: str | Path) -> dict[str, Any]:
    """Assert the two files hold the same tensors (names, GGUF types, bytes); returns the first file's tensors by
    name."""
    import gguf

    written = {t.name: t for t in gguf.GGUFReader(str(written_path)).tensors}
    expected = {t.name: t for t in gguf.GGUFReader(str(expected_path)).tensors}
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert written[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(written[name].data), np.asarray(tensor.data)), name
    return written
