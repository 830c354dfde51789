"""The configuration schema: Quark's Brevitas extension config (reference 003), as plain data.

``Config`` (alias ``QConfig``, Quark 0.11+'s name), ``QuantizationConfig`` (alias ``QLayerConfig``),
``QuantizationSpec`` (alias ``QTensorConfig``), ``QuantType``, ``ParamType`` and ``Backend`` have the names, fields and
defaults of ``quark.torch.extensions.brevitas.config``. ``Config`` also carries the hierarchy of Quark's
general PyTorch config (references 001 and 002): ``layer_type_quant_config``, ``layer_quant_config``
and ``exclude``, added after the Brevitas extension's fields so that positional construction keeps
working. How the levels combine for one module is decided in :mod:`quark_brevitas.resolve`. Quark's LLM
algorithm configs (reference 002: ``SmoothQuantConfig``, ``AWQConfig``, ``GPTQConfig``, which Quark keeps in
``quark.torch.quantization.config.config``) are re-exported here too.

The package imports neither torch nor Brevitas, so a config file loads and verifies in a fraction of a
second (``Config.from_file(path)`` verifies it). Its modules, from the bottom up:

- :mod:`.enums`: Quark's enums (reference 000 and the three of reference 003); ``quark_brevitas.types``;
- :mod:`.formats`: what each ``dtype`` short form means (``int4``, ``fp8_e4m3``, ``mx`` ...);
- :mod:`.serialization`: dicts, JSON and YAML from the dataclass annotations (generic);
- :mod:`.specs`: ``QuantizationSpec`` / ``QuantizationConfig`` and the ``dtype`` short form spelled out;
- :mod:`.algorithms`: the algorithm configs; ``quark_brevitas.algos``;
- :mod:`.rounding`: Quark 0.13's ``QronosConfig`` and ``AutoRoundConfig``;
- :mod:`.checks`: every check that needs neither the model nor Brevitas, naming the field at fault;
- :mod:`.model_config`: ``Config``, its files and :func:`verify_config`;
- :mod:`.schema`: the JSON Schema of config files (``python -m quark_brevitas.config.schema``);
- :mod:`.families`: the model families' layers (decoder paths, scaling groups, exclusions), one table;
- :mod:`.template`: Quark 0.13's ``LLMTemplate`` (a family's Config from a scheme and algorithm names).

Files carry ``format_version`` (:data:`FORMAT_VERSION`) as their first key; files without it are the
first format, which this release still reads. Checks that need the model (does a layer name exist? what
does a layer get once the levels are merged?) run in :mod:`quark_brevitas.resolve`; the Brevitas injectors
are built by :mod:`quark_brevitas.quantizers` when the model is planned.
"""

from __future__ import annotations

from quark_brevitas.config.algorithms import AWQConfig, GPTQConfig, SmoothQuantConfig
from quark_brevitas.config.checks import HIERARCHY_LEVELS, verify_layer_config, verify_partial_layer_config
from quark_brevitas.config.enums import (
    Backend,
    DeviceType,
    Dtype,
    ParamType,
    QSchemeType,
    QuantType,
    RoundType,
    ScaleType,
    ZeroPointType,
)
from quark_brevitas.config.formats import DTYPE_FIELDS, MX_BLOCK_SIZE, MX_ELEMENT_DTYPES, REJECTED_DTYPES
from quark_brevitas.config.model_config import (
    CONFIG_KEYS,
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    Config,
    LayerName,
    LayerTypeName,
    PostQuantAlgorithm,
    PreQuantAlgorithm,
    QConfig,
    layer_type_key,
    type_name,
    verify_config,
)
from quark_brevitas.config.rotation import RotationConfig
from quark_brevitas.config.rounding import AutoRoundConfig, QronosConfig
from quark_brevitas.config.serialization import did_you_mean, key_path
from quark_brevitas.config.specs import (
    TENSOR_ROLES,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    describe,
    resolve_dtype,
)
from quark_brevitas.config.template import LLMTemplate
from quark_brevitas.errors import ConfigError

__all__ = [
    "CONFIG_KEYS",
    "DTYPE_FIELDS",
    "FORMAT_VERSION",
    "HIERARCHY_LEVELS",
    "MX_BLOCK_SIZE",
    "MX_ELEMENT_DTYPES",
    "READABLE_FORMAT_VERSIONS",
    "REJECTED_DTYPES",
    "TENSOR_ROLES",
    "AWQConfig",
    "AutoRoundConfig",
    "Backend",
    "Config",
    "ConfigError",
    "DeviceType",
    "Dtype",
    "GPTQConfig",
    "QronosConfig",
    "LLMTemplate",
    "LayerName",
    "LayerTypeName",
    "ParamType",
    "PostQuantAlgorithm",
    "PreQuantAlgorithm",
    "QConfig",
    "QLayerConfig",
    "QSchemeType",
    "QTensorConfig",
    "QuantType",
    "QuantizationConfig",
    "QuantizationSpec",
    "RoundType",
    "ScaleType",
    "RotationConfig",
    "SmoothQuantConfig",
    "ZeroPointType",
    "describe",
    "did_you_mean",
    "key_path",
    "layer_type_key",
    "resolve_dtype",
    "type_name",
    "verify_config",
    "verify_layer_config",
    "verify_partial_layer_config",
]
