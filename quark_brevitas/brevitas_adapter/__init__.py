"""The one door to Brevitas internals.

quark_brevitas builds on Brevitas's public classes (quantized layers, quantizer injectors, graph
algorithms), but some things it needs are Brevitas internals: global flags, private tracing,
attributes of quantizer proxies and quant tensors, the export managers' handler lists, quantizers
that ship in ``brevitas_examples``. Every such use lives in this package, behind a small function with
a docstring that says why it is needed; the rest of the package imports these functions from here
(``from quark_brevitas.brevitas_adapter import ...``), never from the submodules, so the layout below
can change without touching callers. Each internal relied on has one canary test
(``tests/test_adapter_<submodule>.py``) that fails with a clear message if a Brevitas release changes it.

Submodules, one concept each:

- :mod:`.version`: the supported Brevitas range (checked once, at import) and FX tracing;
- :mod:`.introspection`: the quantizer walk and questions about proxies and quant tensors;
- :mod:`.grids`: scales, their initialisation state, and integer weight grids;
- :mod:`.candidate_grids`: many candidate weights of one layer on their own grids, without a quantizer call each;
- :mod:`.modes`: global flags, calibration / algorithm contexts, export-mode clean-up;
- :mod:`.structure`: equalized wrappers and parameter identity of replaced layers;
- :mod:`.distributed`: sharded calibration data and combining statistics across processes;
- :mod:`.plain_layers`: switched-off quantized Linear layers run as torch's ``linear``;
- :mod:`.precision`: float32 quantizers for half-precision models;
- :mod:`.mse`: sampled MSE calibration of activation quantizers;
- :mod:`.rotation`: Hadamard rotations from Brevitas's blocks and the online rotation module;
- :mod:`.reciprocal`: dynamic int8 per-group codes as onnxruntime's MLAS computes them (``x * (127 / max|x|)``).
"""

import warnings

# Brevitas announces on import that an optional CUDA kernel package is missing; it is irrelevant on CPU and
# would otherwise greet every user of the library. Installed here, before the first Brevitas import, so it
# holds however the package is first reached (the top-level package may import this module lazily).
warnings.filterwarnings("ignore", message="fast_hadamard_transform package not found")

# Brevitas's own modules import each other in a cycle that only resolves when ``brevitas.graph`` comes first:
# importing ``brevitas.nn.equalized_layer`` (introspection, structure) before it fails inside Brevitas with
# "cannot import name 'EqualizedModule' from partially initialized module".
import brevitas.graph  # noqa: E402, F401, I001 - the first Brevitas import, see above

from quark_brevitas.brevitas_adapter.version import (  # noqa: E402 - after the warnings filter
    SUPPORTED_BREVITAS,
    brevitas_version,
    check_supported_version,
    is_graph_module,
    symbolic_trace,
)

# Before the other submodules reach into Brevitas: an unsupported release fails here with an install command,
# not with an ImportError of some internal.
check_supported_version()

from quark_brevitas.brevitas_adapter.cache import (  # noqa: E402
    gptq_class_checking_once,
    weight_cache_budget,
    weights_quantized_once,
)
from quark_brevitas.brevitas_adapter.candidate_grids import candidate_quantizer  # noqa: E402
from quark_brevitas.brevitas_adapter.distributed import (  # noqa: E402
    Reducer,
    Shard,
    all_reduce_statistics,
    barrier,
    current_shard,
    equalization_statistics,
    gpxq_optimizers,
    require_equal_shares,
    runtime_stats_modules,
)
from quark_brevitas.brevitas_adapter.grids import (  # noqa: E402
    IntWeightFormat,
    WeightGrid,
    init_weight_scales,
    int_weight_format,
    int_weight_formats_remembered,
    mark_scale_initialised,
    restart_activation_statistics,
    scale_impl,
    scale_parameters,
    weight_grid,
)
from quark_brevitas.brevitas_adapter.introspection import (  # noqa: E402
    FLOAT8_DTYPES,
    EqualizedModule,
    QuantActivation,
    QuantizerSite,
    QuantLayer,
    StopFwdException,
    float8_dtype,
    fused_activation,
    generative_quantizers,
    groupwise_parts,
    has_static_activation_quantizers,
    injector_value,
    input_quantizer,
    is_dynamic_activation,
    is_float_quantizer,
    is_groupwise,
    iter_quantizers,
    plain_tensor,
    quantized_units,
    quantizer_kind,
    quantizer_names,
    weight_quant_disabled,
    weight_quantization_pairs,
)
from quark_brevitas.brevitas_adapter.kquant_minimum import (  # noqa: E402
    KQUANT_MINIMUM_LETS,
    offset_of,
    uses_offset_dequantization,
)
from quark_brevitas.brevitas_adapter.memo import (  # noqa: E402
    LAYER_OUTPUT_BUDGET,
    Handoff,
    LayerOutputs,
    discard_handed_over_outputs,
    layer_output_budget,
    layer_outputs_remembered,
    outputs_handed_over,
)
from quark_brevitas.brevitas_adapter.modes import (  # noqa: E402
    a2gpfq_available,
    a2gpfq_mode,
    activation_equalization_mode,
    bias_correction_mode,
    calibration_mode,
    export_handler_proxy_types,
    full_state_dict,
    gpfq_mode,
    gptq_mode,
    gpxq_update,
    ignore_missing_keys,
    load_quant_model_mode,
    norm_correction_mode,
    quantization_disabled,
    require_onnxoptimizer,
    reset_export_mode,
)
from quark_brevitas.brevitas_adapter.mse import MSE_SAMPLE_ELEMENTS, sampled_activation_mse  # noqa: E402
from quark_brevitas.brevitas_adapter.pickling import register_pickling  # noqa: E402
from quark_brevitas.brevitas_adapter.plain_layers import plain_linear_forwards  # noqa: E402
from quark_brevitas.brevitas_adapter.precision import (  # noqa: E402
    HALF_DTYPES,
    float32_quantizer_kwargs,
    keep_quantizers_float32,
)
from quark_brevitas.brevitas_adapter.reciprocal import (  # noqa: E402
    RECIPROCAL_INT8_LETS,
    ReciprocalIntQuant,
    reciprocal_codes,
    uses_reciprocal_codes,
)
from quark_brevitas.brevitas_adapter.rotation import (  # noqa: E402
    OnlineHadamard,
    RotatedInput,
    hadamard_supported,
    rotation_matrix,
)
from quark_brevitas.brevitas_adapter.structure import (  # noqa: E402
    adopt_parameters,
    attach_bias_quant,
    equalized_scale_shape,
    quant_layer_for,
    swap_parameter,
    wrap_equalized,
)

register_pickling()  # torch.save(model) says what to use instead of a PicklingError

__all__ = [
    "LAYER_OUTPUT_BUDGET",
    "LayerOutputs",
    "layer_output_budget",
    "layer_outputs_remembered",
    "outputs_handed_over",
    "discard_handed_over_outputs",
    "Handoff",
    "gptq_class_checking_once",
    "weights_quantized_once",
    "weight_cache_budget",
    "FLOAT8_DTYPES",
    "HALF_DTYPES",
    "MSE_SAMPLE_ELEMENTS",
    "SUPPORTED_BREVITAS",
    "EqualizedModule",
    "OnlineHadamard",
    "KQUANT_MINIMUM_LETS",
    "RECIPROCAL_INT8_LETS",
    "ReciprocalIntQuant",
    "RotatedInput",
    "IntWeightFormat",
    "QuantActivation",
    "fused_activation",
    "QuantLayer",
    "QuantizerSite",
    "Reducer",
    "Shard",
    "StopFwdException",
    "WeightGrid",
    "a2gpfq_available",
    "a2gpfq_mode",
    "activation_equalization_mode",
    "adopt_parameters",
    "attach_bias_quant",
    "all_reduce_statistics",
    "barrier",
    "bias_correction_mode",
    "brevitas_version",
    "calibration_mode",
    "candidate_quantizer",
    "check_supported_version",
    "current_shard",
    "equalization_statistics",
    "equalized_scale_shape",
    "export_handler_proxy_types",
    "float32_quantizer_kwargs",
    "float8_dtype",
    "full_state_dict",
    "generative_quantizers",
    "gpfq_mode",
    "gptq_mode",
    "gpxq_update",
    "gpxq_optimizers",
    "groupwise_parts",
    "hadamard_supported",
    "has_static_activation_quantizers",
    "ignore_missing_keys",
    "init_weight_scales",
    "injector_value",
    "input_quantizer",
    "int_weight_format",
    "int_weight_formats_remembered",
    "is_dynamic_activation",
    "is_float_quantizer",
    "is_graph_module",
    "is_groupwise",
    "iter_quantizers",
    "keep_quantizers_float32",
    "load_quant_model_mode",
    "mark_scale_initialised",
    "norm_correction_mode",
    "offset_of",
    "plain_linear_forwards",
    "plain_tensor",
    "quantization_disabled",
    "quantized_units",
    "quantizer_kind",
    "quantizer_names",
    "reciprocal_codes",
    "require_equal_shares",
    "require_onnxoptimizer",
    "reset_export_mode",
    "restart_activation_statistics",
    "rotation_matrix",
    "runtime_stats_modules",
    "sampled_activation_mse",
    "scale_impl",
    "scale_parameters",
    "quant_layer_for",
    "swap_parameter",
    "symbolic_trace",
    "weight_grid",
    "uses_offset_dequantization",
    "uses_reciprocal_codes",
    "weight_quant_disabled",
    "weight_quantization_pairs",
    "wrap_equalized",
]
