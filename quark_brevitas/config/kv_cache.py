"""KV-cache quantization in a Config: Quark 0.13's ``kv_cache_quant_config``, ``kv_cache_group``,
``min_kv_scale`` and ``kv_cache_post_rope``, checked and folded into the layer hierarchy.

Quark 0.13 keys ``kv_cache_quant_config`` by the key/value projections (``{"*k_proj": QLayerConfig(weight=...,
input_tensors=..., output_tensors=FP8 spec), "*v_proj": ...}``): the ``output_tensors`` spec is how the cache
is quantized, and the weight/input specs are the projection's own (Quark applies that whole entry to the
projection). Its ``LLMTemplate`` writes the same entries into ``layer_quant_config`` too. Here the cache is
quantized by a KV quantizer of its own (:mod:`quark_brevitas.model_parts.kv_cache`, after RoPE where
``kv_cache_post_rope`` asks, else on the projection's output as Quark does), so :func:`fold_kv_cache_config`
moves the weight/input specs into ``layer_quant_config`` and takes the ``output_tensors`` that duplicates the
cache spec out of it: the keys are never quantized twice.

Allowed cache specs (:func:`kv_format`): static, symmetric, FP8 E4M3 or int8, per tensor, or per channel with
``ch_axis=1`` after RoPE (one scale per key/value head). Plain data: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from quark_brevitas.config.enums import QSchemeType, QuantType
from quark_brevitas.config.specs import QuantizationConfig, QuantizationSpec
from quark_brevitas.errors import ConfigError

__all__ = ["KV_FORMATS", "fold_kv_cache_config", "kv_format", "verify_kv_cache"]

#: The element formats of a quantized cache: name -> largest magnitude of the grid.
KV_FORMATS: Mapping[str, float] = {"fp8_e4m3": 448.0, "int8": 127.0}

_ALLOWED = ("a static, symmetric FP8 E4M3 or int8 spec, per tensor (per_channel with ch_axis=1: one scale per "
            "head, only with kv_cache_post_rope=True)")


def kv_format(spec: QuantizationSpec, path: str, *, post_rope: bool) -> tuple[str, bool]:
    """``(format, per_head)`` of a cache spec; ConfigError naming ``path`` for one the KV quantizer cannot
    honour exactly."""
    if not isinstance(spec, QuantizationSpec):
        raise ConfigError(path, f"must be a QTensorConfig (the cache's spec), got {type(spec).__name__}; "
                                f"allowed: {_ALLOWED}")
    spec = spec.resolved(path)
    if spec.is_dynamic:
        raise ConfigError(f"{path}.is_dynamic", f"True: the cache keeps one calibrated scale; allowed: {_ALLOWED}")
    if not spec.symmetric:
        raise ConfigError(f"{path}.symmetric", f"False: vLLM's k_scale/v_scale have no zero point; allowed: "
                                               f"{_ALLOWED}")
    if spec.quant_type is QuantType.float_quant and (spec.exponent_bit_width, spec.mantissa_bit_width) == (4, 3):
        name = "fp8_e4m3"
    elif spec.quant_type is QuantType.int_quant and spec.bit_width == 8:
        name = "int8"
    else:
        raise ConfigError(path, f"{spec.short()} is not a cache format; allowed: {_ALLOWED}")
    if spec.qscheme is QSchemeType.per_tensor:
        return name, False
    if spec.qscheme is QSchemeType.per_channel and spec.ch_axis == 1 and post_rope:
        return name, True
    raise ConfigError(f"{path}.qscheme", f"{spec.qscheme.name} (ch_axis={spec.ch_axis}, kv_cache_post_rope="
                                         f"{post_rope}); allowed: {_ALLOWED}")


def verify_kv_cache(config: Any) -> None:
    """The KV-cache fields of ``config`` (a Config), each error naming its field."""
    entries = config.kv_cache_quant_config
    if not isinstance(entries, Mapping):
        raise ConfigError("kv_cache_quant_config", f"must be a dict of pattern -> QLayerConfig, got "
                                                   f"{type(entries).__name__}")
    for pattern, layer in entries.items():
        where = f"kv_cache_quant_config[{pattern!r}]"
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(where, "keys must be non-empty module name patterns (e.g. '*k_proj')")
        if not isinstance(layer, QuantizationConfig) or layer.output_tensors is None:
            raise ConfigError(f"{where}.output_tensors", "must be set: it is the cache's spec (a QLayerConfig with "
                                                         f"output_tensors=...); allowed: {_ALLOWED}")
        kv_format(layer.output_tensors, f"{where}.output_tensors", post_rope=config.kv_cache_post_rope)
    if isinstance(config.min_kv_scale, bool) or not isinstance(config.min_kv_scale, (int, float)) \
            or not config.min_kv_scale >= 0:
        raise ConfigError("min_kv_scale", f"{config.min_kv_scale!r}; allowed: a number >= 0 (the smallest cache "
                                          "scale written, Quark's floor)")
    if not isinstance(config.kv_cache_group, list) or not all(isinstance(p, str) for p in config.kv_cache_group):
        raise ConfigError("kv_cache_group", "must be a list of module name patterns (e.g. ['*k_proj', '*v_proj'])")
    if not isinstance(config.kv_cache_post_rope, bool):
        raise ConfigError("kv_cache_post_rope", f"{config.kv_cache_post_rope!r}; allowed: True or False")


def fold_kv_cache_config(layers: Mapping[str, QuantizationConfig], kv: Mapping[str, QuantizationConfig]
                         ) -> dict[str, QuantizationConfig]:
    """``layer_quant_config`` with the cache entries folded in (see the module docstring): each cache pattern's
    weight/input specs become that pattern's layer entry (the hierarchy decides where they are ``None``), and
    an ``output_tensors`` equal to the cache spec is dropped there. Idempotent, so a config equals its round
    trip through a file."""
    folded = dict(layers)
    for pattern, entry in kv.items():
        if not isinstance(entry, QuantizationConfig):
            continue  # verify_kv_cache names it
        current = folded.get(pattern)
        output = current.output_tensors if isinstance(current, QuantizationConfig) else None
        merged = QuantizationConfig(
            input_tensors=entry.input_tensors or (current.input_tensors if current else None),
            weight=entry.weight or (current.weight if current else None),
            bias=current.bias if current else None,
            output_tensors=None if output == entry.output_tensors else output)
        if current is not None:
            merged = replace(merged, target_device=current.target_device)
        if any(getattr(merged, role) is not None for role in ("input_tensors", "weight", "bias", "output_tensors")):
            folded[pattern] = merged
        else:
            folded.pop(pattern, None)
    return folded
