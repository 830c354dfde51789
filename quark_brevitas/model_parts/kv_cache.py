"""KV-cache quantization of Hugging Face decoders: static FP8 E4M3 / int8 scales for the keys and values that
attention reads, calibrated block by block with the rest of the data phase.

What is quantized, and where (the config side is :mod:`quark_brevitas.config.kv_cache`):

- ``kv_cache_post_rope=True`` (what vLLM does with ``k_scale`` / ``v_scale``): the keys after RoPE and the values,
  as they enter the cache. A forward pre-hook on each attention module hands the attention a cache wrapper
  (:class:`QuantizingCache`) in place of the model's cache (or of ``None`` when the model runs without one):
  transformers' attention modules pass their new keys and values through ``cache.update(...)`` before
  attention, so the wrapper quantizes them there, stores the quantized values in the real cache (a
  ``DynamicCache`` of ``generate``, any cache class) and attention reads quantized keys and values only. The
  quantizers are the attention module's ``k_cache_quantizer`` / ``v_cache_quantizer``.
- ``kv_cache_post_rope=False`` (Quark's default): the outputs of the key/value projections, before RoPE, as
  Quark quantizes them; the quantizer is the projection's ``kv_cache_quantizer``, applied by a forward hook.

A :class:`KVCacheQuantizer` observes ``max |x|`` while its attention's block is calibrated (it returns its input
unchanged then, as Brevitas's calibration mode does), and :func:`finish_kv_calibration` turns the maxima into
scales: ``amax / 448`` (FP8 E4M3) or ``amax / 127`` (int8), the keys and values of one attention sharing the
larger of the two where both are in ``kv_cache_group`` (Quark's merge), floored at ``min_kv_scale``. Then it
quantizes: ``dequant(x) = clamp(cast(x / s)) * s`` with ``cast`` the round to nearest even of FP8 E4M3
(``torch.float8_e4m3fn``) or of the int8 grid (codes -128..127), the formula vLLM and compressed-tensors
dequantize with. The scales are buffers outside the state dict; the exporters write them where their
consumers read them (:func:`kv_scales`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark_brevitas.config.kv_cache import KV_FORMATS, kv_format
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = [
    "KVCacheQuantizer",
    "KVScales",
    "QuantizingCache",
    "StaticQuantizer",
    "attach_kv_quantizers",
    "finish_kv_calibration",
    "kv_plan_lines",
    "kv_quantization_disabled",
    "kv_scales",
]

#: The quantizer of a projection's output (before RoPE), and of an attention's keys / values (after RoPE).
PROJECTION_QUANTIZER = "kv_cache_quantizer"
KEY_QUANTIZER, VALUE_QUANTIZER = "k_cache_quantizer", "v_cache_quantizer"


class StaticQuantizer(nn.Module):
    """A static quantizer of one tensor of attention: ``fmt`` (a :data:`KV_FORMATS` name), one scale
    (``per_head=False``) or one per head (tensors ``[batch, heads, sequence, head_dim]``); ``target`` is the name
    exports use. Observes ``max |x|`` while ``calibrating``, then quantizes with :func:`fake_quantize`."""

    def __init__(self, fmt: str, target: str, heads: int | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        self.target = target
        self.per_head = heads is not None
        shape = (heads,) if heads is not None else ()
        self.register_buffer("amax", torch.zeros(shape), persistent=False)
        self.register_buffer("scale", torch.ones(shape), persistent=False)
        self.calibrating = True
        self.enabled = True
        self.seen = 0

    def extra_repr(self) -> str:
        state = "calibrating" if self.calibrating else f"scale={self.scale.tolist()}"
        return f"{self.fmt}, {'per head' if self.per_head else 'per tensor'}, {self.target}, {state}"

    def _dims(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(d for d in range(x.dim()) if not (self.per_head and d == 1))

    def _view(self, value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        value = value.to(device=x.device, dtype=torch.float32)
        return value.view(1, -1, *([1] * (x.dim() - 2))) if self.per_head else value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.calibrating:
            with torch.no_grad():
                self.amax.copy_(torch.maximum(self.amax, x.detach().abs().float().amax(dim=self._dims(x)).cpu()))
            self.seen += 1
            return x
        return fake_quantize(x, self._view(self.scale, x), self.fmt)


class KVCacheQuantizer(StaticQuantizer):
    """Static quantizer of one attention's keys or values (see :class:`StaticQuantizer`); ``target`` is the
    projection it stands for (``model.layers.0.self_attn.k_proj``)."""


def grid_codes(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``clamp(cast(x / scale))``: the codes of ``x`` on ``fmt``'s grid, as float32 values (an FP8 E4M3 number, or
    an integer -128..127). The one definition of the grid, for the fake quantization and the exported codes."""
    y = x.float() / scale
    if fmt == "fp8_e4m3":
        return y.clamp(-KV_FORMATS[fmt], KV_FORMATS[fmt]).to(torch.float8_e4m3fn).float()
    return torch.round(y).clamp(-KV_FORMATS[fmt] - 1, KV_FORMATS[fmt])


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``clamp(cast(x / scale)) * scale`` in float32, returned in ``x``'s dtype (see the module docstring)."""
    return (grid_codes(x, scale, fmt) * scale).to(x.dtype)


# ===================================================================== the attention side
class QuantizingCache:
    """What a quantized attention module receives as its cache: ``update`` quantizes the new keys and values
    with the module's quantizers, then stores them in the model's cache (``inner``) and returns what that
    returns, or returns them as they are when the model runs without a cache. Other attributes are the inner
    cache's."""

    def __init__(self, attention: nn.Module, inner: Any) -> None:
        self._attention = attention
        self._inner = inner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key_states = getattr(self._attention, KEY_QUANTIZER)(key_states)
        value_states = getattr(self._attention, VALUE_QUANTIZER)(value_states)
        if self._inner is None:
            return key_states, value_states
        return self._inner.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{type(self).__name__} of a call without a cache has no {name!r}")
        return getattr(inner, name)


def _cache_keyword(attention: nn.Module) -> str:
    """The attention forward's cache argument: ``cache`` (transformers 5.24+) or ``past_key_values``."""
    parameters = inspect.signature(attention.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in parameters:
            return name
    raise ModelError(f"{type(attention).__name__}.forward takes no cache argument (cache / past_key_values): "
                     "kv_cache_post_rope=True needs transformers' cache interface; use kv_cache_post_rope=False")


def _swap_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Forward pre-hook of a quantized attention: its cache argument becomes a :class:`QuantizingCache`."""
    keyword = module._kv_cache_keyword
    kwargs[keyword] = QuantizingCache(module, kwargs.get(keyword))
    return args, kwargs


def _quantize_output(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a key/value projection quantized before RoPE."""
    return getattr(module, PROJECTION_QUANTIZER)(output)


# ===================================================================== attaching and finishing
def _attentions(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(getattr(module, "k_proj", None), nn.Module) and isinstance(getattr(module, "v_proj", None),
                                                                                 nn.Module):
            yield name, module


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _cache_spec(config: Any, target: str) -> tuple[str, str] | None:
    """The first ``kv_cache_quant_config`` pattern matching ``target`` and its format, if any."""
    for pattern, entry in config.kv_cache_quant_config.items():
        if fnmatch.fnmatchcase(target, pattern):
            return pattern, entry
    return None


def _kv_heads(attention: nn.Module, projection: nn.Module, target: str) -> int:
    head_dim = getattr(attention, "head_dim", None)
    out = getattr(projection, "out_features", None)
    if not isinstance(head_dim, int) or not isinstance(out, int) or out % head_dim:
        raise ModelError(f"{target}: per-head cache scales need the attention's head_dim and a Linear projection")
    return out // head_dim


def kv_targets(model: nn.Module, config: Any, prefix: str = "") -> list[str]:
    """The key/value projections of ``model`` whose cache ``config`` quantizes (qualified names)."""
    found = []
    for name, _ in _attentions(model):
        for projection in ("k_proj", "v_proj"):
            target = f"{_qualified(prefix, name)}.{projection}"
            if _cache_spec(config, target) is not None:
                found.append(target)
    return found


def attach_kv_quantizers(model: nn.Module, config: Any, prefix: str = "") -> int:
    """Give each attention of ``model`` whose key/value projections ``config.kv_cache_quant_config`` names its
    KV quantizers (calibrating); ``prefix``: ``model``'s place in the whole model (a block). Returns how many
    attentions got them. An attention where only one of the two is named is refused: a cache with float keys
    and quantized values (or the reverse) is not what any consumer stores."""
    count = 0
    for name, attention in _attentions(model):
        where = _qualified(prefix, name)
        specs = {p: _cache_spec(config, f"{where}.{p}") for p in ("k_proj", "v_proj")}
        if all(spec is None for spec in specs.values()):
            continue
        if any(spec is None for spec in specs.values()):
            missing = next(p for p, spec in specs.items() if spec is None)
            raise ModelError(f"{where}.{missing}: kv_cache_quant_config names the other projection of this "
                             "attention but not this one; quantize both keys and values (e.g. '*k_proj', '*v_proj')")
        post = bool(config.kv_cache_post_rope)
        quantizers = []
        for projection, (pattern, entry) in specs.items():
            target = f"{where}.{projection}"
            fmt, per_head = kv_format(entry.output_tensors, f"kv_cache_quant_config[{pattern!r}].output_tensors",
                                      post_rope=post)
            module = getattr(attention, projection)
            heads = _kv_heads(attention, module, target) if per_head else None
            quantizers.append(KVCacheQuantizer(fmt, target, heads))
            if not post:
                module.add_module(PROJECTION_QUANTIZER, quantizers[-1])
                module.register_forward_hook(_quantize_output)
        if post:
            attention._kv_cache_keyword = _cache_keyword(attention)
            attention.add_module(KEY_QUANTIZER, quantizers[0])
            attention.add_module(VALUE_QUANTIZER, quantizers[1])
            attention.register_forward_pre_hook(_swap_cache, with_kwargs=True)
        count += 1
    return count


@dataclass(frozen=True)
class KVScales:
    """One attention's cache scales: ``key`` / ``value`` (0-d, or one per head), their format and projections."""

    attention: str
    fmt: str
    key: torch.Tensor
    value: torch.Tensor
    key_target: str
    value_target: str


def _pairs(model: nn.Module) -> Iterator[tuple[str, KVCacheQuantizer, KVCacheQuantizer]]:
    for name, attention in _attentions(model):
        k = getattr(attention, KEY_QUANTIZER, None) or getattr(attention.k_proj, PROJECTION_QUANTIZER, None)
        v = getattr(attention, VALUE_QUANTIZER, None) or getattr(attention.v_proj, PROJECTION_QUANTIZER, None)
        if isinstance(k, KVCacheQuantizer) and isinstance(v, KVCacheQuantizer):
            yield name, k, v


def _grouped(config: Any, target: str) -> bool:
    return any(fnmatch.fnmatchcase(target, pattern) for pattern in config.kv_cache_group)


def finish_kv_calibration(model: nn.Module, config: Any) -> None:
    """Scales from the observed maxima (shared within ``kv_cache_group``, floored at ``min_kv_scale``), and the
    quantizers of ``model`` switched from observing to quantizing. A quantizer no batch reached is an error."""
    tiny = torch.finfo(torch.float32).tiny
    for name, k, v in _pairs(model):
        if not (k.calibrating or v.calibrating):
            continue
        for quantizer in (k, v):
            if quantizer.seen == 0:
                raise ModelError(f"{quantizer.target}: no calibration batch reached the KV-cache quantizer; the "
                                 "attention must run during calibration (pass calibration data)")
        scales = [q.amax / KV_FORMATS[q.fmt] for q in (k, v)]
        if _grouped(config, k.target) and _grouped(config, v.target) and k.scale.shape == v.scale.shape:
            shared = torch.maximum(*scales)
            scales = [shared, shared]
        for quantizer, scale in zip((k, v), scales):
            floored = scale.clamp_min(max(float(config.min_kv_scale), tiny))
            if bool((floored > scale).any()) and config.min_kv_scale > 0:
                logger.warning("%s: cache scale raised to min_kv_scale=%g", quantizer.target, config.min_kv_scale)
            quantizer.scale.copy_(floored)
            quantizer.calibrating = False
        logger.debug("%s: k_scale %s, v_scale %s", name or "attention", k.scale.tolist(), v.scale.tolist())


@contextlib.contextmanager
def quantizers_disabled(quantizers: Iterable[StaticQuantizer]) -> Iterator[None]:
    """Within the block, ``quantizers`` pass their tensors through in float; each gets its own state back after."""
    quantizers = list(quantizers)
    states = [q.enabled for q in quantizers]
    for quantizer in quantizers:
        quantizer.enabled = False
    try:
        yield
    finally:
        for quantizer, state in zip(quantizers, states):
            quantizer.enabled = state


def kv_quantization_disabled(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``model``'s KV-cache quantizers pass keys and values through in float (the same model
    with a float cache: what the cache's quantization costs is the difference)."""
    return quantizers_disabled(m for m in model.modules() if isinstance(m, KVCacheQuantizer))


def kv_scales(model: nn.Module) -> list[KVScales]:
    """The calibrated cache scales of ``model``, one entry per quantized attention (names relative to it)."""
    found = []
    for name, k, v in _pairs(model):
        if k.calibrating or v.calibrating:
            raise ModelError(f"{name}: the KV-cache quantizers are not calibrated")
        if k.fmt != v.fmt:
            raise ModelError(f"{name}: keys ({k.fmt}) and values ({v.fmt}) of one cache in different formats")
        found.append(KVScales(name, k.fmt, k.scale.clone(), v.scale.clone(), k.target, v.target))
    return found


def kv_plan_lines(model: nn.Module, config: Any) -> list[str]:
    """What ``plan`` shows of the cache: the quantized key/value projections and how."""
    if not config.kv_cache_quant_config:
        return []
    where = "after RoPE (k_scale/v_scale as vLLM applies them)" if config.kv_cache_post_rope else \
        "on the k_proj/v_proj outputs, before RoPE (Quark's default)"
    lines = [f"KV cache: {len(kv_targets(model, config)) // 2} attention layers quantized {where}; "
             f"shared within {config.kv_cache_group or 'no group'}; min_kv_scale={config.min_kv_scale}"]
    for target in kv_targets(model, config):
        pattern, entry = _cache_spec(config, target)
        fmt, per_head = kv_format(entry.output_tensors, pattern, post_rope=bool(config.kv_cache_post_rope))
        lines.append(f"  {target}: {fmt} static, {'per head' if per_head else 'per tensor'} ({pattern})")
    return lines
