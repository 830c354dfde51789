"""quark_brevitas: Quark's Brevitas-flavoured quantization API for PyTorch, executed by Brevitas.

Describe *what* to quantize with :class:`Config` / :class:`QLayerConfig` / :class:`QTensorConfig`,
then ``ModelQuantizer(config).quantize_model(model, calib_loader)`` and
``ModelExporter(path).export_onnx_model(quant_model, example_input)``.
"""

import warnings

# Brevitas announces on import that an optional CUDA kernel package is missing; it is irrelevant on
# CPU and would otherwise greet every user of the library and its command line.
warnings.filterwarnings("ignore", message="fast_hadamard_transform package not found")

from quark_brevitas import algos, types
from quark_brevitas.api import ModelExporter, ModelQuantizer
from quark_brevitas.backend import DEFAULT_LAYER_MAP, LayerMapping, LayerwiseBackend
from quark_brevitas.config import (
    Backend,
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    QuantType,
    verify_config,
)
from quark_brevitas.container import Container
from quark_brevitas.errors import (
    CalibrationDataError,
    ConfigError,
    ModelError,
    QuarkBrevitasError,
    UnsupportedAlgorithmError,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LAYER_MAP",
    "Backend",
    "CalibrationDataError",
    "Config",
    "ConfigError",
    "Container",
    "LayerMapping",
    "LayerwiseBackend",
    "ModelError",
    "ModelExporter",
    "ModelQuantizer",
    "ParamType",
    "QLayerConfig",
    "QTensorConfig",
    "QuantType",
    "QuantizationConfig",
    "QuantizationSpec",
    "QuarkBrevitasError",
    "UnsupportedAlgorithmError",
    "algos",
    "types",
    "verify_config",
]
