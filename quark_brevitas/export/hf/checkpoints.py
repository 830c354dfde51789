"""Hugging Face checkpoints that other libraries load: the compressed-tensors format (transformers, vLLM), and the
one writer every such format goes through (AMD Quark's format is a strategy beside it: :mod:`~.quark_hf`).

:func:`export_safetensors` writes a quantized Hugging Face model as a folder that
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads with the ``compressed-tensors`` package and
without quark_brevitas: ``config.json`` with a ``quantization_config`` built from compressed-tensors' own
pydantic models (``QuantizationConfig`` / ``QuantizationScheme`` / ``QuantizationArgs``, so the package
validates what it will read), ``model.safetensors`` (or one shard per block plus an index, for a streamed
checkpoint) and the tokenizer when one is given.

Why the weights are exact: every quantized Linear layer's integer (or fp8) codes, scales and zero points are read
from the quantized model (:func:`~quark_brevitas.export.intweights.integer_weights` per tensor / per channel,
:func:`~quark_brevitas.export.onnx.blocked.plan_weights` per group; both prove ``(codes - zero_point) * scale`` equals
the layer's quantized weight bit for bit) and only re-encoded: unsigned codes ``u`` with zero point ``z`` become
compressed-tensors' signed ``u - 2^(b-1)`` and ``z - 2^(b-1)`` (same differences), then packed with the package's
own ``pack_to_int32``. Nothing is re-quantized, so the weight the consumer dequantizes is ours.

Storage per layer (as compressed-tensors' compressors lay it out):

- ``pack-quantized`` (int weights of 1..8 bits without int8 activations): ``weight_packed`` int32,
  ``weight_shape`` int64 ``[out, in]``, ``weight_scale`` (``[1]``, ``[out, 1]`` or ``[out, in / group]``) and,
  asymmetric, ``weight_zero_point`` packed along the output dimension (per channel / group) or int8 ``[1]``;
- ``int-quantized`` (int8 weights with int8 activations): ``weight`` int8, ``weight_scale``, ``weight_zero_point``
  when asymmetric, ``input_scale`` / ``input_zero_point`` for static activations;
- ``naive-quantized`` for asymmetric per-channel / per-group int weights below 8 bits (``weight`` int8 codes,
  ``weight_zero_point`` int8 ``[out, groups]``): compressed-tensors 0.20's loader in transformers allocates an
  unpacked zero point for ``pack-quantized`` and then unpacks it, so neither packed nor unpacked zero points load
  there (``pack_asymmetric=True`` writes the packed layout anyway, for vLLM);
- ``float-quantized`` / ``naive-quantized`` (fp8 e4m3 weights with / without fp8 activations): ``weight``
  ``float8_e4m3fn`` and ``weight_scale`` (``input_scale`` for static fp8 activations).

What the format cannot hold is an :class:`~quark_brevitas.export.errors.ExportError` naming the layer and the
formats that fit: quantized layers other than Linear, output quantizers, MX / fp6 / fp4 / fp8 e5m2 / FNUZ
weights, more than 8 bits, float zero points, per-channel or per-group static activations.

Activations: static per-tensor int8 / fp8 inputs are written with their calibrated scale (and zero point), dynamic
ones as ``dynamic: true`` (per tensor or per token); the consumer computes dynamic scales itself, with its own
formula. compressed-tensors' reference (what transformers runs on CPU) divides a symmetric int8 range by 127.5,
ours and vLLM's int8 kernels by 127 (narrow range), so dynamic int8 logits agree within a quantization step,
not bit for bit; static ones agree to float rounding (see ``tests/export/hf/test_compressed_tensors.py``).

:func:`quark_brevitas.hf.export_streamed.export_safetensors_streamed` writes the same folder from a
block-by-block checkpoint (:func:`~quark_brevitas.hf.streaming.quantize_pretrained`) one block at a time: the
float model is never built and at most one quantized block is in memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from brevitas.quant_tensor import FloatQuantTensor, IntQuantTensor
from torch import nn

from quark_brevitas.brevitas_adapter import (
    QuantLayer,
    is_dynamic_activation,
    is_float_quantizer,
    is_groupwise,
    plain_tensor,
)
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.errors import ExportArgumentError, ExportError
from quark_brevitas.export.hf.attention_scales import add_attention
from quark_brevitas.export.hf.folder import (
    HFFormat,
    LayerCodes,
    TensorFormat,
    UnfitLayerError,
    config_json,
    untie,
    write_tokenizer,
)
from quark_brevitas.export.hf.kv_scales import add_kv_cache
from quark_brevitas.export.hf.models import refuse_online_rotations
from quark_brevitas.export.hf.quark import QUARK
from quark_brevitas.export.readback import records_of, verify_safetensors_file, verify_text_file
from quark_brevitas.extras import require
from quark_brevitas.outputs import output_dir as _output_folder

__all__ = ["COMPRESSED_TENSORS", "FORMATS", "LayerCodes", "check_export_args", "collect_tensors", "config_json",
           "check_layer_fits", "export_safetensors", "hf_format", "layer_codes", "quantization_config_dict", "untie",
           "write_tokenizer"]

logger = logging.getLogger(__name__)

#: The formats :func:`export_safetensors` writes.
FORMATS = ("compressed-tensors", "quark")
_WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_FITS = ("compressed-tensors holds Linear layers with int1..int8 weights (per tensor, per channel or per group; "
         "symmetric or asymmetric with an integer zero point) or fp8 e4m3 (OCP) weights per tensor or per channel, "
         "and optionally int8 or fp8 e4m3 input activations (static per tensor, or dynamic per tensor / per token)")


def _refuse(name: str, why: str) -> UnfitLayerError:
    return UnfitLayerError(name, why, _FITS)


# ===================================================================== reading a layer
def _signed_codes(name: str, codes: torch.Tensor, zero_point: torch.Tensor, bits: int,
                  signed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our codes and zero point in compressed-tensors' signed range (``[-2^(b-1), 2^(b-1) - 1]``); ``None`` as
    zero point when it is zero everywhere (symmetric)."""
    if bits > 8:
        raise _refuse(name, f"{bits}-bit weights do not fit int8 storage")
    if not torch.equal(zero_point.float(), torch.round(zero_point.float())):
        raise _refuse(name, "a float zero point (zero_point_type float32) has no integer form")
    shift = 0 if signed else 1 << (bits - 1)
    codes = codes.to(torch.int16) - shift
    zero = zero_point.to(torch.int16) - shift
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for what, tensor in (("codes", codes), ("zero point", zero)):
        if tensor.numel() and (tensor.min() < low or tensor.max() > high):
            raise _refuse(name, f"weight {what} fall outside the signed {bits}-bit range")
    if signed and not bool(zero.any()):
        return codes.to(torch.int8), None
    return codes.to(torch.int8), zero.to(torch.int8)


def _group_weight(name: str, layer: nn.Module) -> tuple[TensorFormat, torch.Tensor, torch.Tensor,
                                                        torch.Tensor | None]:
    """Per-group int weights: codes, ``[out, groups]`` scales and zero points, proven exact by the blocked plan."""
    from quark_brevitas.export.onnx.blocked import plan_weights

    proxy = layer.weight_quant
    if is_float_quantizer(proxy):
        raise _refuse(name, "MX / per-group minifloat weights (fp8, fp6, fp4 per group) are not written")
    try:
        plan = plan_weights(layer, ["weight_quant"])[0]
    except QuarkBrevitasError as exc:
        raise _refuse(name, str(exc)) from exc
    if plan.axis != 1 or plan.codes.ndim != 2:
        raise _refuse(name, "groups along the output channels are not written (only along the input channels)")
    if plan.codes.shape[1] % int(plan.block_size):
        # compressed-tensors (0.20) dequantizes whole groups only: transformers fails to load a last partial group
        raise _refuse(name, f"{plan.codes.shape[1]} input channels are not whole groups of {int(plan.block_size)} "
                            "(compressed-tensors and Quark read whole groups only; exclude the layer or pick a group "
                            "size that divides its input channels)")
    bits, signed = int(proxy.bit_width()), bool(proxy.is_signed)
    zero = torch.from_numpy(plan.zero_point) if plan.zero_point is not None else torch.zeros(plan.scale.shape)
    codes, zero_point = _signed_codes(name, torch.from_numpy(plan.codes), zero, bits, signed)
    scale = torch.from_numpy(plan.scale).to(layer.weight.dtype if layer.weight.dtype.is_floating_point
                                            else torch.float32)
    fmt = TensorFormat("int", bits, zero_point is None, "group", int(plan.block_size))
    return fmt, codes, scale, zero_point


def _plain_weight(name: str, layer: nn.Module) -> tuple[TensorFormat, torch.Tensor, torch.Tensor,
                                                        torch.Tensor | None]:
    """Per-tensor / per-channel int or fp8 weights, from :func:`~quark_brevitas.export.intweights.integer_weights`."""
    from quark_brevitas.export.intweights import integer_weights

    entry = next(iter(integer_weights(layer).values()))
    out_features = entry.int_weight.shape[0]
    if entry.axis not in (None, 0):
        raise _refuse(name, f"weight scales along axis {entry.axis} are not written (only per tensor or per output "
                            "channel)")
    strategy = "tensor" if entry.axis is None else "channel"
    shape = (1,) if entry.axis is None else (out_features, 1)
    scale = entry.scale.reshape(shape)
    if entry.exponent_bit_width is not None:
        if entry.int_weight.dtype != torch.float8_e4m3fn:
            raise _refuse(name, f"{entry.format} weights (only fp8 e4m3 OCP has a compressed-tensors type)")
        return TensorFormat("float", 8, True, strategy), entry.int_weight, scale, None
    codes, zero_point = _signed_codes(name, entry.int_weight, entry.zero_point.reshape(-1), entry.bit_width,
                                      entry.signed)
    if zero_point is not None:
        zero_point = (zero_point.reshape(shape) if zero_point.numel() > 1
                      else zero_point.reshape(1).expand(shape).contiguous())
    return TensorFormat("int", entry.bit_width, zero_point is None, strategy), codes, scale, zero_point


def _activation(name: str, layer: nn.Module) -> tuple[TensorFormat | None, torch.Tensor | None,
                                                      torch.Tensor | None]:
    """The input quantizer's format and, static, its scale and zero point (``[1]`` each), probed with a
    ``[2, 3, in]`` input: a dynamic per-token quantizer returns one scale per token."""
    proxy = layer.input_quant
    if not proxy.is_quant_enabled:
        return None, None, None
    if is_groupwise(proxy):
        raise _refuse(name, "per-group / MX input activations are not written")
    dynamic = is_dynamic_activation(proxy)
    probe = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(layer.weight.dtype if layer.weight.dtype.is_floating_point else torch.float32)
    with torch.no_grad():
        qt = proxy(probe)
    scale = qt.scale.detach()
    per_token = scale.numel() == 6 and scale.shape[-1] == 1
    if scale.numel() != 1 and not (dynamic and per_token):
        raise _refuse(name, f"input scales of shape {list(scale.shape)} (only per-tensor, or dynamic per-token)")
    strategy = "token" if per_token else "tensor"
    if isinstance(qt, FloatQuantTensor):
        e, m, bias = (int(round(float(v))) for v in (qt.exponent_bit_width, qt.mantissa_bit_width, qt.exponent_bias))
        if (e, m, bias) != (4, 3, 7) or not getattr(proxy, "is_ocp", False):
            raise _refuse(name, f"fp{1 + e + m} e{e}m{m} input activations (only fp8 e4m3 OCP)")
        fmt = TensorFormat("float", 8, True, strategy, dynamic=dynamic)
        return fmt, (None if dynamic else scale.reshape(1).float()), None
    if not isinstance(qt, IntQuantTensor):
        raise _refuse(name, f"input quantizer returned a {type(qt).__name__}")
    bits, signed = int(round(float(qt.bit_width))), bool(qt.signed)
    if bits != 8:
        raise _refuse(name, f"{bits}-bit input activations (only 8-bit)")
    if dynamic:
        return TensorFormat("int", 8, signed, strategy, dynamic=True), None, None
    zero = qt.zero_point.detach().reshape(1)
    _, zero_point = _signed_codes(name, torch.zeros(1, dtype=torch.int16), zero, 8, signed)
    return TensorFormat("int", 8, zero_point is None, "tensor"), scale.reshape(1).float(), zero_point


def _bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias the layer adds: float, or its quantized value (the output for a zero input, whose quantized
    input and weight product is exactly zero)."""
    if layer.bias is None:
        return None
    if not layer.bias_quant.is_quant_enabled:
        return layer.bias.detach().clone()
    with torch.no_grad():
        out = plain_tensor(layer(torch.zeros(1, layer.in_features, dtype=layer.bias.dtype)))
    return out.reshape(-1).detach().clone()


def layer_codes(name: str, layer: nn.Module) -> LayerCodes:
    """What compressed-tensors stores for the quantized Linear ``layer`` (called ``name``), checked exact:
    :meth:`LayerCodes.dequantize` equals the layer's quantized weight (``torch.equal``)."""
    if not isinstance(layer, nn.Linear) or not isinstance(layer, QuantLayer):
        raise _refuse(name, f"{type(layer).__name__} layers are not written (only Linear)")
    if layer.output_quant.is_quant_enabled:
        raise _refuse(name, "output quantizers are not written (compressed-tensors applies them to the layer's "
                            "output, which our models quantize elsewhere)")
    if not layer.weight_quant.is_quant_enabled:
        raise _refuse(name, "a layer with quantized inputs but a float weight")
    reader = _group_weight if is_groupwise(layer.weight_quant) else _plain_weight
    fmt, codes, scale, zero_point = reader(name, layer)
    activation, input_scale, input_zero_point = _activation(name, layer)
    entry = LayerCodes(name, fmt, codes, scale, zero_point, activation, input_scale, input_zero_point, _bias(layer))
    with torch.no_grad():
        expected = layer.quant_weight().value.detach().float()
    if not torch.equal(entry.dequantize(), expected):
        worst = float((entry.dequantize() - expected).abs().max())
        raise ExportError(f"layer '{name}': its exported weight differs from the quantized weight by "
                          f"{worst:.3g}; please report this")
    return entry


# ===================================================================== compressed-tensors encoding
def _format_name(entry: LayerCodes) -> str:
    if entry.weight.type == "float":
        return "float-quantized" if entry.activation is not None else "naive-quantized"
    if entry.activation is not None and entry.activation.type == "float":
        return "naive-quantized"
    if entry.activation is not None and entry.weight.num_bits == 8:
        return "int-quantized"
    if entry.zero_point is not None and entry.weight.strategy in ("group", "channel") and not entry.pack_zero_point:
        return "naive-quantized"  # see the module docstring: transformers cannot load packed zero points
    return "pack-quantized"


def _ct_tensors(entry: LayerCodes) -> dict[str, torch.Tensor]:
    """The layer's tensors under compressed-tensors' parameter names (without the layer prefix)."""
    pack_to_int32 = require("compressed_tensors.compressors.pack_quantized.helpers",
                            "export_safetensors(format='compressed-tensors')").pack_to_int32
    fmt = _format_name(entry)
    tensors: dict[str, torch.Tensor] = {"weight_scale": entry.scale.contiguous()}
    if fmt == "pack-quantized":
        tensors["weight_packed"] = pack_to_int32(entry.codes, entry.weight.num_bits)
        tensors["weight_shape"] = torch.tensor(list(entry.codes.shape))
        if entry.zero_point is not None:
            packed = entry.weight.strategy in ("group", "channel")
            tensors["weight_zero_point"] = (pack_to_int32(entry.zero_point, entry.weight.num_bits, packed_dim=0)
                                            if packed else entry.zero_point).contiguous()
    else:
        tensors["weight"] = entry.codes.contiguous()
        if entry.zero_point is not None:
            tensors["weight_zero_point"] = entry.zero_point.contiguous()
    if entry.input_scale is not None:
        tensors["input_scale"] = entry.input_scale.to(entry.scale.dtype).contiguous()
    if entry.input_zero_point is not None:
        tensors["input_zero_point"] = entry.input_zero_point.contiguous()
    if entry.bias is not None:
        tensors["bias"] = entry.bias.contiguous()
    return tensors


def _scheme_key(entry: LayerCodes) -> str:
    return json.dumps([entry.weight.args() | {"zp_dtype": None},
                       entry.activation.args() | {"zp_dtype": None} if entry.activation else None,
                       _format_name(entry)], sort_keys=True, default=str)


def quantization_config_dict(entries: list[LayerCodes], float_linears: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``, validated by compressed-tensors' own models; laid out as its
    ``ModelCompressor.update_config`` writes it."""
    ct = require("compressed_tensors", "export_safetensors(format='compressed-tensors')")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups: dict[str, list[LayerCodes]] = {}
    for entry in entries:
        groups.setdefault(_scheme_key(entry), []).append(entry)
    formats = sorted({_format_name(members[0]) for members in groups.values()})
    config_groups = {}
    for index, members in enumerate(groups.values()):
        first = members[0]
        targets = ["Linear"] if len(groups) == 1 else [f"re:^{re.escape(m.name)}$" for m in members]
        config_groups[f"group_{index}"] = QuantizationScheme(
            targets=targets, weights=QuantizationArgs(**first.weight.args()),
            input_activations=QuantizationArgs(**first.activation.args()) if first.activation else None,
            format=_format_name(first))
    config = QuantizationConfig(config_groups=config_groups, quantization_status="compressed",
                                format=formats[0] if len(formats) == 1 else "mixed-precision",
                                ignore=float_linears if len(groups) == 1 else [])
    return {"version": ct.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
            "transform_config": {}, **config.model_dump(exclude={"quant_method"})}


#: compressed-tensors as an :class:`~quark_brevitas.export.hf.folder.HFFormat` (every layer layer_codes reads fits).
COMPRESSED_TENSORS = HFFormat("compressed-tensors", _FITS, _ct_tensors, quantization_config_dict)


def hf_format(name: str) -> HFFormat:
    """The format called ``name`` (one of :data:`FORMATS`)."""
    formats = {"compressed-tensors": COMPRESSED_TENSORS, "quark": QUARK}
    if name not in formats:
        raise ExportError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {name!r}")
    return formats[name]


# ===================================================================== walking a model
def _is_ours(module: nn.Module) -> bool:
    root = type(module).__module__.partition(".")[0]
    return root in ("brevitas", "quark_brevitas")


def _layer_entry(name: str, layer: nn.Module, fmt: HFFormat) -> LayerCodes:
    """The layer's exact codes, refused in ``fmt``'s words when ``fmt`` cannot hold them."""
    try:
        entry = layer_codes(name, layer)
    except UnfitLayerError as exc:
        if fmt.fits == _FITS:
            raise
        raise fmt.refuse(exc.layer, exc.why) from exc
    fmt.check(entry)
    return entry


def check_layer_fits(name: str, layer: nn.Module, format: str) -> None:
    """Raise the :class:`ExportError` the writer of ``format`` raises for the quantized ``layer`` (called ``name``),
    if any: the same per-layer function, for the checks made before calibration
    (:mod:`quark_brevitas.hf.plan_checks`)."""
    _layer_entry(name, layer, hf_format(format))


def collect_tensors(model: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], entries: list[LayerCodes],
             float_linears: list[str], skip: str | None = None, pack_asymmetric: bool = False,
             fmt: HFFormat = COMPRESSED_TENSORS) -> None:
    """Add ``model``'s tensors (names prefixed) to ``tensors``: quantized Linear layers in ``fmt``'s layout
    (default compressed-tensors), every other parameter and persistent buffer as it is. ``skip``: a submodule
    written elsewhere."""
    handled: set[str] = set()
    for name, module in model.named_modules():
        full = prefix + name
        if skip is not None and (name == skip or name.startswith(skip + ".")):
            continue
        if any(name.startswith(h + ".") for h in handled):
            continue
        if isinstance(module, QuantLayer):
            if not module.weight_quant.is_quant_enabled and not module.input_quant.is_quant_enabled \
                    and not module.output_quant.is_quant_enabled and isinstance(module, nn.Linear):
                float_linears.append(full)
            else:
                entry = _layer_entry(full, module, fmt)
                entry.pack_zero_point = pack_asymmetric
                entries.append(entry)
                tensors.update({f"{full}.{k}": v for k, v in fmt.encode(entry).items()})
                handled.add(name)
                continue
        elif _is_ours(module) and any(True for _ in module.parameters(recurse=False)):
            raise fmt.refuse(full, f"{type(module).__name__} (a quantization module of ours) is not a layer of the "
                                "Hugging Face model")
        elif type(module) is nn.Linear:
            float_linears.append(full)
        local_buffers = getattr(module, "_non_persistent_buffers_set", set())
        for key, tensor in module.named_parameters(recurse=False):
            tensors[f"{full}.{key}" if full else key] = tensor.detach()
        for key, tensor in module.named_buffers(recurse=False):
            if key not in local_buffers and tensor is not None:
                tensors[f"{full}.{key}" if full else key] = tensor.detach()


#: Checkpoint names of unfused experts' layers (quark_brevitas.model_parts.moe) where a family's checkpoints spell them
#: otherwise: transformers 5.x fuses per-expert tensors into its 3-D parameters on load only from the names its
#: weight converters know (Mixtral's ``experts.N.w1`` / ``w3`` / ``w2``; Qwen2/3-MoE's are the unfused names).
_EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
_EXPERT_LAYER = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(?=\.|$)")


def checkpoint_names(hf_config: Any, tensors: dict[str, torch.Tensor], entries: list[LayerCodes],
                     float_linears: list[str]) -> dict[str, torch.Tensor]:
    """Rename, in place for ``entries`` and ``float_linears``, what :func:`collect_tensors` gathered to the names
    the family's checkpoints use (:data:`_EXPERT_NAMES`; nothing changes for most families, and a name already
    renamed stays as it is); returns the tensors renamed."""
    names = _EXPERT_NAMES.get(getattr(hf_config, "model_type", None))
    if names is None:
        return tensors

    def rename(name: str) -> str:
        return _EXPERT_LAYER.sub(lambda m: m.group(1) + names[m.group(2)], name)

    for entry in entries:
        entry.name = rename(entry.name)
    float_linears[:] = [rename(name) for name in float_linears]
    return {rename(key): value for key, value in tensors.items()}


def check_export_args(format: str, output_dir_: Any, pack_asymmetric: bool = False) -> tuple[HFFormat, Path]:
    """The format asked for and the output folder, checked before any work."""
    fmt = hf_format(format)
    if not isinstance(output_dir_, str | os.PathLike):
        raise ExportArgumentError(f"output_dir must be a path, got {type(output_dir_).__name__}")
    if pack_asymmetric and fmt is not COMPRESSED_TENSORS:
        raise ExportError(f"pack_asymmetric applies to format 'compressed-tensors' only, got format {format!r} "
                          "(Quark's format always packs 4-bit zero points)")
    return fmt, Path(output_dir_)


def export_safetensors(quant_model: nn.Module, output_dir: str | os.PathLike[str], format: str = "compressed-tensors",
                       tokenizer: Any = None, *, overwrite: bool = False, pack_asymmetric: bool = False) -> Path:
    """Write the quantized Hugging Face model ``quant_model`` as a checkpoint others load (see the module
    docstring): ``config.json`` with its ``quantization_config``, ``model.safetensors`` and the tokenizer.

    ``format``: ``"compressed-tensors"`` (transformers / vLLM with the ``compressed-tensors`` package) or
    ``"quark"`` (AMD Quark 0.13's own layout, as its ``export_safetensors`` writes it: transformers with
    ``amd-quark`` installed, vLLM's Quark loader; see :mod:`quark_brevitas.export.hf.quark`).

    ``pack_asymmetric``: asymmetric per-channel / per-group int weights below 8 bits are written as
    ``naive-quantized`` (int8 codes, int8 zero points) by default, because transformers with compressed-tensors
    0.20 cannot load them packed (it allocates an unpacked zero point, then unpacks it); ``True`` writes
    llm-compressor's ``pack-quantized`` layout (packed zero points), which vLLM's int4 kernels read.

    The folder is written atomically (:mod:`quark_brevitas.outputs`): it holds the old files or the new ones.
    Returns its path. Raises :class:`ExportError` naming the first layer the format cannot hold.
    """
    fmt, directory = check_export_args(format, output_dir, pack_asymmetric)
    if not isinstance(quant_model, nn.Module):
        raise ExportArgumentError(f"quant_model must be a torch.nn.Module, got {type(quant_model).__name__}")
    hf_config = getattr(quant_model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise ExportArgumentError(f"quant_model must be a quantized Hugging Face model (with .config), got "
                                  f"{type(quant_model).__name__}")
    refuse_online_rotations(quant_model, format)
    tensors: dict[str, torch.Tensor] = {}
    entries: list[LayerCodes] = []
    float_linears: list[str] = []
    collect_tensors(quant_model, "", tensors, entries, float_linears, pack_asymmetric=pack_asymmetric, fmt=fmt)
    tensors = checkpoint_names(hf_config, tensors, entries, float_linears)
    if not entries:
        raise ExportError(f"{type(quant_model).__name__} has no quantized Linear layer to write")
    quantization_config = fmt.quantization_config(entries, float_linears)
    add_kv_cache(quant_model, fmt.name, tensors, quantization_config)
    add_attention(quant_model, fmt.name, tensors, quantization_config)
    with _output_folder(directory, overwrite=overwrite) as work:
        from safetensors.torch import save_file

        kept = untie(tensors)
        save_file(kept, str(work / _WEIGHTS_FILE), metadata={"format": "pt"})
        config_text = config_json(hf_config, quantization_config, type(quant_model).__name__)
        (work / "config.json").write_text(config_text)
        write_tokenizer(tokenizer, work, directory)  # copied files are read back against their source
        # the files are complete: read them back (safetensors' reader) before the folder is moved into place
        verify_safetensors_file(work / _WEIGHTS_FILE, directory / _WEIGHTS_FILE, records_of(kept))
        verify_text_file(work / "config.json", directory / "config.json", config_text)
    logger.info("Wrote %s (%s, %d quantized layers)", directory, format, len(entries))
    return directory
