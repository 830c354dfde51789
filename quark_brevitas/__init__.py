"""quark_brevitas: Quark's Brevitas-flavoured quantization API for PyTorch, executed by Brevitas.

Describe *what* to quantize with :class:`Config` / :class:`QLayerConfig` / :class:`QTensorConfig`,
then ``ModelQuantizer(config).quantize_model(model, calib_loader)`` and
``ModelExporter(path).export_onnx_model(quant_model, example_input)`` (or ``export_qonnx_model``).
``save_quantized(quant_model, directory)`` / ``load_quantized(float_model, directory)`` store and
rebuild quantized models without calibration data; ``integer_weights(quant_model)`` gives the integer
weights, scales and zero points.
"""

import warnings

# Brevitas announces on import that an optional CUDA kernel package is missing; it is irrelevant on
# CPU and would otherwise greet every user of the library and its command line.
warnings.filterwarnings("ignore", message="fast_hadamard_transform package not found")

from quark_brevitas import algos, types
from quark_brevitas.api import ModelExporter, ModelQuantizer
from quark_brevitas.backend import DEFAULT_LAYER_MAP, LayerMapping, LayerwiseBackend
from quark_brevitas.checkpoint import CheckpointError, load_quantized, save_quantized
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
from quark_brevitas.intweights import IntegerWeight, integer_weights, save_integer_weights
from quark_brevitas.qat import QATConfig, prepare_qat
from quark_brevitas.version import __version__ as __version__

__all__ = [
    "DEFAULT_LAYER_MAP",
    "Backend",
    "CalibrationDataError",
    "CheckpointError",
    "Config",
    "ConfigError",
    "Container",
    "IntegerWeight",
    "LayerMapping",
    "LayerwiseBackend",
    "ModelError",
    "ModelExporter",
    "ModelQuantizer",
    "ParamType",
    "QATConfig",
    "QLayerConfig",
    "QTensorConfig",
    "QuantType",
    "QuantizationConfig",
    "QuantizationSpec",
    "QuarkBrevitasError",
    "UnsupportedAlgorithmError",
    "algos",
    "integer_weights",
    "prepare_qat",
    "load_quantized",
    "save_integer_weights",
    "save_quantized",
    "types",
    "verify_config",
]
