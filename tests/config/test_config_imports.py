"""The config package is plain data: loading and verifying a config file imports neither torch nor Brevitas,
and the package's public names still import (lazily) from ``quark_brevitas``.

The import checks run in a fresh interpreter (``subprocess``): this test process has long imported torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import quark_brevitas
from quark_brevitas.config import QTensorConfig, verify_config
from quark_brevitas.config.checks import SUPPORTED_QUANTIZERS, verify_spec
from quark_brevitas.config.enums import ScaleType
from quark_brevitas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "configs" / "w4a8_gptq.yaml"


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter from the repository root; it prints one JSON line."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_and_verifying_a_yaml_config_imports_neither_torch_nor_brevitas() -> None:
    result = _run(f"""
import json, sys, time
start = time.perf_counter()
import quark_brevitas.config as config
loaded = config.Config.from_yaml(open({str(EXAMPLE)!r}).read())
config.verify_config(loaded)
seconds = time.perf_counter() - start
print(json.dumps({{"torch": "torch" in sys.modules, "brevitas": "brevitas" in sys.modules, "seconds": seconds,
                   "weight": loaded.global_quant_config.weight.short(),
                   "algos": [type(a).__name__ for a in loaded.algo_config],
                   "file": config.__file__}}))
""")
    assert result["file"].startswith(str(ROOT / "quark_brevitas" / "config")), result["file"]
    assert result["weight"] == "int4 per_channel sym stats" and result["algos"] == ["GPTQ"]
    assert result["torch"] is False and result["brevitas"] is False
    assert result["seconds"] < 1.0


def test_quark_import_paths_load_without_torch() -> None:
    """``quark_brevitas.types`` / ``.algos`` (Quark's module names) are re-exports of the config package."""
    result = _run("""
import json, sys
from quark_brevitas import algos, types
from quark_brevitas.config import algorithms, enums
print(json.dumps({"same": algos.GPTQ is algorithms.GPTQ and types.Dtype is enums.Dtype,
                  "torch": "torch" in sys.modules}))
""")
    assert result == {"same": True, "torch": False}


@pytest.mark.slow
def test_public_names_import_on_first_use() -> None:
    """``from quark_brevitas import ...`` gives every name of ``__all__``; Brevitas's startup warning stays
    filtered, since the filter is installed by the package before any module imports Brevitas."""
    result = _run("""
import json, sys, warnings
import quark_brevitas
before = "torch" in sys.modules
from quark_brevitas import *  # noqa: F403
from quark_brevitas import ModelQuantizer, Config, algos
filters = [str(f[1].pattern) for f in warnings.filters if f[1] is not None]
names = set(globals())
print(json.dumps({"before": before, "missing": [n for n in quark_brevitas.__all__ if n not in names],
                  "quantizer": ModelQuantizer.__module__, "config": Config.__module__,
                  "filtered": "fast_hadamard_transform package not found" in filters}))
""")
    assert result == {"before": False, "missing": [], "quantizer": "quark_brevitas.api",
                      "config": "quark_brevitas.config.model_config", "filtered": True}


def test_package_public_names_are_unchanged() -> None:
    assert quark_brevitas.__all__ == [
        "DEFAULT_LAYER_MAP", "Backend", "CalibrationDataError", "CheckpointError", "Config", "ConfigError",
        "Container", "IntegerWeight", "LLMTemplate", "LayerMapping", "LayerwiseBackend", "ModelError", "ModelExporter",
        "ModelQuantizer", "ParamType", "QATConfig", "QConfig", "QLayerConfig", "QTensorConfig", "QuantType",
        "QuantizationConfig", "QuantizationSpec", "QuarkBrevitasError", "UnsupportedAlgorithmError", "algos",
        "export_gguf", "export_onnx", "export_safetensors", "import_model_from_safetensors",  # Quark 0.13's functions
        "integer_weights", "prepare_qat", "load_params", "load_quantized", "save_integer_weights", "save_params",
        "save_quantized", "types", "verify_config",
    ]
    assert quark_brevitas.Config is quark_brevitas.config.Config
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        _ = quark_brevitas.NotAName


def test_supported_combinations_are_the_translation_tables_rows() -> None:
    """The torch-free statement of what Brevitas can honour equals the table that builds the injectors."""
    from quark_brevitas.quantizers import table_keys

    assert table_keys() == SUPPORTED_QUANTIZERS and len(SUPPORTED_QUANTIZERS) == 36


def test_spec_check_without_brevitas_names_the_field() -> None:
    """The config-time checks (no Brevitas) name the field and what is allowed."""
    with pytest.raises(ConfigError, match=r"^x\.scale_type: bfloat16 is not supported; allowed: float, pof2, "
                                          r"pof2_round, float16, gguf_k, gguf_0$"):
        verify_spec(QTensorConfig(scale_type=ScaleType.bfloat16), "weight", "x")
    with pytest.raises(ConfigError, match=r"^b\.bit_width: bias bit width 12 unsupported; allowed: \[8, 16, 24, 32\]$"):
        verify_spec(QTensorConfig(bit_width=12), "bias", "b")
    with pytest.raises(ConfigError, match="^x: must be a QuantizationSpec \\(QTensorConfig\\) or None, got dict$"):
        verify_spec({}, "weight", "x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected a quark_brevitas Config, got dict"):
        verify_config({})  # type: ignore[arg-type]
