"""AMD Quark 0.13's own Hugging Face format (``quant_method: "quark"``), as its ``export_safetensors`` writes it
with the defaults ``weight_format="real_quantized"`` and ``pack_method="reorder"``.

Who reads it: transformers' Quark integration (``QuarkConfig`` / ``QuarkHfQuantizer``, with ``amd-quark``
installed) rebuilds every quantized Linear as Quark's ``QParamsLinear`` from ``config.json``'s
``quantization_config`` and loads the tensors below into it; vLLM's Quark loader reads the same config and
tensors (its W8A8 int8 and fp8 schemes). Nothing here imports Quark: the layout is written from Quark's
definitions (its ``QConfig.to_dict`` layout, its pack methods and its shape inference on import), and
``tests/export/hf/test_export_quark_format.py`` checks it byte by byte, with an optional load through amd-quark itself.

Per quantized Linear layer ``L`` (``out`` x ``in``), from the layer's exact codes
(:class:`~quark_brevitas.export.hf.folder.LayerCodes`; nothing is re-quantized):

- ``L.weight``: 4-bit codes packed eight to an int32, in Quark's "reorder" nibble order (nibble ``i`` of word
  ``c`` holds element ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]`` of the packed row), along the input dimension per
  tensor / per channel (``[out, in / 8]``) and, per group, of the *transposed* weight (``[in, out / 8]``);
  8-bit codes as int8 / uint8 (``[out, in]``, per group ``[in, out]``); fp8 e4m3 as ``float8_e4m3fn``.
- ``L.weight_scale``: float32, ``[]`` per tensor, ``[out]`` per channel, ``[in / group, out]`` per group.
- ``L.weight_zero_point`` (every integer weight, zero when symmetric: Quark's quantizer always has one):
  shaped like the scale, 4-bit ones packed like the weight (int32 ``[]``, ``[out / 8]``, ``[in / group, out / 8]``),
  8-bit ones int8 / uint8.
- static per-tensor inputs: ``L.input_scale`` float32 ``[]`` and, int8, ``L.input_zero_point`` int8 ``[]``;
  dynamic inputs store nothing (the consumer computes their scales: Quark divides a symmetric int8 range by
  127.5, ours by 127, so dynamic int8 logits agree within a quantization step, not bit for bit). Quark has no
  per-token scheme: dynamic per-token inputs are written as its fp8 "ptpc" template writes them, per channel along
  the token axis (``ch_axis=1`` of ``[batch, tokens, hidden]``; vLLM reads that as per token, Quark's own
  importer takes one scale per position across a batch).
- ``L.bias`` as the layer adds it (float).

Symmetric integer weights are written as ``int4`` / ``int8``; asymmetric ones as ``uint4`` / ``uint8`` (codes and
zero point shifted by ``2^(b-1)``: same differences), Quark's own choice for asymmetric weights.
``quantization_config`` holds the scheme of most layers as ``global_quant_config``, every other quantized layer
by its exact name in ``layer_quant_config`` and every float Linear in ``exclude`` (Quark matches both with
``fnmatch``; names are escaped).

What the format cannot hold is one :class:`~quark_brevitas.export.hf.folder.UnfitLayerError` naming the layer and
what fits: integer weights other than 4 / 8 bits (Quark's int2 / int3 layouts are not written), a 4-bit axis
Quark packs that is not a multiple of 8 (its importer infers ``size // 8``), and everything compressed-tensors
cannot hold either (output quantizers, MX / fp4 / fp6 / fp8 e5m2 weights, float zero points, partial groups).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from quark_brevitas.export.hf.folder import HFFormat, LayerCodes, TensorFormat, UnfitLayerError

__all__ = ["QUARK", "QUARK_VERSION", "exact_pattern", "pack_int4_reorder", "quark_config_dict", "quark_tensors",
           "tensor_config"]

#: The Quark release whose layout is written (``quantization_config.version``).
QUARK_VERSION = "0.13"
_FITS = ("Quark's format holds Linear layers with int4 / uint4 / int8 / uint8 weights (per tensor, per channel or "
         "per group of whole groups; 4-bit packed axes a multiple of 8) or fp8 e4m3 weights per tensor or per "
         "channel, optionally with int8 or fp8 e4m3 input activations (static per tensor, or dynamic per tensor "
         "or per token)")
#: Quark's "reorder" packing: nibble i (bits 4i..4i+3) of a word holds element ORDER[i] of its eight.
_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Quark has no per-token scheme: its dynamic per-token inputs are per channel along the token axis (its
#: fp8 "ptpc" template: ``ch_axis=1`` of ``[batch, tokens, hidden]``).
_QSCHEME = {"tensor": "per_tensor", "channel": "per_channel", "group": "per_group", "token": "per_channel"}
_OBSERVER = {"tensor": "PerTensorMinMaxObserver", "channel": "PerChannelMinMaxObserver",
             "group": "PerGroupMinMaxObserver", "token": "PerChannelMinMaxObserver"}
_EXPORT = {"weight_merge_groups": None, "kv_cache_group": [], "min_kv_scale": 0.0, "weight_format": "real_quantized",
           "pack_method": "reorder"}


def _refuse(name: str, why: str) -> UnfitLayerError:
    return UnfitLayerError(name, why, _FITS)


# ===================================================================== packing
def pack_int4_reorder(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (``[rows, cols]``, ``cols`` a multiple of 8, values in ``[-8, 15]``) packed into int32
    ``[rows, cols / 8]`` in Quark's "reorder" nibble order; negative codes keep their low four bits."""
    rows, cols = codes.shape
    nibbles = (codes.to(torch.int64) & 0xF).reshape(rows, cols // 8, 8)[:, :, list(_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # disjoint bits: the sum is the OR
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """A 0-, 1- or 2-dimensional 4-bit tensor as Quark packs it (a scalar is stored as int32 unpacked)."""
    if codes.ndim == 0:
        return codes.to(torch.int32)
    if codes.ndim == 1:
        return pack_int4_reorder(codes.reshape(1, -1)).reshape(-1)
    return pack_int4_reorder(codes)


# ===================================================================== one layer
def _dtype(fmt: TensorFormat) -> str:
    if fmt.type == "float":
        return "fp8_e4m3"
    return f"{'int' if fmt.symmetric else 'uint'}{fmt.num_bits}"


def _check(entry: LayerCodes) -> None:
    """Refuse what compressed-tensors' reading holds but Quark's format does not."""
    weight, (out_features, in_features) = entry.weight, entry.codes.shape
    if weight.type == "int" and weight.num_bits not in (4, 8):
        raise _refuse(entry.name, f"{weight.num_bits}-bit integer weights (only 4 and 8 bits are written)")
    if weight.type == "int" and weight.num_bits == 4:
        packed = {"group": ("output", out_features), "channel": ("input", in_features),
                  "tensor": ("input", in_features)}
        axes = [packed[weight.strategy]] + ([("output", out_features)] if weight.strategy == "channel" else [])
        for axis, size in axes:
            if size % 8:
                raise _refuse(entry.name, f"{size} {axis} channels are not a multiple of 8 (Quark packs 4-bit "
                                          f"codes eight to an int32 along that axis)")


def _weight_tensors(entry: LayerCodes) -> dict[str, torch.Tensor]:
    weight = entry.weight
    if weight.type == "float":
        scale = entry.scale.float().reshape(() if weight.strategy == "tensor" else (-1,))
        return {"weight": entry.codes.contiguous(), "weight_scale": scale.contiguous()}
    shift = 0 if weight.symmetric else 1 << (weight.num_bits - 1)
    codes = entry.codes.to(torch.int16) + shift
    zero = (entry.zero_point.to(torch.int16) + shift if entry.zero_point is not None
            else torch.zeros(entry.scale.shape, dtype=torch.int16))
    scale = entry.scale.float()
    if weight.strategy == "group":  # Quark transposes per-group weights, scales and zero points
        codes, scale, zero = codes.t(), scale.t(), zero.t()
    elif weight.strategy == "channel":
        scale, zero = scale.reshape(-1), zero.reshape(-1)
    else:
        scale, zero = scale.reshape(()), zero.reshape(())
    if weight.num_bits == 4:
        codes, zero = pack_int4_reorder(codes.contiguous()), _pack_4bit(zero.contiguous())
    else:
        storage = torch.int8 if weight.symmetric else torch.uint8
        codes, zero = codes.to(storage), zero.to(storage)
    return {"weight": codes.contiguous(), "weight_scale": scale.contiguous(), "weight_zero_point": zero.contiguous()}


def quark_tensors(entry: LayerCodes) -> dict[str, torch.Tensor]:
    """The layer's tensors under Quark's names (without the layer prefix); see the module docstring."""
    tensors = _weight_tensors(entry)
    if entry.input_scale is not None:
        tensors["input_scale"] = entry.input_scale.float().reshape(())
        if entry.activation is not None and entry.activation.type == "int":
            zero = entry.input_zero_point if entry.input_zero_point is not None else torch.zeros(1)
            tensors["input_zero_point"] = zero.to(torch.int8).reshape(())
    if entry.bias is not None:
        tensors["bias"] = entry.bias.contiguous()
    return tensors


# ===================================================================== quantization_config
def tensor_config(fmt: TensorFormat, weight: bool) -> dict[str, Any]:
    """One ``QTensorConfig.to_dict()`` as Quark 0.13 writes it."""
    integer = fmt.type == "int"
    ch_axis = {"group": -1, "channel": 0, "token": 1}.get(fmt.strategy)
    return {"dtype": "int8" if integer and not weight else _dtype(fmt), "is_dynamic": fmt.dynamic,
            "qscheme": _QSCHEME[fmt.strategy], "ch_axis": ch_axis,
            "group_size": fmt.group_size if fmt.strategy == "group" else None, "block_size": None,
            "symmetric": fmt.symmetric, "round_method": "half_even", "scale_type": "float",
            "zero_point_type": "int32", "scale_format": None, "scale_calculation_mode": None,
            "mx_element_dtype": None, "observer_cls": _OBSERVER[fmt.strategy], "is_scale_quant": False,
            "enable_buffer_reuse": False, "max_input_numel": 4 * 1024 * 1024}


def _layer_config(entry: LayerCodes) -> dict[str, Any]:
    """One ``QLayerConfig.to_dict()``."""
    inputs = tensor_config(entry.activation, weight=False) if entry.activation is not None else None
    return {"input_tensors": inputs, "output_tensors": None, "weight": tensor_config(entry.weight, weight=True),
            "bias": None, "target_device": None}


def exact_pattern(name: str) -> str:
    """A layer name as an ``fnmatch`` pattern that matches only it."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def quark_config_dict(entries: list[LayerCodes], float_linears: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: Quark's ``QConfig.to_dict()`` plus its ``export`` section."""
    configs = {entry.name: _layer_config(entry) for entry in entries}
    keys = {name: repr(sorted(config.items(), key=str)) for name, config in configs.items()}
    common = Counter(keys.values()).most_common(1)[0][0]
    global_config = next(configs[name] for name, key in keys.items() if key == common)
    layers = {exact_pattern(name): configs[name] for name, key in keys.items() if key != common}
    exclude = [exact_pattern(name) for name in float_linears]
    return {"global_quant_config": global_config, "exclude": exclude, "algo_config": None,
            "softmax_quant_spec": None, "quant_method": "quark", "layer_type_quant_config": {},
            "layer_quant_config": layers, "kv_cache_quant_config": {}, "kv_cache_post_rope": False,
            "quant_mode": "eager_mode", "version": QUARK_VERSION, "export": dict(_EXPORT)}


#: AMD Quark's format as an :class:`~quark_brevitas.export.hf.folder.HFFormat`.
QUARK = HFFormat("quark", _FITS, quark_tensors, quark_config_dict, _check)
