"""Brevitas's modes: global flags, calibration and algorithm contexts, export-mode clean-up.

Brevitas switches a model between float, calibrating, correcting, loading and exporting through global
flags and context managers whose exact arguments matter (GPTQ without a float copy of every weight,
dynamic activation quantizers kept quantizing during calibration, export mode left after a failed
export). Each is wrapped here once, with a docstring saying why it is called that way and a canary in
``tests/brevitas_adapter/test_adapter_modes.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from brevitas import config as _brevitas_config
from brevitas.graph import calibrate as _calibrate
from torch import nn

from quark_brevitas.brevitas_adapter.introspection import is_dynamic_activation, iter_quantizers
from quark_brevitas.errors import QuarkBrevitasError

logger = logging.getLogger(__name__)

__all__ = [
    "a2gpfq_available",
    "a2gpfq_mode",
    "activation_equalization_mode",
    "bias_correction_mode",
    "calibration_mode",
    "export_handler_proxy_types",
    "full_state_dict",
    "gpfq_mode",
    "gptq_mode",
    "gpxq_update",
    "ignore_missing_keys",
    "load_quant_model_mode",
    "norm_correction_mode",
    "quantization_disabled",
    "require_onnxoptimizer",
    "reset_export_mode",
]


# ===================================================================== global flags
@contextlib.contextmanager
def _flag(name: str, value: Any) -> Iterator[None]:
    previous = getattr(_brevitas_config, name)
    setattr(_brevitas_config, name, value)
    try:
        yield
    finally:
        setattr(_brevitas_config, name, previous)


def ignore_missing_keys() -> contextlib.AbstractContextManager[None]:
    """Let ``load_state_dict`` accept missing quantizer values.

    A float state dict has no quantizer parameters (their values are initialised from statistics on
    first use), and a calibrated model leaves uninitialised quantizers out of its state dict; Brevitas
    accepts such state dicts only with its global ``IGNORE_MISSING_KEYS`` flag set.
    """
    return _flag("IGNORE_MISSING_KEYS", True)


def full_state_dict() -> contextlib.AbstractContextManager[None]:
    """Make ``state_dict()`` include quantizer values that are not initialised yet (Brevitas's private
    ``_FULL_STATE_DICT`` flag): checkpoint loading compares the complete set of tensors."""
    return _flag("_FULL_STATE_DICT", True)


# ===================================================================== modes and algorithms
@contextlib.contextmanager
def calibration_mode(model: nn.Module) -> Iterator[None]:
    """Brevitas calibration mode, except that dynamic activation quantizers keep quantizing.

    Brevitas runs every activation quantizer as an observer in this mode, which fails for per-group
    ones and would show the static quantizers after them float values they never see at inference.
    """
    with _calibrate.calibration_mode(model):
        for site in iter_quantizers(model, enabled_only=False):
            if site.kind == "act" and is_dynamic_activation(site.proxy):
                site.proxy.disable_quant = False
                for sub in site.proxy.modules():
                    if hasattr(sub, "observer_only"):
                        sub.observer_only = False
        yield


def quantization_disabled(model: nn.Module, *, act: bool = True, weight: bool = True, bias: bool = True
                          ) -> contextlib.AbstractContextManager[Any]:
    """Run ``model`` with the chosen kinds of quantization switched off (float forward)."""
    return _calibrate.quantization_status_manager(model, disable_act_quant=act, disable_weight_quant=weight,
                                                  disable_bias_quant=bias)


def bias_correction_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's bias correction: collects the mean output error per layer, corrects it on exit."""
    return _calibrate.bias_correction_mode(model)


def norm_correction_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's BatchNorm statistics re-estimation on the quantized model."""
    return _calibrate.norm_correction_mode(model)


def load_quant_model_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Loading a state dict marks every loaded quantizer value as initialised (no re-derivation)."""
    return _calibrate.load_quant_model_mode(model)


def activation_equalization_mode(model: nn.Module, alpha: float) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's layerwise (SmoothQuant-style) activation equalization, with scale modules, collecting its
    per-channel input ranges with :func:`token_reduced_equalization` (batches of different lengths)."""
    from brevitas.graph.equalize import activation_equalization_mode as mode

    context = mode(model, alpha=alpha, layerwise=True, add_mul_node=True)
    context.graph_act_eq = token_reduced_equalization(model)
    return context


def token_reduced_equalization(model: nn.Module) -> Any:
    """Brevitas's ``LayerwiseActivationEqualization`` whose range of each batch is reduced to one value per
    channel before it is merged with the earlier batches.

    Brevitas keeps the maximum over the batch dimension only, one value per (token, channel) for a Linear
    layer's ``(batch, tokens, channels)`` input, and takes the element-wise maximum with the next batch: two
    batches of different sequence lengths (a tokenizer's ``padding=True``) fail with a shape mismatch. Brevitas
    reduces the tokens at the end anyway (the maximum per channel, ``_cross_layer_equalization``), so reducing
    them per batch (``amax`` over every axis but the channel axis, kept as size 1 so the scale module's
    broadcast shape is unchanged) gives the same ranges for equal lengths and accepts any lengths.
    """
    from brevitas.graph.equalize import LayerwiseActivationEqualization, _get_act_axis

    class TokenReduced(LayerwiseActivationEqualization):
        def forward_stats_hook(self, module: nn.Module, *args: Any, name: Any, **kwargs: Any) -> None:
            previous = self.float_act_map.pop(name, None)
            super().forward_stats_hook(module, *args, name=name, **kwargs)
            current = self.float_act_map.get(name)
            if current is None:  # Brevitas records None for inputs it skips (MultiheadAttention cross-attention)
                return
            axis = _get_act_axis(module)
            if axis is not None and current.ndim > 1:
                channel = axis % current.ndim
                others = [d for d in range(current.ndim) if d != channel]
                current = current.amax(dim=others, keepdim=True)
            self.float_act_map[name] = current if previous is None else torch.maximum(previous, current)

    return TokenReduced(model)


def gptq_mode(model: nn.Module, *, act_order: bool) -> Any:
    """Brevitas's GPTQ context (float inputs to each layer), one pass for the layers that share an input
    (:func:`~quark_brevitas.brevitas_adapter.cache.shared_input_gptq_mode`). GPTQ does not need the float copy
    of each weight that Brevitas's GPxQ base class keeps by default, so none is made."""
    from quark_brevitas.brevitas_adapter.cache import gptq_class_checking_once, shared_input_gptq_mode

    return shared_input_gptq_mode()(model, act_order=act_order, use_quant_activations=False,
                                    create_weight_orig=False, gptq_class=gptq_class_checking_once())


def gpxq_update(mode: Any) -> list[nn.Module]:
    """Optimise the layers a GPxQ context's last pass reached (Brevitas's ``update``); returns them (one per
    pass in Brevitas's own contexts, a group sharing an input in :func:`gptq_mode`'s)."""
    layers = [mode.gpxq_layers[name].layer for name in sorted(mode.current_layer.layer_names)]
    mode.update()
    return layers


def gpfq_mode(model: nn.Module, *, act_order: bool) -> Any:
    """Brevitas's GPFQ context (quantized inputs to each layer)."""
    from brevitas.graph.gpfq import gpfq_mode as mode

    return mode(model, act_order=act_order, use_quant_activations=True)


def a2gpfq_mode(model: nn.Module, *, act_order: bool, accumulator_bit_width: int) -> Any:
    """Accumulator-aware GPFQ (AXE), which Brevitas ships in ``brevitas_examples``."""
    return _a2gpfq_class()(model, act_order=act_order, use_quant_activations=True,
                           max_accumulator_bit_width=accumulator_bit_width)


def _a2gpfq_class() -> Any:
    try:
        from brevitas_examples.common.axe import a2gpfq_mode as mode
    except ImportError as exc:
        raise QuarkBrevitasError(
            "GPFA2Q needs brevitas_examples.common.axe.a2gpfq_mode (shipped with brevitas >= 0.11); "
            f"the installed Brevitas does not provide it ({exc})"
        ) from exc
    return mode


def a2gpfq_available() -> bool:
    """Whether the installed Brevitas ships accumulator-aware GPFQ."""
    try:
        _a2gpfq_class()
    except QuarkBrevitasError:
        return False
    return True


# ===================================================================== export
def export_handler_proxy_types(manager: Any) -> frozenset[type]:
    """The proxy types an export manager (QCDQ, QONNX) has a handler for (its private handler list)."""
    types: set[type] = set()
    for handler in manager.handlers:
        layer = handler.handled_layer
        types.update(layer if isinstance(layer, tuple) else (layer,))
    return frozenset(types)


def reset_export_mode(model: nn.Module, manager: Any) -> None:
    """Leave Brevitas's export mode after a failed export (export mode and cached activations must not
    leak into the model's later use). Best effort: a failure here must not mask the export error."""
    try:
        manager.set_export_mode(model, enabled=False)
    except Exception:  # noqa: BLE001 - cleanup must not mask the original error
        logger.debug("could not reset Brevitas export mode", exc_info=True)
    for module in model.modules():
        if hasattr(module, "cache_inference_quant_act_backup"):
            module.cache_inference_quant_act = module.cache_inference_quant_act_backup
            del module.cache_inference_quant_act_backup


def require_onnxoptimizer() -> None:
    """Brevitas's TorchScript ONNX exporters refuse to run without onnxoptimizer installed; say so
    clearly before an export starts rather than from inside Brevitas."""
    try:
        import onnxoptimizer  # noqa: F401 - only its presence matters
    except ImportError as exc:
        raise QuarkBrevitasError(
            f"ONNX export needs the onnxoptimizer package, which Brevitas's exporter requires ({exc}); "
            "install it with pip install onnxoptimizer"
        ) from exc
