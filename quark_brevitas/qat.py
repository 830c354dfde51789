"""Quantization-aware training: turn a calibrated quantized model into one an ordinary loop trains.

The models :class:`~quark_brevitas.api.ModelQuantizer` returns are already trainable ``nn.Module``
s: rounding passes gradients straight through (STE), and every weight and activation scale is an
``nn.Parameter`` initialised from statistics. :func:`prepare_qat` makes the choices a QAT run needs
explicit, in the spirit of torch.ao's prepare -> train -> convert (reference 004):

- ``learn_scales``: scales (thresholds) train with the weights, or stay fixed at their calibrated
  values;
- ``threshold_init``: TQT (Trained Quantization Thresholds, arXiv:1903.08066). With power-of-two
  scales (``scale_type=pof2``) Brevitas stores each threshold as ``log2(t)`` and quantizes with
  scale ``2**ceil(log2 t) / 2**(b-1)``, so gradients reach the threshold in the log domain, as in
  the paper, and the effective scale stays a power of two. ``prepare_qat`` re-initialises those
  thresholds by :class:`~quark_brevitas.types.TQTThresholdInitMeth`: ``_3SD`` (three standard
  deviations of the tensor) or ``_LL_J`` (the power-of-two threshold whose quantized histogram has
  the smallest symmetric Kullback-Leibler (J) divergence from the float histogram — our reading of
  Settle et al., arXiv:1805.07941, Algorithm 1);
- ``freeze_batch_norm``: BatchNorm layers still in the model (``Preprocess(merge_batch_norm=False)``)
  keep their running statistics and normalise with them during training. With the default
  ``Preprocess`` BatchNorm is already folded into the preceding convolution, and QAT trains the
  folded weights.

Recipe: ``quant = ModelQuantizer(config).quantize_model(model, calib)`` (calibrated start) ->
``prepare_qat(quant, QATConfig(...), calib)`` -> train with any optimizer -> ``quant.eval()`` ->
``ModelExporter(path).export_onnx_model(quant, example)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from brevitas.core.restrict_val import PowerOfTwoRestrictValue
from torch import nn

from quark_brevitas.brevitas_adapter import (
    QuantActivation,
    QuantLayer,
    fused_activation,
    iter_quantizers,
    mark_scale_initialised,
    quantization_disabled,
    scale_impl,
    scale_parameters,
)
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.enums import TQTThresholdInitMeth
from quark_brevitas.errors import CalibrationDataError, QuarkBrevitasError

logger = logging.getLogger(__name__)

__all__ = ["QATConfig", "QATError", "prepare_qat", "scale_parameters", "threshold_from_tensor"]


class QATError(QuarkBrevitasError):
    """The model or the QAT config cannot be prepared as asked."""


@dataclass
class QATConfig:
    """How :func:`prepare_qat` sets up training (see the module docstring)."""

    learn_scales: bool = True
    threshold_init: TQTThresholdInitMeth | None = None
    freeze_batch_norm: bool = True

    def __post_init__(self) -> None:
        for name in ("learn_scales", "freeze_batch_norm"):
            if not isinstance(getattr(self, name), bool):
                raise QATError(f"QATConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.threshold_init is not None and not isinstance(self.threshold_init, TQTThresholdInitMeth):
            allowed = [m.name for m in TQTThresholdInitMeth]
            raise QATError(f"QATConfig.threshold_init must be a TQTThresholdInitMeth ({allowed}) or None, "
                           f"got {self.threshold_init!r}")


_TRAINED_ROLES = ("weight", "input", "output")


def _quantizers(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, Any]]:
    """Yield (layer name, role, layer, proxy) for every enabled weight/input/output quantizer of the
    weight/bias layers and every stand-alone activation quantizer (``act``: QuantReLU, QuantIdentity, the graph
    backend's points): the quantizers TQT initialises."""
    for site in iter_quantizers(model):
        if isinstance(site.layer, QuantLayer) and site.role in _TRAINED_ROLES:
            yield site.layer_name, site.role, site.layer, site.proxy
        elif isinstance(site.layer, QuantActivation) and site.role == "act":
            yield site.layer_name, "act", site.layer, site.proxy


def _is_pof2(impl: nn.Module) -> bool:
    return any(isinstance(m, PowerOfTwoRestrictValue) for m in impl.modules())


def _j_divergence(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-8) -> float:
    p = (p + eps) / (p + eps).sum()
    q = (q + eps) / (q + eps).sum()
    return float(((p - q) * (p.log() - q.log())).sum())


def threshold_from_tensor(x: torch.Tensor, method: TQTThresholdInitMeth, bit_width: int) -> float:
    """A quantization threshold for the values ``x`` (a float, before power-of-two rounding)."""
    values = x.detach().float().flatten()
    absmax = float(values.abs().max())
    if absmax == 0.0:
        return 1.0
    if method is TQTThresholdInitMeth._3SD:
        return max(3.0 * float(values.std()) + float(values.mean().abs()), 1e-8)
    # _LL_J: among power-of-two thresholds, the one whose quantized magnitude histogram is closest
    # (symmetric KL) to the float one: the reference keeps the clipped mass in its last bin, the
    # quantized one spreads each of the 2**(b-1) levels' unclipped mass evenly over the bins it
    # covers (the TensorRT-style comparison), so both clipping and rounding error count.
    # Exact zeros (e.g. after ReLU) are representable at any threshold and would swamp the first bin.
    top = math.ceil(math.log2(absmax))
    bins = 2048
    hist = torch.histc(values[values != 0].abs(), bins=bins, min=0.0, max=2.0**top)
    levels = 2 ** (bit_width - 1)
    best_t, best_d = 2.0**top, math.inf
    for k in range(top - 12, top + 1):
        kept = int(round(bins * 2.0 ** (k - top)))
        if kept < levels:
            continue
        inside = hist[:kept]
        p = inside.clone()
        p[-1] += hist[kept:].sum()
        q = torch.zeros_like(p)
        for chunk in torch.arange(kept).chunk(levels):
            mass, nonzero = inside[chunk], inside[chunk] > 0
            if nonzero.any():
                q[chunk[nonzero]] = mass.sum() / nonzero.sum()
        divergence = _j_divergence(p, q)
        if divergence < best_d:
            best_t, best_d = 2.0**k, divergence
    return best_t


def _set_threshold(impl: nn.Module, proxy: Any, threshold: torch.Tensor) -> None:
    """Store ``log2(threshold)`` so that the effective scale is 2**ceil(log2 t) / 2**(b-1)."""
    with torch.no_grad():
        impl.value.copy_(torch.log2(threshold).reshape(impl.value.shape).to(impl.value))
    mark_scale_initialised(impl)


def _collect_inputs(model: nn.Module, loader: Any) -> dict[str, list[torch.Tensor]]:
    """Record, per quantized layer, the float tensors its input and output quantizers see."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, role, _, proxy in _quantizers(model):
        if role == "weight":
            continue

        activation = fused_activation(proxy)

        def hook(_module: nn.Module, args: tuple, key: str = f"{name}:{role}", act: Any = activation) -> None:
            # a QuantReLU quantizes the ReLU of what its proxy receives; a shared point (one quantizer called on
            # every input of an add/concat) collects all its calls, so its threshold covers every input
            seen.setdefault(key, []).append(act(args[0].detach()).flatten())

        hooks.append(proxy.register_forward_pre_hook(hook))
    if loader is None:
        raise CalibrationDataError("TQT threshold initialisation of activation quantizers needs calibration data: "
                                   "pass calib_loader to prepare_qat")
    was_training = model.training
    model.eval()
    try:
        with quantization_disabled(model):
            CalibrationData(loader).forward(model, "TQT threshold statistics")
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return seen


def _init_thresholds(model: nn.Module, method: TQTThresholdInitMeth, loader: Any) -> None:
    quantizers = list(_quantizers(model))
    not_pof2 = [f"{n} ({r})" for n, r, _, p in quantizers if (impl := scale_impl(p)) is None or not _is_pof2(impl)]
    if not_pof2:
        raise QATError(f"TQT threshold initialisation needs power-of-two scales (scale_type=pof2); these quantizers "
                       f"are not: {', '.join(not_pof2)}")
    needs_data = any(role != "weight" for _, role, _, _ in quantizers)
    activations = _collect_inputs(model, loader) if needs_data else {}
    for name, role, layer, proxy in quantizers:
        impl = scale_impl(proxy)
        bit_width = int(proxy.bit_width())
        if role == "weight":
            weight = layer.weight.detach()
            if impl.value.numel() > 1:  # per output channel
                rows = weight.flatten(1) if not _transposed(layer) else weight.transpose(0, 1).flatten(1)
                t = torch.tensor([threshold_from_tensor(r, method, bit_width) for r in rows])
            else:
                t = torch.tensor(threshold_from_tensor(weight, method, bit_width))
        else:
            t = torch.tensor(threshold_from_tensor(torch.cat(activations[f"{name}:{role}"]), method, bit_width))
        _set_threshold(impl, proxy, t)
        logger.debug("TQT %s init %s.%s threshold %s", method.name, name, role, t.flatten()[:4].tolist())


def _transposed(layer: nn.Module) -> bool:
    return "Transpose" in type(layer).__name__


def _freeze_bn_hook(module: nn.Module, _args: tuple) -> None:
    module.training = False


def prepare_qat(model: nn.Module, config: QATConfig | None = None, calib_loader: Any = None) -> nn.Module:
    """Prepare a quantized model (from ``quantize_model``) for training, in place; returns it in train mode.

    ``calib_loader`` is needed only for TQT threshold initialisation of activation quantizers.
    """
    config = config if config is not None else QATConfig()
    if not isinstance(config, QATConfig):
        raise TypeError(f"config must be a QATConfig, got {type(config).__name__}")
    if not any(True for _ in _quantizers(model)):
        raise QATError(f"{type(model).__name__} has no quantized layers; run ModelQuantizer.quantize_model first")
    if config.threshold_init is not None:
        _init_thresholds(model, config.threshold_init, calib_loader)
    scales = scale_parameters(model)
    for param in scales.values():
        param.requires_grad_(config.learn_scales)
    if config.freeze_batch_norm:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not getattr(module, "_qb_frozen", False):
                module.register_forward_pre_hook(_freeze_bn_hook)
                module._qb_frozen = True
    model.train()
    logger.info("QAT ready: %d scale parameters %s", len(scales), "learned" if config.learn_scales else "fixed")
    return model
