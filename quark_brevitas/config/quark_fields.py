"""Quark 0.13's ``QConfig`` fields that :class:`~quark_brevitas.config.Config` does not have, and Quark 0.13's config
files (:func:`from_quark_file`: the ``quantization_config`` Quark writes, with its ``export`` section and the per-tensor
fields of its ``QTensorConfig``).

Quark 0.13's ``QConfig`` carries, beside the hierarchy Config has, fields for Quark's own machinery (FX graph
mode, its file-to-file and per-block flows, MoE input syncing) and metadata (its version, the screen log level,
``quant_method`` in its files). Code written for Quark 0.13 sets them, usually to their defaults; its config files
write them. Each is accepted where it asks for nothing quark_brevitas would do differently (a default, or metadata,
which has no effect on the result) and otherwise refused with a
:class:`ConfigError` naming the field and why, so a setting is never silently dropped.

Plain data: nothing here imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from quark_brevitas.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_FIELDS", "QUARK_ONLY_FIELDS", "SPEC_FIELDS", "QuarkField", "check_quark_fields", "from_quark_file",
           "without_quark_fields"]


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple, dict)) and not value)


def _named(name: str) -> Callable[[Any], bool]:
    """Accepts Quark's enum member ``name`` (any Enum with that member name: Quark's own enum is not importable
    here) or its name as a string (how Quark's files write it)."""
    return lambda value: getattr(value, "name", value) == name


def _optional(kind: type) -> Callable[[Any], bool]:
    return lambda value: value is None or (isinstance(value, kind) and not isinstance(value, bool))


@dataclass(frozen=True)
class QuarkField:
    """One of Quark's QConfig fields: ``accepts(value)`` says whether quark_brevitas honours the value as given;
    ``allowed`` says which values those are, ``why`` why others are refused (or, for metadata, what it is)."""

    accepts: Callable[[Any], bool]
    allowed: str
    why: str
    metadata: bool = False


#: Quark 0.13's QConfig fields that Config lacks, and what quark_brevitas accepts of each.
QUARK_ONLY_FIELDS: Mapping[str, QuarkField] = {
    "shared_scale_groups": QuarkField(_empty, "[] or None", "shared global scales belong to nvfp4-style two-level "
                                      "scales, which have no Brevitas quantizer"),
    "quant_mode": QuarkField(lambda v: _named("eager_mode")(v) or _named("fx_graph_mode")(v),
                             "QuantizationMode.eager_mode / 'eager_mode' (Backend.layerwise) or "
                             "QuantizationMode.fx_graph_mode / 'fx_graph_mode' (Backend.graph)",
                             "quant_mode picks the backend: eager_mode is Backend.layerwise, fx_graph_mode "
                             "Backend.graph"),
    "quant_flow": QuarkField(_named("standard"), "QuantFlow.standard or 'standard'",
                             "Quark's file2file/per_block flows are not ModelQuantizer options here (ModelQuantizer "
                             "already runs the data phase block by block; a model folder too big for memory is "
                             "streamed with quark_brevitas.hf.streaming.quantize_pretrained)"),
    "gpu_resident_blocks": QuarkField(lambda v: v == 0 and not isinstance(v, bool), "0",
                                      "only meaningful with Quark's per_block flow, which is not supported"),
    "sync_moe_expert_input_amax": QuarkField(lambda v: v is False, "False",
                                             "syncing MoE experts' input ranges is not supported"),
    "keep_prequantized_layers": QuarkField(lambda v: v is True, "True", "quark_brevitas quantizes float models "
                                           "only; it does not load pre-quantized layers to dequantize"),
    "log_severity_level": QuarkField(_optional(int), "an int or None",
                                     "Quark's screen log level (metadata: quark_brevitas logs through `logging`)",
                                     metadata=True),
    "version": QuarkField(_optional(str), "a str or None", "the version of Quark that wrote the config (metadata)",
                          metadata=True),
    "quant_method": QuarkField(lambda v: v == "quark", "'quark'", "the marker Quark writes in its files (metadata)",
                               metadata=True),
}


def check_quark_fields(given: Mapping[str, Any], path: str = "") -> None:
    """Raise a ConfigError for the first of Quark's fields in ``given`` whose value quark_brevitas cannot honour;
    the others need nothing done (defaults and metadata are logged at debug level)."""
    for name, value in given.items():
        field = QUARK_ONLY_FIELDS[name]
        where = f"{path}.{name}" if path else name
        if not field.accepts(value):
            shown = _shown(value)
            kind = "is" if field.metadata else "is not supported:"
            raise ConfigError(where, f"{shown} {kind} {field.why}; allowed: {field.allowed} (Quark 0.13's QConfig "
                                     "field, accepted where it changes nothing here)")
        logger.debug("QConfig.%s=%r accepted (%s)", name, value, "metadata" if field.metadata else "Quark's default")


def _shown(value: Any) -> str:
    """A refused value as a message shows it: enum members and scalars as written, anything else by type."""
    if isinstance(getattr(value, "name", None), str) and not isinstance(value, (str, dict)):
        return str(value.name)
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"a {type(value).__name__}"


def without_quark_fields(data: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """``data`` (a config's keyword arguments or a config file's top level) without Quark's fields, after
    :func:`check_quark_fields` has accepted them."""
    check_quark_fields({key: value for key, value in data.items() if key in QUARK_ONLY_FIELDS}, path)
    kept = {key: value for key, value in data.items() if key not in QUARK_ONLY_FIELDS}
    if "quant_mode" in data:
        kept = _with_mode_backend(kept, data["quant_mode"], path)
    return kept


def _with_mode_backend(data: dict[str, Any], mode: Any, path: str) -> dict[str, Any]:
    """``data`` with the backend Quark's ``quant_mode`` names (``fx_graph_mode``: graph, ``eager_mode``:
    layerwise); a ``backend`` given beside it must agree."""
    from quark_brevitas.config.enums import Backend  # plain enums, no torch

    wanted = Backend.graph if _named("fx_graph_mode")(mode) else Backend.layerwise
    given = data.get("backend", wanted)
    if getattr(given, "value", given) != wanted.value:
        where = f"{path}.backend" if path else "backend"
        raise ConfigError(where, f"{getattr(given, 'value', given)!r} disagrees with quant_mode="
                                 f"{getattr(mode, 'name', mode)!r}, which means Backend.{wanted.value}; give one")
    return {**data, "backend": given}


# ===================================================================== Quark 0.13's config files
#: The element dtypes of floating-point formats, as Quark's files spell them: they have no zero point and no sign
#: convention to choose, so Quark's ``zero_point_type: "int32"`` and ``symmetric: null`` on them say nothing.
_FLOAT_DTYPES = frozenset({"fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4", "mx"})
#: Quark's observers of OCP MX blocks: power-of-two (E8M0) block scales here.
_MX_OBSERVERS = frozenset({"PerBlockMXObserver", "PerBlockMXBufferReuseObserver"})
_LAYER_LEVELS = ("layer_type_quant_config", "layer_quant_config")
_TENSORS = ("input_tensors", "output_tensors", "weight", "bias")
_NO_SCALE_FORMAT = ("scales stored in a low-precision float format (Quark's e4m3 / e5m3 scale formats) have no "
                    "Brevitas scaling rule")

#: The ``export`` section Quark's ``export_safetensors`` adds to ``quantization_config``: how the file's tensors were
#: written. Its storage fields describe the file a config was read from, not a way of quantizing, so their values
#: Quark writes are accepted; the others ask for machinery quark_brevitas lacks.
EXPORT_FIELDS: Mapping[str, QuarkField] = {
    "weight_merge_groups": QuarkField(_empty, "null or []", "weight scales shared by merged layers are not supported"),
    # the KV-cache fields repeat the config's own kv_cache_group / min_kv_scale (which quantize the cache here)
    "kv_cache_group": QuarkField(lambda v: v is None or isinstance(v, list), "a list or null",
                                 "the file's copy of the config's kv_cache_group (metadata of the file)",
                                 metadata=True),
    "min_kv_scale": QuarkField(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                               "a number >= 0", "the file's copy of the config's min_kv_scale (metadata of the file)",
                               metadata=True),
    "weight_format": QuarkField(lambda v: v in ("real_quantized", "fake_quantized"),
                                "'real_quantized' or 'fake_quantized'",
                                "how the file's weights were stored (metadata of the file)", metadata=True),
    "pack_method": QuarkField(lambda v: v in ("reorder", "order"), "'reorder' or 'order'",
                              "how the file's 4-bit weights were packed (metadata of the file)", metadata=True),
}


def _is_false(value: Any) -> bool:
    return value is False


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


#: Quark 0.13's per-tensor (``QTensorConfig``) fields that quark_brevitas's QuantizationSpec does not have, apart from
#: ``scale_format`` and ``scale_calculation_mode`` (which depend on the spec: :func:`_check_scale_fields`).
SPEC_FIELDS: Mapping[str, QuarkField] = {
    "block_size": QuarkField(_empty, "null", "2-D block scales (Quark's per_block scheme) have no Brevitas quantizer; "
                             "use qscheme per_group"),
    "is_scale_quant": QuarkField(_is_false, "false", "quantizing the scales themselves (Quark's two-level fp4 / fp8 "
                                 "scales) has no Brevitas quantizer"),
    "enable_buffer_reuse": QuarkField(lambda v: isinstance(v, bool), "true or false",
                                      "a memory-saving implementation of Quark's MX observer, same scales (Quark's "
                                      "machinery: nothing to do here)", metadata=True),
    "max_input_numel": QuarkField(_positive_int, "a positive integer", "the size bound of Quark's buffer-reuse "
                                  "observer (Quark's machinery: nothing to do here)", metadata=True),
}
_SCALE_FIELDS = ("scale_format", "scale_calculation_mode")
#: Quark's element formats without a quantizer here: their dtype's refusal (ConfigError) names them.
_REFUSED_DTYPES = frozenset({"bfp16", "mx6", "mx9"})
_ACTIVATIONS = frozenset({"input_tensors", "output_tensors"})
#: The activation axes Quark writes for what quark_brevitas does along the layer's own axes (activation specs here
#: take no ch_axis): groups over the last dimension (``per_group``, -1) and one scale per token (``per_channel`` along
#: axis 1 of ``[batch, tokens, hidden]``, how Quark's ``ptpc_fp8`` template and our Quark-format export write it).
_ACTIVATION_AXES = frozenset({("per_group", -1), ("per_channel", 1)})


def _refuse(where: str, value: Any, field: QuarkField) -> ConfigError:
    kind = "is" if field.metadata else "is not supported:"
    return ConfigError(where, f"{_shown(value)} {kind} {field.why}; allowed: {field.allowed} (Quark 0.13's field, "
                              "accepted where it changes nothing here)")


def _checked_section(given: Any, fields: Mapping[str, QuarkField], path: str) -> None:
    if not isinstance(given, dict):
        raise ConfigError(path, f"must be a mapping of {sorted(fields)}, got {_shown(given)}")
    for name, value in given.items():
        if name not in fields:
            raise ConfigError(f"{path}.{name}", f"unknown key; allowed: {sorted(fields)}")
        if not fields[name].accepts(value):
            raise _refuse(f"{path}.{name}", value, fields[name])


def _check_scale_fields(spec: Mapping[str, Any], path: str) -> None:
    """``scale_format`` and ``scale_calculation_mode``: how Quark computes a scale. Power-of-two (E8M0) block scales
    are the OCP MX rule here, whose shared exponent is ``floor(log2(amax)) - emax``: Quark's ``"floor"`` mode. Its
    default ``"even"`` (also what ``null`` means to Quark) rounds the exponent differently, so it is refused rather
    than quietly replaced."""
    scale_format, mode = spec.get("scale_format"), spec.get("scale_calculation_mode")
    mx = spec.get("observer_cls") in _MX_OBSERVERS or spec.get("dtype") == "mx"
    if scale_format in ("e4m3", "e5m3"):
        raise ConfigError(f"{path}.scale_format", f"{scale_format!r} is not supported: {_NO_SCALE_FORMAT}; allowed: "
                                                  "null, 'float32' or, for MX blocks, 'e8m0'")
    if scale_format == "e8m0":
        if not mx and spec.get("scale_type") != "pof2":
            raise ConfigError(f"{path}.scale_format", "'e8m0' (power-of-two block scales) needs an MX spec "
                                                      "(observer_cls PerBlockMXObserver, or dtype mx); allowed here: "
                                                      "null or 'float32'")
        if mode != "floor":
            raise ConfigError(f"{path}.scale_calculation_mode", f"{_shown(mode)} is not supported: Quark rounds the "
                              "shared exponent of its MX scales half to even ('even', also what null means), "
                              "quark_brevitas uses the OCP rule, Quark's 'floor'; allowed: 'floor' (set it to accept "
                              "the OCP rule)")
        return
    if scale_format not in (None, "float32"):
        raise ConfigError(f"{path}.scale_format", f"{_shown(scale_format)} is not one of Quark's scale formats; "
                                                  "allowed: null, 'float32', 'e8m0'")
    if scale_format == "float32" and mx:
        raise ConfigError(f"{path}.scale_format", "'float32' block scales with an MX observer (Quark's nvfp4-style "
                          "float scales per block) have no Brevitas quantizer; allowed: 'e8m0'")
    if mode is not None:
        raise ConfigError(f"{path}.scale_calculation_mode", f"{_shown(mode)}: only used with scale_format 'e8m0' "
                                                            "(MX); allowed: null")


def _spec_from_quark(spec: Any, path: str) -> Any:
    """One tensor spec of a Quark file with Quark's own fields checked and removed (see :data:`SPEC_FIELDS`), and
    the nulls Quark writes for "not specified" dropped where quark_brevitas's default is what they mean."""
    if isinstance(spec, list):
        raise ConfigError(path, "a list of specs (Quark's two-stage quantization: nvfp4, int4_fp8, fp4 with fp8 "
                                "scales, ...) has no Brevitas quantizer; give one spec (a mapping) or null")
    if not isinstance(spec, dict) or not (set(spec) & {*SPEC_FIELDS, *_SCALE_FIELDS}):
        return spec  # quark_brevitas's own spelling: nothing of Quark's to read
    for name in sorted(SPEC_FIELDS.keys() & spec.keys()):
        if not SPEC_FIELDS[name].accepts(spec[name]):
            raise _refuse(f"{path}.{name}", spec[name], SPEC_FIELDS[name])
    plain = {key: value for key, value in spec.items() if key not in SPEC_FIELDS and key not in _SCALE_FIELDS}
    if plain.get("dtype") in _REFUSED_DTYPES:
        return {key: value for key, value in plain.items() if value is not None}  # the dtype's refusal says more
    _check_scale_fields(spec, path)
    if path.rpartition(".")[2] in _ACTIVATIONS and (plain.get("qscheme"), plain.get("ch_axis")) in _ACTIVATION_AXES:
        del plain["ch_axis"]  # activation axes follow the layer here (see _ACTIVATION_AXES)
    floating = plain.get("dtype") in _FLOAT_DTYPES
    if plain.get("scale_type", "") is None:
        del plain["scale_type"]  # Quark: "the default", a float scale
    if plain.get("symmetric", "") is None:
        if not floating:
            raise ConfigError(f"{path}.symmetric", "null: an integer format must say whether it is symmetric; "
                                                   "allowed: true or false")
        del plain["symmetric"]
    if (floating or plain.get("symmetric") is True) and plain.get("zero_point_type") == "int32":
        del plain["zero_point_type"]  # Quark writes its default on every spec; these have no zero point to type
    return plain


def _layer_from_quark(layer: Any, path: str) -> Any:
    if not isinstance(layer, dict):
        return layer
    return {key: _spec_from_quark(value, f"{path}.{key}") if key in _TENSORS else value for key, value in layer.items()}


def from_quark_file(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's top level (quark_brevitas's own, or a ``quantization_config`` as Quark 0.13 writes it: its
    ``QConfig.to_dict()`` with the ``export`` section) in quark_brevitas's spelling, for ``from_plain``.

    Quark's QConfig fields are checked by :func:`check_quark_fields`, its ``export`` section by
    :data:`EXPORT_FIELDS`, and each tensor spec's own fields by :data:`SPEC_FIELDS` and the scale rules; anything
    quark_brevitas cannot honour is one ConfigError naming the field. A file Quark wrote (``quant_method: "quark"``)
    runs no pre-quantization step it does not list (Quark has none by default), and ``algo_config: null`` means none.
    """
    from quark_brevitas.config.serialization import key_path

    plain = without_quark_fields(data)
    if "export" in plain:
        _checked_section(plain.pop("export"), EXPORT_FIELDS, "export")
    for name in ("pre_quant_opt_config", "algo_config"):
        if name in plain and plain[name] is None:
            plain[name] = []
    if data.get("quant_method") is not None:
        plain.setdefault("pre_quant_opt_config", [])
    if "global_quant_config" in plain:
        plain["global_quant_config"] = _layer_from_quark(plain["global_quant_config"], "global_quant_config")
    if isinstance(plain.get("softmax_quant_spec"), dict):
        plain["softmax_quant_spec"] = _spec_from_quark(plain["softmax_quant_spec"], "softmax_quant_spec")
    for level in (*_LAYER_LEVELS, "kv_cache_quant_config"):
        if isinstance(plain.get(level), dict):
            plain[level] = {key: _layer_from_quark(layer, key_path(level, key)) for key, layer in plain[level].items()}
    return plain
