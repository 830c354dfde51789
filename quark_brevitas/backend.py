"""The layerwise backend: replace compute-heavy layers by their Brevitas counterparts.

A *layer map* says, for each float layer class, which Brevitas class replaces it and how that
class's quantizer keyword arguments are built from a resolved :class:`QuantizationConfig`. The
default map covers ``Linear``, ``Conv1d``, ``Conv2d``, ``ConvTranspose1d``, ``ConvTranspose2d`` and
``MultiheadAttention``; users add their own layer types through the dependency-injection container
(:mod:`quark_brevitas.container`) without patching the library. Matching is on the exact class,
as in Brevitas, so subclasses with different behaviour are not replaced by accident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import brevitas.nn as qnn
import torch
from brevitas import config as brevitas_config
from brevitas.graph.base import ModuleToModuleByInstance
from brevitas.graph.utils import set_module
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer as QuantWBIOL
from torch import nn

from quark_brevitas.config import Config, QuantizationConfig
from quark_brevitas.errors import ModelError
from quark_brevitas.quantizers import build_quantizer

logger = logging.getLogger(__name__)

KwargsBuilder = Callable[[QuantizationConfig], dict[str, Any]]


def wbiol_kwargs(layer: QuantizationConfig) -> dict[str, Any]:
    """Quantizer kwargs for weight/bias/input/output layers (QuantLinear, QuantConv*, ...)."""
    return {
        "weight_quant": build_quantizer(layer.weight, "weight"),
        "bias_quant": build_quantizer(layer.bias, "bias"),
        "input_quant": build_quantizer(layer.input_tensors, "input_tensors"),
        "output_quant": build_quantizer(layer.output_tensors, "output_tensors"),
        "return_quant_tensor": False,
    }


def mha_kwargs(layer: QuantizationConfig) -> dict[str, Any]:
    """Quantizer kwargs for QuantMultiheadAttention.

    Projections follow the weight/bias/input specs; the internal q, k, v tensors use the input spec
    (symmetric, because they feed matmuls with signed operands), the softmax output uses the input
    spec's quantizer made unsigned for int formats (its values lie in [0, 1]).
    """
    weight = build_quantizer(layer.weight, "weight")
    bias = build_quantizer(layer.bias, "bias")
    act = build_quantizer(layer.input_tensors, "input_tensors")
    attn = act
    if act is not None and layer.input_tensors is not None and layer.input_tensors.quant_type.name == "int_quant":
        attn = act.let(signed=False) if layer.input_tensors.symmetric else act
    return {
        "in_proj_input_quant": act,
        "in_proj_weight_quant": weight,
        "in_proj_bias_quant": bias,
        "softmax_input_quant": None,
        "attn_output_weights_quant": attn,
        "q_scaled_quant": act,
        "k_transposed_quant": act,
        "v_quant": act,
        "out_proj_input_quant": act,
        "out_proj_weight_quant": weight,
        "out_proj_bias_quant": bias,
        "out_proj_output_quant": build_quantizer(layer.output_tensors, "output_tensors"),
        "packed_in_proj": True,
        "return_quant_tensor": False,
    }


@dataclass(frozen=True)
class LayerMapping:
    """How one float layer class is quantized: the replacing class and its kwargs builder."""

    quant_class: type[nn.Module]
    build_kwargs: KwargsBuilder = wbiol_kwargs


DEFAULT_LAYER_MAP: dict[type[nn.Module], LayerMapping] = {
    nn.Linear: LayerMapping(qnn.QuantLinear),
    nn.Conv1d: LayerMapping(qnn.QuantConv1d),
    nn.Conv2d: LayerMapping(qnn.QuantConv2d),
    nn.ConvTranspose1d: LayerMapping(qnn.QuantConvTranspose1d),
    nn.ConvTranspose2d: LayerMapping(qnn.QuantConvTranspose2d),
    nn.MultiheadAttention: LayerMapping(qnn.QuantMultiheadAttention, mha_kwargs),
}


@dataclass(frozen=True)
class PlannedLayer:
    """One row of the quantization plan: a module and the config it gets (``None``: stays float)."""

    name: str
    module_type: str
    layer_config: QuantizationConfig | None


class LayerwiseBackend:
    """Replaces every module whose exact class is in the layer map; leaves the rest in float."""

    def __init__(self, layer_map: Mapping[type[nn.Module], LayerMapping]) -> None:
        for key, value in layer_map.items():
            if not (isinstance(key, type) and issubclass(key, nn.Module)) or not isinstance(value, LayerMapping):
                raise TypeError(
                    f"layer map entry {key!r}: keys must be nn.Module subclasses and values LayerMapping "
                    f"instances, got {type(value).__name__}"
                )
        self.layer_map = dict(layer_map)

    def _walk(self, module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module, bool]]:
        """Yield (name, module, mapped) in pre-order, not descending into mapped modules (e.g.
        MultiheadAttention's out_proj). A model that is itself a single layer is named ``""``."""
        if not prefix and type(module) in self.layer_map:
            yield "", module, True
            return
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            mapped = type(child) in self.layer_map
            yield full, child, mapped
            if not mapped:
                yield from self._walk(child, full)

    def plan(self, model: nn.Module, config: Config) -> list[PlannedLayer]:
        """Which modules get quantized, and with which config (does not modify the model)."""
        rows = []
        for name, module, mapped in self._walk(model):
            rows.append(PlannedLayer(name, type(module).__name__, config.global_quant_config if mapped else None))
        return rows

    def quantize(self, model: nn.Module, config: Config) -> nn.Module:
        """Replace the planned layers of ``model`` in place and return it."""
        rows = self.plan(model, config)
        targets = {row.name for row in rows if row.layer_config is not None}
        if not targets:
            supported = sorted(cls.__name__ for cls in self.layer_map)
            raise ModelError(
                f"{type(model).__name__} has no layer the backend can quantize; supported layer types: "
                f"{supported}. Register a LayerMapping for your layer type in the container's layer_map."
            )
        modules = dict(model.named_modules())
        # The float state dict has no quantizer parameters (scales are initialised from statistics on
        # first use), so Brevitas must be told to accept them as missing while loading it.
        ignore_missing = brevitas_config.IGNORE_MISSING_KEYS
        brevitas_config.IGNORE_MISSING_KEYS = True
        try:
            for row in rows:
                if row.layer_config is None:
                    continue
                old = modules[row.name]
                mapping = self.layer_map[type(old)]
                kwargs = mapping.build_kwargs(row.layer_config)
                new = ModuleToModuleByInstance(old, mapping.quant_class, **kwargs).init_new_module(old, name=row.name)
                if row.name == "":
                    model = new  # the model is itself a single supported layer
                else:
                    set_module(model, new, row.name)
        finally:
            brevitas_config.IGNORE_MISSING_KEYS = ignore_missing
        _init_weight_scales(model)
        kept = [f"{r.name} ({r.module_type})" for r in rows
                if r.layer_config is None and not any(r.name.startswith(t + ".") for t in targets)
                and not list(modules[r.name].children())]
        logger.info("Quantized %d layers; kept in float: %s", len(targets), ", ".join(kept) if kept else "none")
        return model


def _init_weight_scales(model: nn.Module) -> None:
    """Compute every weight scale (and zero point) from its float weight now.

    Parameter-from-stats weight scales are otherwise initialised lazily on the first quantized
    forward pass; doing it here makes weight-only quantization data-free and gives GPTQ/GPFQ the
    initialised grid they require (Brevitas's calibration mode does not touch weight quantizers).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantWBIOL) and module.weight_quant.is_quant_enabled:
                module.quant_weight()


__all__ = ["DEFAULT_LAYER_MAP", "LayerMapping", "LayerwiseBackend", "PlannedLayer", "mha_kwargs", "wbiol_kwargs"]
