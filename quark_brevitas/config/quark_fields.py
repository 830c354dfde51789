"""Quark 0.13's ``QConfig`` fields that :class:`~quark_brevitas.config.Config` does not have.

Quark 0.13's ``QConfig`` carries, beside the hierarchy Config has, fields for Quark's own machinery (KV-cache and
softmax quantization, FX graph mode, its file-to-file and per-block flows, MoE input syncing) and metadata (its
version, the screen log level, ``quant_method`` in its files). Code written for Quark 0.13 sets them, usually to
their defaults; its config files write them. Each is accepted where it asks for nothing quark_brevitas would do
differently (a default, or metadata, which has no effect on the result) and otherwise refused with a
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

__all__ = ["QUARK_ONLY_FIELDS", "QuarkField", "check_quark_fields", "without_quark_fields"]


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


_KV = "KV-cache quantization is not supported (quantize k_proj/v_proj outputs with layer_quant_config instead)"

#: Quark 0.13's QConfig fields that Config lacks, and what quark_brevitas accepts of each.
QUARK_ONLY_FIELDS: Mapping[str, QuarkField] = {
    "kv_cache_quant_config": QuarkField(_empty, "{} or None", _KV),
    "kv_cache_group": QuarkField(_empty, "[] or None", _KV),
    "min_kv_scale": QuarkField(lambda v: v == 0 and not isinstance(v, bool), "0.0", _KV),
    "kv_cache_post_rope": QuarkField(lambda v: v is False, "False", _KV),
    "shared_scale_groups": QuarkField(_empty, "[] or None", "shared global scales belong to nvfp4-style two-level "
                                      "scales, which have no Brevitas quantizer"),
    "softmax_quant_spec": QuarkField(lambda v: v is None, "None", "softmax (attention probability) quantization is "
                                     "not supported; quark_brevitas quantizes the inputs/outputs of layers"),
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
