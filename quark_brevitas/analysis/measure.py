"""How the analysis tools measure a model: the batches, the float reference, the metric, and layer toggles.

- :func:`evaluation_data`: the user's batches as the pipeline's
  :class:`~quark_brevitas.calibration.data.CalibrationData`, optionally only the first few (the cheap default
  of the analysis tools); every forward pass of the analysis goes through its ``forward`` loop (batch
  conventions, checks, progress bar).
- :class:`Metric`: one number for a model, higher or lower is better: the user's ``eval_fn(model)`` (accuracy,
  perplexity, ...), or by default the SQNR in dB of the model's output against the float model's output on
  the evaluation batches (the float outputs are computed once).
- :func:`quantized_layers`: the layers of a quantized model by their config names (see
  :func:`quark_brevitas.brevitas_adapter.quantized_units`); :func:`only_enabled` / :func:`disabled`: switch
  the quantizers of chosen layers off for the duration of a measurement, which is how the cheap modes measure
  "one layer quantized" and "all layers but one" on a model quantized once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from quark_brevitas.analysis.metrics import SQNR, output_tensor
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.brevitas_adapter import quantization_disabled, quantized_units, quantizer_names
from quark_brevitas.calibration.data import BatchToInputs, CalibrationData
from quark_brevitas.config import Config
from quark_brevitas.container import Container

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BATCHES", "EvalFn", "Metric", "disabled", "eval_mode", "evaluation_data", "only_enabled",
           "pre_algorithm_layers", "quantized_layers"]

#: Batches the cheap modes measure on unless told otherwise.
DEFAULT_MAX_BATCHES = 4

#: ``eval_fn(model) -> float``: the user's metric (accuracy, perplexity, ...).
EvalFn = Callable[[nn.Module], float]


def evaluation_data(loader: Any, max_batches: int | None = None,
                    batch_to_inputs: BatchToInputs | None = None) -> CalibrationData:
    """``loader`` as CalibrationData; with ``max_batches``, its first ``max_batches`` batches only."""
    data = CalibrationData(loader, batch_to_inputs)
    if max_batches is None:
        return data
    if max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
    return CalibrationData(list(itertools.islice(iter(data), max_batches)), data.batch_to_inputs)


class Metric:
    """The number a measurement gives a model; see the module docstring.

    ``higher_is_better`` applies to ``eval_fn`` (False for a perplexity or a loss); the default metric, output
    SQNR, is always higher-is-better. ``float_value`` is the float model's value (``inf`` for SQNR).
    """

    def __init__(self, float_model: nn.Module, data: CalibrationData, eval_fn: EvalFn | None = None,
                 higher_is_better: bool = True) -> None:
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"eval_fn must be a callable model -> float, got {type(eval_fn).__name__}")
        self.data = data
        self.eval_fn = eval_fn
        self.higher_is_better = True if eval_fn is None else bool(higher_is_better)
        self.name = "output SQNR (dB)" if eval_fn is None else getattr(eval_fn, "__name__", "eval_fn")
        self._reference: list[torch.Tensor] = []
        if eval_fn is None:
            with eval_mode(float_model):
                data.forward(float_model, "Float reference outputs",
                             on_output=lambda _, out: self._reference.append(output_tensor(out).detach().clone()))
            self.float_value = math.inf
        else:
            self.float_value = self(float_model)

    def __call__(self, model: nn.Module, desc: str = "Measuring") -> float:
        """The metric of ``model``, in eval mode (its mode is restored afterwards)."""
        with eval_mode(model):
            return self._measure(model, desc)

    def _measure(self, model: nn.Module, desc: str) -> float:
        if self.eval_fn is not None:
            value = self.eval_fn(model)
            if isinstance(value, torch.Tensor):
                value = value.item()
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise TypeError(f"eval_fn must return a number, got {type(value).__name__}")
            return float(value)
        sqnr = SQNR()
        self.data.forward(model, desc, on_output=lambda i, out: sqnr.add(self._reference[i], output_tensor(out),
                                                                          f"model output of batch {i}"))
        return float(sqnr.db)

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def sort_key(self, value: float) -> float:
        """A key that sorts values from the best to the worst."""
        return -value if self.higher_is_better else value


def pre_algorithm_layers(model: nn.Module, config: Config, calib_loader: Any, container: Container | None = None,
                         batch_to_inputs: BatchToInputs | None = None) -> dict[str, nn.Module] | None:
    """For a config with post-quantization algorithms (GPTQ, GPFQ, bias correction, ...: they move float weights
    and biases), the layers of ``model`` quantized by the pipeline without them: switched-off layers borrow their
    float parameters (see :func:`disabled`). ``None`` for a config without such algorithms."""
    if not config.algo_config:
        return None
    logger.info("The config runs %s: quantizing once more without them for the float parameters",
                ", ".join(type(a).__name__ for a in config.algo_config))
    plain = dataclasses.replace(config, algo_config=[])
    quant = ModelQuantizer(plain, container).quantize_model(model, calib_loader, batch_to_inputs=batch_to_inputs)
    return quantized_layers(quant, container)


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """The models in eval mode while the context lasts, then back in the mode they were in (the caller's model is
    not changed, not even its mode)."""
    modes = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model, mode in zip(models, modes):
            model.train(mode)


def quantized_layers(model: nn.Module, container: Container | None = None) -> dict[str, nn.Module]:
    """The quantized layers of ``model`` (made by the container's layer map) by their config names."""
    layer_map = (container or Container()).layer_map()
    return quantized_units(model, {mapping.quant_class for mapping in layer_map.values()})


@contextlib.contextmanager
def disabled(layers: Mapping[str, nn.Module], names: Iterable[str],
             float_layers: Mapping[str, nn.Module] | None = None) -> Iterator[None]:
    """Every quantizer of the named layers off (weights, activations, bias) while the context lasts; the
    previous state of each quantizer comes back on exit.

    Algorithms such as GPTQ, GPFQ and bias correction move a layer's float weights and bias, so switching its
    quantizers off does not bring its float function back: ``float_layers`` (the same layers of the model
    quantized without those algorithms) lends them their float parameters for the duration.
    """
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(quantization_disabled(layers[name]))
            if float_layers is not None:
                stack.enter_context(_borrowed_parameters(layers[name], float_layers[name]))
        yield


def only_enabled(layers: Mapping[str, nn.Module], keep: Iterable[str],
                 float_layers: Mapping[str, nn.Module] | None = None) -> contextlib.AbstractContextManager[None]:
    """Every layer but ``keep`` in float while the context lasts (see :func:`disabled`)."""
    kept = set(keep)
    return disabled(layers, [name for name in layers if name not in kept], float_layers)


@contextlib.contextmanager
def _borrowed_parameters(layer: nn.Module, source: nn.Module) -> Iterator[None]:
    """``layer``'s own parameters (not its quantizers') take ``source``'s values while the context lasts."""
    proxies = quantizer_names(layer)
    lent = dict(source.named_parameters())
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if any(name == proxy or name.startswith(proxy + ".") for proxy in proxies):
                continue
            value = lent.get(name)
            if value is not None and value.shape == param.shape:
                saved.append((param, param.detach().clone()))
                param.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)
