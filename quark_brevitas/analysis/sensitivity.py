"""Sensitivity analysis: which layers cost the most when quantized with a given config.

For each layer the config quantizes, two measurements of a metric (:class:`~quark_brevitas.analysis.measure.
Metric`: by default the SQNR of the model's output against the float model's, or the user's
``eval_fn(model) -> float``):

- ``only``: this layer quantized, every other layer in float: the damage the layer does on its own;
- ``all_but``: every layer quantized except this one: what keeping this layer alone in float buys back.

Rows come sorted from the most to the least sensitive layer: by ``all_but`` (the best value first: the layer
whose exclusion helps most), then by ``only`` (the worst first).

Two modes:

- **cheap** (the default): the pipeline quantizes the model once with the full config; each measurement then
  switches the quantizers of the other layers (``only``) or of the layer (``all_but``) off
  (:func:`~quark_brevitas.analysis.measure.disabled`), on the first ``max_batches`` batches (default 4). The
  activation scales stay those calibrated with every layer quantized, and algorithms (GPTQ, ...) ran once
  with every layer quantized. Post-quantization algorithms (GPTQ, GPFQ, bias correction, ...) move float weights
  and biases: a layer switched off then takes its parameters from the model quantized without them (one more
  pipeline run), so that it is float again.
- **exact** (``exact=True``): every measurement runs the pipeline anew, with ``exclude`` naming every other
  layer (``only``) or the layer (``all_but``), and measures on every batch: 2 pipeline runs per layer.

Both use the pipeline (``ModelQuantizer``) and the data phase as they are, on the caller's batches.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.analysis.measure import (
    DEFAULT_MAX_BATCHES,
    EvalFn,
    Metric,
    disabled,
    evaluation_data,
    only_enabled,
    pre_algorithm_layers,
    quantized_layers,
)
from quark_brevitas.analysis.metrics import Rows
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.calibration.data import BatchToInputs
from quark_brevitas.config import Config
from quark_brevitas.container import Container
from quark_brevitas.errors import ModelError

logger = logging.getLogger(__name__)

__all__ = ["MODES", "SensitivityRow", "literal_name", "quantized_layer_names", "sensitivity"]

#: The two measurements per layer (see the module docstring).
MODES = ("only", "all_but")


@dataclass(frozen=True)
class SensitivityRow:
    """One layer: the metric with only this layer quantized (``only``) and with all layers but this one
    (``all_but``); ``None`` for a mode not measured. ``float_metric``/``quantized_metric``: the float model's
    and the fully quantized model's values, the same in every row."""

    name: str
    module_type: str
    only: float | None
    all_but: float | None
    float_metric: float
    quantized_metric: float


def literal_name(name: str) -> str:
    """``name`` as an ``exclude`` / ``layer_quant_config`` pattern that matches exactly that name."""
    return glob.escape(name)


def quantized_layer_names(model: nn.Module, config: Config, container: Container | None = None
                          ) -> list[tuple[str, str]]:
    """``(name, module type)`` of every layer ``config`` quantizes in ``model``, in model order (the plan)."""
    rows = ModelQuantizer(config, container).plan(model)
    return [(row.name, row.module_type) for row in rows if row.quantized]


def sensitivity(model: nn.Module, config: Config, calib_loader: Any, eval_fn: EvalFn | None = None, *,
                exact: bool = False, max_batches: int | None = None, modes: tuple[str, ...] = MODES,
                higher_is_better: bool = True, container: Container | None = None,
                batch_to_inputs: BatchToInputs | None = None) -> Rows:
    """Measure every layer's sensitivity to ``config`` (see the module docstring); ``model`` is not modified.

    - ``calib_loader``: calibration batches (the pipeline's conventions); the default metric is measured on them.
    - ``eval_fn(model) -> float``: your metric instead of output SQNR; ``higher_is_better=False`` for a
      perplexity or a loss.
    - ``exact``: re-run the pipeline per measurement instead of switching quantizers off.
    - ``max_batches``: batches the default metric uses (cheap: 4, exact: all).
    - ``modes``: ``("only", "all_but")`` or one of them.

    Returns :class:`~quark_brevitas.analysis.metrics.Rows` of :class:`SensitivityRow`, most sensitive first;
    ``rows.summary`` holds ``metric`` (its name), ``higher_is_better``, ``float_metric``, ``quantized_metric``,
    ``exact`` and ``batches``.
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes: {unknown or 'empty'}; allowed: one or both of {list(MODES)}")
    quantizer = ModelQuantizer(config, container)
    layers = quantized_layer_names(model, config, container)
    if not layers:
        raise ModelError(f"the config quantizes no layer of {type(model).__name__}: nothing to analyse")
    if max_batches is None and not exact:
        max_batches = DEFAULT_MAX_BATCHES
    data = evaluation_data(calib_loader, max_batches, batch_to_inputs)
    metric = Metric(model, data, eval_fn, higher_is_better)
    full = quantizer.quantize_model(model, calib_loader, batch_to_inputs=batch_to_inputs)
    quantized_value = metric(full, "Fully quantized")
    names = [name for name, _ in layers]
    results: dict[str, dict[str, float]] = {name: {} for name in names}
    if exact:
        del full
        _measure_exact(model, config, calib_loader, names, modes, metric, container, batch_to_inputs, results)
    else:
        units = quantized_layers(full, container)
        float_units = pre_algorithm_layers(model, config, calib_loader, container, batch_to_inputs)
        missing = [name for name in names if name not in units]
        if missing:
            raise ModelError(f"planned layers {missing} are not quantized layers of the quantized model (found: "
                             f"{sorted(units)}); use exact=True")
        for name in tqdm(names, desc="Sensitivity (cheap)", leave=False, disable=None):
            if "only" in modes:
                with only_enabled(units, [name], float_units):
                    results[name]["only"] = metric(full, f"only {name}")
            if "all_but" in modes:
                with disabled(units, [name], float_units):
                    results[name]["all_but"] = metric(full, f"all but {name}")
    rows = [SensitivityRow(name, kind, results[name].get("only"), results[name].get("all_but"),
                           metric.float_value, quantized_value) for name, kind in layers]
    rows.sort(key=lambda row: _sensitivity_key(row, metric))
    summary = {"metric": metric.name, "higher_is_better": metric.higher_is_better, "float_metric": metric.float_value,
               "quantized_metric": quantized_value, "exact": exact,
               "batches": len(data) if eval_fn is None else None}
    return Rows(rows, summary)


def _sensitivity_key(row: SensitivityRow, metric: Metric) -> tuple[float, float]:
    """Most sensitive first: the best ``all_but`` value, then the worst ``only`` value."""
    all_but = metric.sort_key(row.all_but) if row.all_but is not None else 0.0
    only = -metric.sort_key(row.only) if row.only is not None else 0.0
    return (all_but if not math.isnan(all_but) else math.inf, only if not math.isnan(only) else math.inf)


def _measure_exact(model: nn.Module, config: Config, calib_loader: Any, names: list[str], modes: tuple[str, ...],
                   metric: Metric, container: Container | None, batch_to_inputs: BatchToInputs | None,
                   results: dict[str, dict[str, float]]) -> None:
    """Re-run the pipeline for every measurement, excluding the other layers or the layer."""
    for name in tqdm(names, desc="Sensitivity (exact)", leave=False, disable=None):
        for mode in modes:
            others = [literal_name(n) for n in names if n != name] if mode == "only" else [literal_name(name)]
            if mode == "all_but" and len(names) == 1:
                results[name][mode] = metric.float_value
                continue
            variant = dataclasses.replace(config, exclude=[*config.exclude, *others])
            quant = ModelQuantizer(variant, container).quantize_model(model, calib_loader,
                                                                     batch_to_inputs=batch_to_inputs)
            results[name][mode] = metric(quant, f"{mode} {name}")
