"""Storage of a model under a config, from the plan: weight bits per layer, average weight bits, bytes.

One function counts a layer (:func:`layer_storage`); :func:`model_size` applies it to every row of the plan
(:meth:`~quark_brevitas.api.ModelQuantizer.plan`, so the hierarchy, ``exclude`` and the ``dtype`` short forms
are resolved exactly as quantization resolves them) and adds the model's other parameters and buffers.

What a quantized weight tensor stores (the deployment view, not the ONNX file, which keeps int2-4 per-channel
weights in int8):

- every element at ``bit_width`` bits (a minifloat's total width);
- one scale per tensor (``per_tensor``), per output channel (``per_channel``) or per group of ``group_size``
  input channels (``per_group``; a last, shorter group counts as one): 32 bits for float scales, 8 bits for
  power-of-two scales (the exponent; OCP MX's E8M0);
- asymmetric int formats: one zero point per scale, ``bit_width`` bits (``zero_point_type=float32``: 32 bits).

A weight left in float counts its dtype's bits (32 for float32). A bias with a bias spec counts ``bit_width``
bits per element (its scale is input scale x weight scale: nothing stored), otherwise its dtype's bits.
"Weights" of a layer are its parameters with two or more dimensions (a Linear's or a convolution's ``weight``,
an attention's ``in_proj_weight`` and ``out_proj.weight``); its other parameters are biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quark_brevitas.api import ModelQuantizer
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec
from quark_brevitas.config.enums import QSchemeType, QuantType, ScaleType, ZeroPointType
from quark_brevitas.container import Container

__all__ = ["LayerStorage", "ModelSize", "layer_storage", "model_size", "tensor_bits"]

_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class LayerStorage:
    """One quantizable layer: ``weights`` elements stored in ``weight_bits`` bits (scales and zero points
    included), biases in ``bias_bits``; ``spec`` is the weight format (``float`` if not quantized)."""

    name: str
    module_type: str
    weights: int
    weight_bits: int
    bias_bits: int
    spec: str

    @property
    def average_weight_bits(self) -> float:
        return self.weight_bits / self.weights if self.weights else 0.0


@dataclass(frozen=True)
class ModelSize:
    """The model under a config: its quantizable layers, and the bits of everything else (float)."""

    layers: list[LayerStorage]
    other_bits: int

    @property
    def weights(self) -> int:
        return sum(layer.weights for layer in self.layers)

    @property
    def average_weight_bits(self) -> float:
        """Bits per weight element over every quantizable layer (float layers included)."""
        return sum(layer.weight_bits for layer in self.layers) / self.weights if self.weights else 0.0

    @property
    def total_bytes(self) -> float:
        """Every parameter and buffer of the model, in bytes."""
        bits = sum(layer.weight_bits + layer.bias_bits for layer in self.layers) + self.other_bits
        return bits / 8


def _float_bits(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size() * 8


def tensor_bits(tensor: torch.Tensor, spec: QuantizationSpec | None, *, transposed: bool = False,
                groups: int = 1) -> int:
    """Bits one weight tensor takes under ``spec`` (``None``: float); see the module docstring.

    The output-channel axis is 0 (``transposed``: 1, times the convolution's ``groups``), the input-channel
    axis along which groups are formed is 1 (``transposed``: 0).
    """
    if spec is None:
        return _float_bits(tensor)
    spec = spec.resolved()
    numel = tensor.numel()
    if spec.qscheme is QSchemeType.per_tensor:
        scales = 1
    elif spec.qscheme is QSchemeType.per_channel:
        scales = tensor.shape[1] * groups if transposed else tensor.shape[0]
    else:
        axis = 0 if transposed else 1
        size = tensor.shape[axis]
        scales = numel // size * math.ceil(size / spec.group_size)
    scale_bits = 8 if spec.scale_type in (ScaleType.pof2, ScaleType.pof2_round) else 32
    zero_point_bits = 0
    if spec.quant_type is QuantType.int_quant and not spec.symmetric:
        zero_point_bits = 32 if spec.zero_point_type is ZeroPointType.float32 else spec.bit_width
    return numel * spec.bit_width + scales * (scale_bits + zero_point_bits)


def layer_storage(name: str, module: nn.Module, layer_config: QuantizationConfig | None) -> LayerStorage:
    """The storage of quantizable layer ``module`` under its merged config (``None``: float)."""
    weight_spec = layer_config.weight if layer_config is not None else None
    bias_spec = layer_config.bias if layer_config is not None else None
    transposed = isinstance(module, _TRANSPOSED)
    groups = int(getattr(module, "groups", 1))
    weights = weight_bits = bias_bits = 0
    for param in module.parameters():
        if param.dim() >= 2:
            weights += param.numel()
            weight_bits += tensor_bits(param, weight_spec, transposed=transposed, groups=groups)
        elif bias_spec is not None:
            bias_bits += param.numel() * bias_spec.resolved().bit_width
        else:
            bias_bits += _float_bits(param)
    return LayerStorage(name, type(module).__name__, weights, weight_bits, bias_bits,
                        weight_spec.short() if weight_spec is not None else "float")


def model_size(model: nn.Module, config: Config, container: Container | None = None) -> ModelSize:
    """Storage of ``model`` quantized with ``config``, computed from the plan (the model is not modified)."""
    rows = ModelQuantizer(config, container).plan(model)
    modules = dict(model.named_modules())
    layers = [layer_storage(row.name, modules[row.name], row.layer_config) for row in rows if row.sources]
    counted = {id(p) for layer in layers for p in modules[layer.name].parameters()}
    other = sum(_float_bits(p) for p in model.parameters() if id(p) not in counted)
    other += sum(_float_bits(b) for b in model.buffers())
    return ModelSize(layers, other)
