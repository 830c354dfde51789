"""quark_brevitas: Quark's Brevitas-flavoured quantization API for PyTorch, executed by Brevitas.

Describe *what* to quantize with :class:`Config` (alias ``QConfig``, Quark 0.11+'s name) /
:class:`QLayerConfig` / :class:`QTensorConfig`,
then ``ModelQuantizer(config).quantize_model(model, calib_loader)`` and
``ModelExporter(path).export_onnx_model(quant_model, example_input)`` (or ``export_qonnx_model``).
``save_quantized(quant_model, directory)`` / ``load_quantized(float_model, directory)`` store and
rebuild quantized models without calibration data; ``integer_weights(quant_model)`` gives the integer
weights, scales and zero points.

The public names are imported on first use (PEP 562 ``__getattr__``): importing the package, or a
module of it such as :mod:`quark_brevitas.config` (plain data), does not import torch or Brevitas until
a name that needs them is used. ``from quark_brevitas import ModelQuantizer`` works as before.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from quark_brevitas.version import __version__ as __version__

# Brevitas announces on import that an optional CUDA kernel package is missing; it is irrelevant on
# CPU and would otherwise greet every user of the library and its command line. Installed here, before
# any module of the package runs (each of them imports this package first), so it precedes every import
# of Brevitas, whichever module does it.
warnings.filterwarnings("ignore", message="fast_hadamard_transform package not found")

#: Each public name -> the module that defines it (a module's own name: the submodule itself).
_PUBLIC: dict[str, str] = {
    "DEFAULT_LAYER_MAP": "backend",
    "Backend": "config",
    "CalibrationDataError": "errors",
    "CheckpointError": "checkpoint",
    "Config": "config",
    "ConfigError": "errors",
    "Container": "container",
    "IntegerWeight": "export.intweights",
    "LLMTemplate": "config",
    "LayerMapping": "backend",
    "LayerwiseBackend": "backend",
    "ModelError": "errors",
    "ModelExporter": "api",
    "ModelQuantizer": "api",
    "ParamType": "config",
    "QATConfig": "qat",
    "QConfig": "config",
    "QLayerConfig": "config",
    "QTensorConfig": "config",
    "QuantType": "config",
    "QuantizationConfig": "config",
    "QuantizationSpec": "config",
    "QuarkBrevitasError": "errors",
    "UnsupportedAlgorithmError": "errors",
    "algos": "algos",
    "export_gguf": "quark_compat",
    "export_onnx": "quark_compat",
    "export_safetensors": "quark_compat",
    "import_model_from_safetensors": "quark_compat",
    "integer_weights": "export.intweights",
    "prepare_qat": "qat",
    "load_params": "quark_compat",
    "load_quantized": "checkpoint",
    "save_integer_weights": "export.intweights",
    "save_params": "quark_compat",
    "save_quantized": "checkpoint",
    "types": "types",
    "verify_config": "config",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first use, and keep the value as a module attribute."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_PUBLIC[name]}")
    value = module if _PUBLIC[name] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
