"""What quark_brevitas promises not to move: the public modules and names, and where moved names went.

Why a table: the package was reorganised several times, and each time an import a user had copied from the README
(``from quark_brevitas.presets import get_preset``) stopped working without a trace. From 0.2.0 on the rule is
(see ``docs/reference/public-api.md``):

- :data:`PUBLIC` lists every public module and the names the documentation shows from it. A name in it is only
  removed or moved in a new minor release, and ``CHANGELOG.md`` says so.
- A moved name keeps working from its old path for at least one minor release: the old module becomes a thin shim
  (three lines, see :func:`moved_module`) listed in :data:`MOVED`, whose names resolve on first use to the new
  location with a :class:`DeprecationWarning` naming it.

``tests/test_public_api.py`` imports every name of :data:`PUBLIC` from its path, every name of :data:`MOVED` from
its old path (asserting the warning and that it is the very object of the new path), and every import the README
and the examples ever showed (dug from the git history), so that a removal fails a test instead of a user.

This module imports nothing of the package: the shims use it before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["DEPRECATED_SINCE", "MOVED", "MOVED_SINCE", "PUBLIC", "moved_module", "new_location"]

#: Public module -> the names the documentation shows from it (the whole promise; everything else is internal).
PUBLIC: dict[str, tuple[str, ...]] = {
    "quark_brevitas": (
        "DEFAULT_LAYER_MAP", "Backend", "CalibrationDataError", "CheckpointError", "Config", "ConfigError",
        "Container", "IntegerWeight", "LLMTemplate", "LayerMapping", "LayerwiseBackend", "ModelError",
        "ModelExporter", "ModelQuantizer", "ParamType", "QATConfig", "QConfig", "QLayerConfig", "QTensorConfig",
        "QuantType", "QuantizationConfig", "QuantizationSpec", "QuarkBrevitasError", "UnsupportedAlgorithmError",
        "algos", "integer_weights", "prepare_qat", "load_quantized", "save_integer_weights", "save_quantized",
        "types", "verify_config", "__version__",
        # Quark 0.13's top-level functions (quark.torch), under their names
        "export_gguf", "export_onnx", "export_safetensors", "import_model_from_safetensors", "load_params",
        "save_params",
    ),
    "quark_brevitas.backend.graph": ("FINN_QAT_RECIPE", "GraphBackend", "end_layers", "finn_config", "plan_points",
                                     "points_table"),
    "quark_brevitas.model_parts.attention": ("attention_quantization_disabled", "attention_scales"),
    "quark_brevitas.model_parts.kv_cache": ("kv_quantization_disabled", "kv_scales"),
    "quark_brevitas.model_parts.moe": ("unfuse_experts",),
    "quark_brevitas.quark_compat": (
        "export_gguf", "export_onnx", "export_safetensors", "import_model_from_safetensors", "load_params",
        "save_params",
    ),
    "quark_brevitas.api": ("ModelQuantizer", "ModelExporter"),
    "quark_brevitas.config": (
        "AWQConfig", "AutoRoundConfig", "Backend", "Config", "ConfigError", "DeviceType", "Dtype", "GPTQConfig",
        "LLMTemplate", "ParamType", "QConfig", "QLayerConfig", "QSchemeType", "QTensorConfig", "QronosConfig",
        "QuantType", "QuantizationConfig", "QuantizationSpec", "RotationConfig", "RoundType", "ScaleType",
        "SmoothQuantConfig", "ZeroPointType", "verify_config",
    ),
    "quark_brevitas.config.presets": ("DEFAULT_PRESET", "DESCRIPTIONS", "PRESETS", "get_preset"),
    "quark_brevitas.config.schema": ("SCHEMA_PATH", "config_json_schema", "write_schema"),
    "quark_brevitas.config.families": ("FAMILIES",),
    "quark_brevitas.config.observers": (),
    "quark_brevitas.types": (
        "Backend", "DeviceType", "Dtype", "ParamType", "QSchemeType", "QuantType", "QuantizationMode", "RoundType",
        "ScaleType", "TQTThresholdInitMeth", "ZeroPointType",
    ),
    "quark_brevitas.algos": (
        "AWQConfig", "AutoRoundConfig", "ActivationEqualization", "BiasCorrection", "CalibrateBatchNorm", "GPFA2Q",
        "GPFQ", "GPTQ", "GPTQConfig", "Preprocess", "QronosConfig", "RotationConfig", "SmoothQuantConfig",
    ),
    "quark_brevitas.algorithms": ("apply_algorithm", "describe_algorithms", "register", "registered_handlers"),
    "quark_brevitas.backend": ("DEFAULT_LAYER_MAP", "LayerMapping", "LayerwiseBackend", "plan_table"),
    "quark_brevitas.backend.layers": ("QuantConv1D", "QuantMultiheadAttention"),
    "quark_brevitas.calibration.data": ("CalibrationData", "cache_keyword"),
    "quark_brevitas.checkpoint": ("CheckpointError", "load_quantized", "read_checkpoint", "save_quantized"),
    "quark_brevitas.container": ("Container",),
    "quark_brevitas.errors": (
        "CalibrationDataError", "ConfigError", "ModelError", "QuarkBrevitasError", "UnsupportedAlgorithmError",
    ),
    "quark_brevitas.export": (
        "ExportArgumentError", "ExportError", "ExportMismatchError", "ExportReport", "QONNXExportReport",
        "VerificationResult", "create_ort_session", "export_gguf", "export_onnx_qcdq", "export_qonnx",
        "export_safetensors", "run_onnx", "run_qonnx", "verify_onnx", "FinnFinding", "finn_readiness",
    ),
    "quark_brevitas.export.intweights": ("IntegerWeight", "integer_weights", "save_integer_weights"),
    "quark_brevitas.export.onnx.decode": ("DecodeResult", "greedy_decode"),
    "quark_brevitas.export.registry": ("FORMATS", "ExportFormat", "format_names", "get_format", "register_format"),
    "quark_brevitas.hf.streaming": ("load_pretrained_quantized", "quantize_pretrained"),
    "quark_brevitas.hf.export_streamed": ("export_gguf_streamed", "export_safetensors_streamed"),
    "quark_brevitas.qat": ("QATConfig", "QATError", "prepare_qat"),
    "quark_brevitas.analysis": (
        "CANDIDATES", "auto_mixed_precision", "compare_layers", "layer_table", "model_size", "plot_layer_sqnr",
        "plot_sensitivity", "sensitivity", "sensitivity_table", "write_rows",
    ),
    "quark_brevitas.cli": ("main",),
    "quark_brevitas.cli.digits": (
        "DigitsCNN", "DigitsData", "evaluate", "evaluate_predictions", "example_input", "fine_tune",
        "load_digits_data", "train_digits_cnn",
    ),
}

#: The release that moved the names of :data:`MOVED` (their shims stay at least until the next minor release).
DEPRECATED_SINCE = "0.2.0"

#: Old modules moved by a later release than :data:`DEPRECATED_SINCE` -> that release.
MOVED_SINCE: dict[str, str] = {"quark_brevitas.export.qonnx": "0.3.0", "quark_brevitas.export.blocked": "0.3.0",
                               "quark_brevitas.hf.kv_cache": "0.4.0", "quark_brevitas.hf.moe": "0.4.0"}

#: Old module (a shim now) -> {public name it had: the module it lives in now}. Each old module was documented
#: (README, examples) before 0.2.0 and removed by a reorganisation.
MOVED: dict[str, dict[str, str]] = {
    "quark_brevitas.presets": dict.fromkeys(
        ("DEFAULT_PRESET", "DESCRIPTIONS", "PRESETS", "get_preset"), "quark_brevitas.config.presets"),
    "quark_brevitas.digits": dict.fromkeys(
        ("NUM_CLASSES", "PIXEL_MAX", "TEST_FRACTION", "DigitsCNN", "DigitsData", "evaluate", "evaluate_predictions",
         "example_input", "fine_tune", "load_digits_data", "train_digits_cnn"), "quark_brevitas.cli.digits"),
    "quark_brevitas.schema": dict.fromkeys(
        ("SCHEMA_PATH", "config_json_schema", "write_schema"), "quark_brevitas.config.schema"),
    "quark_brevitas.layers": dict.fromkeys(("QuantConv1D", "QuantMultiheadAttention"), "quark_brevitas.backend.layers"),
    "quark_brevitas.data": dict.fromkeys(
        ("ALLOWED_BATCHES", "CACHE_KEYWORDS", "BatchToInputs", "BlockInputs", "CalibrationData", "Shard",
         "cache_keyword", "model_device_dtype", "output_cache", "prepare_batch", "run_batches", "split_batch",
         "takes"), "quark_brevitas.calibration.data"),
    "quark_brevitas.blockwise": {
        "BlockSource": "quark_brevitas.blocks.sources", "CopiedBlocks": "quark_brevitas.blocks.sources",
        "copy_without_blocks": "quark_brevitas.blocks.sources", "BlockwiseEngine": "quark_brevitas.blocks.engine",
        "StoreFactory": "quark_brevitas.blocks.store", "UntilStopped": "quark_brevitas.blocks.capture",
        "main_output": "quark_brevitas.blocks.capture", "replayable": "quark_brevitas.blocks.capture",
        "find_block_stack": "quark_brevitas.blocks.stack", "resolve_block_stack": "quark_brevitas.blocks.stack",
    },
    "quark_brevitas.activation_store": dict.fromkeys(
        ("ActivationStore", "available_memory", "default_memory_budget", "detached", "map_tensors", "nbytes"),
        "quark_brevitas.blocks.store"),
    "quark_brevitas.intweights": dict.fromkeys(
        ("IntegerWeight", "integer_weights", "save_integer_weights"), "quark_brevitas.export.intweights"),
    "quark_brevitas.export_qonnx": dict.fromkeys(
        ("QONNX_DOMAIN", "QONNXExportReport", "export_qonnx", "run_qonnx"), "quark_brevitas.export.onnx.qonnx"),
    "quark_brevitas.export_blocked": dict.fromkeys(
        ("BLOCKED_OPSET", "PlannedWeight", "float_weights", "insert_dequantize", "needs_plan", "plan_weights",
         "weight_format"), "quark_brevitas.export.onnx.blocked"),
    # 0.3.0: quark_brevitas/export/ split by target (onnx/, hf/, gguf/); these two modules were documented.
    "quark_brevitas.export.qonnx": dict.fromkeys(
        ("QONNX_DOMAIN", "QONNXExportReport", "export_qonnx", "run_qonnx"), "quark_brevitas.export.onnx.qonnx"),
    "quark_brevitas.export.blocked": dict.fromkeys(
        ("BLOCKED_OPSET", "PlannedWeight", "float_weights", "insert_dequantize", "needs_plan", "plan_weights",
         "weight_format"), "quark_brevitas.export.onnx.blocked"),
    # 0.4.0: the KV-cache and mixture-of-experts parts of a model moved below the pipeline (it attaches them).
    "quark_brevitas.hf.kv_cache": dict.fromkeys(
        ("KVCacheQuantizer", "KVScales", "QuantizingCache", "attach_kv_quantizers", "fake_quantize",
         "finish_kv_calibration", "kv_plan_lines", "kv_quantization_disabled", "kv_scales", "kv_targets"),
        "quark_brevitas.model_parts.kv_cache"),
    "quark_brevitas.hf.moe": dict.fromkeys(
        ("ExpertMLP", "UnfusedExperts", "expert_coverage", "log_expert_coverage", "unfuse_experts"),
        "quark_brevitas.model_parts.moe"),
    "quark_brevitas.ties": dict.fromkeys(
        ("TiedGroup", "run_untied", "tied_groups", "untie_differing"), "quark_brevitas.algorithms.ties"),
    "quark_brevitas.dtypes": {
        **dict.fromkeys(("DTYPE_FIELDS", "MX_BLOCK_SIZE", "MX_ELEMENT_DTYPES", "MX_FIELDS", "REJECTED_DTYPES"),
                        "quark_brevitas.config.formats"),
        **dict.fromkeys(("describe", "resolve_dtype", "spec_defaults"), "quark_brevitas.config.specs"),
    },
    "quark_brevitas.serialization": dict.fromkeys(
        ("VERSION_KEY", "Hint", "Polymorphic", "Text", "check_fields", "did_you_mean", "expected", "field_hints",
         "field_path", "from_plain", "key_path", "parse_hint", "tag_default", "to_plain", "with_version",
         "without_version"), "quark_brevitas.config.serialization"),
    "quark_brevitas.verification": {
        "verify_config": "quark_brevitas.config.model_config",
        **dict.fromkeys(("HIERARCHY_LEVELS", "verify_layer_config", "verify_partial_layer_config"),
                        "quark_brevitas.config.checks"),
    },
}


def new_location(old_module: str, name: str) -> str:
    """The module a moved public name lives in now (``KeyError`` if ``old_module`` never had it)."""
    return MOVED[old_module][name]


def moved_module(old_module: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the shim left at ``old_module``: each name of :data:`MOVED` resolves to the
    object at its new location, with a :class:`DeprecationWarning` naming that location (attributed to the line
    that imports or reads it, so ``python -W error::DeprecationWarning`` points at the user's code). The value is
    not cached on the shim, so every use is reported, not only the first."""
    names = MOVED[old_module]
    since = MOVED_SINCE.get(old_module, DEPRECATED_SINCE)
    # One warning per access; the owner's code runs `from old import name` or `old.name`, both of which call
    # __getattr__ from the frame that names it.
    stacklevel = 2

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r} (the module is deprecated since "
                                 f"{since}; its public names moved: {', '.join(sorted(names))})")
        target = names[name]
        warnings.warn(f"{old_module}.{name} moved to {target}.{name} in quark_brevitas {since}; import "
                      f"it from {target} (the old path will be removed in a later minor release)",
                      DeprecationWarning, stacklevel=stacklevel)
        return getattr(importlib.import_module(target), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
