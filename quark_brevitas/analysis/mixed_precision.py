"""Automatic mixed precision: one format per layer, chosen from candidates, under a size or accuracy budget.

1. **Measure** (:func:`measure_candidates`): for every quantizable layer and every candidate layer config, the
   SQNR of the model's output when only that layer is quantized with that candidate (every other layer float),
   on the calibration batches. Cheap (the default): the pipeline quantizes the whole model once per candidate,
   and each layer is measured by switching the other layers' quantizers off (as in
   :mod:`~quark_brevitas.analysis.sensitivity`); ``exact=True`` runs the pipeline once per layer and candidate.
   The storage of each choice comes from :func:`~quark_brevitas.analysis.sizes.layer_storage`.
2. **Choose** (:func:`solve_assignment`): output noise powers of independent layers add up, so the assignment
   minimising ``sum over layers of 10^(-SQNR/10)`` under the budget is a multiple-choice knapsack, solved by
   dynamic programming over the budget in 2000 steps (an optimum that rounding pushed over the budget is solved
   again with less room, so the budget always holds exactly).
3. **Refine** (:func:`search_mixed_precision`): the additive model is an approximation, so the best few
   assignments it proposes (its optimum, the best assignment with each layer forced to each other candidate,
   and the best uniform one) are quantized for real through the pipeline, and the one whose *measured* metric is
   best wins: output SQNR by default, or ``eval_fn(model)``. With ``min_metric``, the cheapest point of the
   knapsack's size/noise frontier whose measured metric reaches it (bisection over the frontier).
4. **Write** (:func:`mixed_precision_config`): a :class:`~quark_brevitas.config.Config` whose global level is
   the most common candidate, with ``layer_quant_config`` entries for the other quantized layers and ``exclude``
   for the float ones; the config is checked against the plan (every layer resolves to exactly its choice), so
   it runs as is in ``quark-brevitas quantize --config`` and ``plan`` explains it.

Budgets: ``budget_bits`` (average bits per weight element over the quantizable layers, scales and zero points
included, float layers counting 32) or ``budget_bytes`` (the whole model's parameters and buffers), and/or
``min_metric``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas.analysis.knapsack import knapsack
from quark_brevitas.analysis.measure import (
    DEFAULT_MAX_BATCHES,
    EvalFn,
    Metric,
    evaluation_data,
    only_enabled,
    pre_algorithm_layers,
    quantized_layers,
)
from quark_brevitas.analysis.sensitivity import literal_name
from quark_brevitas.analysis.sizes import layer_storage, model_size
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.calibration.data import BatchToInputs
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig, QuantizationConfig
from quark_brevitas.config.enums import Dtype, QSchemeType
from quark_brevitas.container import Container
from quark_brevitas.errors import ModelError, QuarkBrevitasError

logger = logging.getLogger(__name__)

__all__ = [
    "CANDIDATES",
    "DEFAULT_CANDIDATES",
    "BudgetError",
    "CandidateMeasurements",
    "MixedPrecisionSearch",
    "auto_mixed_precision",
    "candidate_label",
    "frontier",
    "measure_candidates",
    "mixed_precision_config",
    "search_mixed_precision",
    "solve_assignment",
]

_A8 = QTensorConfig()
_BIAS32 = QTensorConfig(bit_width=32)
_FP8 = QTensorConfig(dtype=Dtype.fp8_e4m3)


def _w_a8(bits: int) -> QLayerConfig:
    return QLayerConfig(weight=QTensorConfig(bit_width=bits, qscheme=QSchemeType.per_channel), input_tensors=_A8,
                        bias=_BIAS32)


#: Named candidate layer configs (the command line's ``--candidates``); ``None`` is float. Per-group and fp8
#: candidates keep the bias in float (an integer bias needs a per-tensor/per-channel int weight scale).
#: ``w4a8_g32`` pads a layer narrower than 32 input channels or not a multiple of them (``pad_groups``, logged):
#: a candidate is tried on every layer, and the sizes it reports count the padded groups.
CANDIDATES: dict[str, QuantizationConfig | None] = {
    "w8a8": _w_a8(8),
    "w6a8": _w_a8(6),
    "w4a8": _w_a8(4),
    "w3a8": _w_a8(3),
    "w2a8": _w_a8(2),
    "w4a8_g32": QLayerConfig(weight=QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32,
                                                  pad_groups=True), input_tensors=_A8),
    "fp8": QLayerConfig(weight=dataclasses.replace(_FP8, qscheme=QSchemeType.per_channel), input_tensors=_FP8),
    "float": None,
}
DEFAULT_CANDIDATES = ("w8a8", "w4a8", "w4a8_g32", "w2a8", "fp8", "float")

#: Steps of the budget in the knapsack.
RESOLUTION = 2000


class BudgetError(QuarkBrevitasError):
    """No assignment of the candidates meets the budget (the message says what the candidates can reach)."""


def candidate_label(candidate: QuantizationConfig | None) -> str:
    """The candidate's name in :data:`CANDIDATES`, or a short description of its weight and input formats."""
    for name, known in CANDIDATES.items():
        if known == candidate:
            return name
    parts = [f"{role[0].upper()}: {getattr(candidate, role).short()}" for role in ("weight", "input_tensors")
             if getattr(candidate, role) is not None]
    return "; ".join(parts) or "quantized"


def _check_candidates(candidates: Sequence[QuantizationConfig | None]) -> list[QuantizationConfig | None]:
    if isinstance(candidates, QuantizationConfig) or not isinstance(candidates, Sequence) or not candidates:
        raise TypeError("candidates must be a non-empty list of QLayerConfig (None for float)")
    for index, candidate in enumerate(candidates):
        if candidate is not None and not isinstance(candidate, QuantizationConfig):
            raise TypeError(f"candidates[{index}]: expected a QLayerConfig or None, got {type(candidate).__name__}")
        if candidate is not None and all(getattr(candidate, role) is None for role in
                                         ("weight", "input_tensors", "output_tensors", "bias")):
            raise ValueError(f"candidates[{index}]: a QLayerConfig without any spec quantizes nothing; use None for "
                             "float")
    if all(candidate is None for candidate in candidates):
        raise ValueError("candidates: at least one must be a QLayerConfig (None alone is float everywhere)")
    return list(candidates)


def _base(base_config: Config | None) -> Config:
    """The non-hierarchy parts (algorithms, backend) of the returned configs."""
    if base_config is None:
        return Config(global_quant_config=QLayerConfig())
    if not isinstance(base_config, Config):
        raise TypeError(f"base_config must be a Config, got {type(base_config).__name__}")
    for name in ("layer_type_quant_config", "layer_quant_config", "exclude"):
        if getattr(base_config, name):
            raise ValueError(f"base_config.{name} must be empty: the search sets every layer's config itself (the "
                             "base config gives the algorithms and the backend)")
    return base_config


def _with_global(base: Config, candidate: QuantizationConfig) -> Config:
    return dataclasses.replace(base, global_quant_config=candidate, layer_type_quant_config={},
                               layer_quant_config={}, exclude=[])


# ===================================================================== measurements
@dataclass
class CandidateMeasurements:
    """Per quantizable layer (model order) and candidate: the output SQNR with only that layer quantized with it
    (``inf`` for float), and the storage: weight elements, weight bits, bias bits; plus the bits of the rest."""

    names: list[str]
    module_types: list[str]
    candidates: list[QuantizationConfig | None]
    sqnr_db: np.ndarray  # [layers, candidates]
    weight_bits: np.ndarray  # [layers, candidates]
    bias_bits: np.ndarray  # [layers, candidates]
    weights: np.ndarray  # [layers]
    other_bits: int
    exact: bool = False

    @property
    def noise(self) -> np.ndarray:
        """Output noise power relative to the signal, per layer and candidate: ``10^(-SQNR/10)``."""
        return np.power(10.0, -self.sqnr_db / 10.0)

    def average_bits(self, assignment: Sequence[int]) -> float:
        rows = np.arange(len(self.names))
        return float(self.weight_bits[rows, list(assignment)].sum() / self.weights.sum())

    def total_bytes(self, assignment: Sequence[int]) -> float:
        rows = np.arange(len(self.names))
        index = list(assignment)
        return float(self.weight_bits[rows, index].sum() + self.bias_bits[rows, index].sum() + self.other_bits) / 8

    def predicted_sqnr_db(self, assignment: Sequence[int]) -> float:
        """The additive model's SQNR of the combined model."""
        noise = float(self.noise[np.arange(len(self.names)), list(assignment)].sum())
        return math.inf if noise == 0.0 else -10.0 * math.log10(noise)

    def layer_configs(self, assignment: Sequence[int]) -> dict[str, QuantizationConfig | None]:
        return {name: self.candidates[c] for name, c in zip(self.names, assignment)}


def measure_candidates(model: nn.Module, candidates: Sequence[QuantizationConfig | None], calib_loader: Any, *,
                       base_config: Config | None = None, exact: bool = False, max_batches: int | None = None,
                       container: Container | None = None, batch_to_inputs: BatchToInputs | None = None
                       ) -> CandidateMeasurements:
    """Step 1 of the module docstring: every layer with every candidate, alone (``model`` is not modified)."""
    candidates = _check_candidates(candidates)
    base = _base(base_config)
    probe = next(c for c in candidates if c is not None)
    size = model_size(model, _with_global(base, probe), container)
    names = [layer.name for layer in size.layers]
    modules = dict(model.named_modules())
    sqnr = np.full((len(names), len(candidates)), math.inf)
    weight_bits = np.zeros_like(sqnr)
    bias_bits = np.zeros_like(sqnr)
    for j, candidate in enumerate(candidates):
        for i, name in enumerate(names):
            storage = layer_storage(name, modules[name], candidate)
            weight_bits[i, j], bias_bits[i, j] = storage.weight_bits, storage.bias_bits
    if max_batches is None and not exact:
        max_batches = DEFAULT_MAX_BATCHES
    metric = Metric(model, evaluation_data(calib_loader, max_batches, batch_to_inputs))
    float_units = None if exact else pre_algorithm_layers(model, _with_global(base, probe), calib_loader, container,
                                                          batch_to_inputs)
    progress = tqdm(total=len(names) * sum(c is not None for c in candidates), desc="Candidates per layer",
                    leave=False, disable=None)
    with progress:
        for j, candidate in enumerate(candidates):
            if candidate is None:
                continue
            config = _with_global(base, candidate)
            label = candidate_label(candidate)
            if exact:
                for i, name in enumerate(names):
                    variant = dataclasses.replace(config, exclude=[literal_name(n) for n in names if n != name])
                    quant = ModelQuantizer(variant, container).quantize_model(model, calib_loader,
                                                                             batch_to_inputs=batch_to_inputs)
                    sqnr[i, j] = metric(quant, f"{name} {label}")
                    progress.update()
                continue
            quant = ModelQuantizer(config, container).quantize_model(model, calib_loader,
                                                                    batch_to_inputs=batch_to_inputs)
            units = quantized_layers(quant, container)
            for i, name in enumerate(names):
                if name not in units:
                    raise ModelError(f"layer {name!r} is not a quantized layer of the model quantized with {label} "
                                     f"(found: {sorted(units)}); use exact=True")
                with only_enabled(units, [name], float_units):
                    sqnr[i, j] = metric(quant, f"{name} {label}")
                progress.update()
    return CandidateMeasurements(names, [layer.module_type for layer in size.layers], candidates, sqnr, weight_bits,
                                 bias_bits, np.array([layer.weights for layer in size.layers]), size.other_bits, exact)


# ===================================================================== the knapsack
def _costs(measurements: CandidateMeasurements, bytes_budget: bool) -> np.ndarray:
    return measurements.weight_bits + measurements.bias_bits if bytes_budget else measurements.weight_bits


def _budget_capacity(measurements: CandidateMeasurements, budget_bits: float | None,
                     budget_bytes: float | None) -> tuple[np.ndarray, float]:
    """The costs the budget constrains and the capacity, in bits."""
    if (budget_bits is None) == (budget_bytes is None):
        raise ValueError("give exactly one of budget_bits and budget_bytes")
    if budget_bits is not None:
        return _costs(measurements, False), float(budget_bits) * float(measurements.weights.sum())
    return _costs(measurements, True), float(budget_bytes) * 8 - measurements.other_bits


def solve_assignment(measurements: CandidateMeasurements, *, budget_bits: float | None = None,
                     budget_bytes: float | None = None, forced: Mapping[int, int] | None = None,
                     resolution: int = RESOLUTION) -> list[int] | None:
    """The candidate index per layer minimising the summed output noise within the budget (step 2 of the module
    docstring); ``forced`` fixes some layers' candidates (layer index -> candidate index). ``None`` if nothing fits.
    """
    costs, capacity = _budget_capacity(measurements, budget_bits, budget_bytes)
    return knapsack(costs, measurements.noise, capacity, forced or {}, resolution)


def frontier(measurements: CandidateMeasurements, *, bytes_budget: bool = False, points: int = 24) -> list[list[int]]:
    """Knapsack optima from the cheapest to the most expensive possible assignment (distinct, sorted by cost):
    the additive model's size/noise Pareto frontier."""
    costs = _costs(measurements, bytes_budget)
    low, high = float(costs.min(axis=1).sum()), float(costs.max(axis=1).sum())
    found: list[list[int]] = []
    for capacity in np.linspace(low, high, points) * (1 + 1e-9) + 1.0:
        assignment = knapsack(costs, measurements.noise, float(capacity), {}, RESOLUTION)
        if assignment is not None and assignment not in found:
            found.append(assignment)
    rows = np.arange(len(measurements.names))
    return sorted(found, key=lambda a: float(costs[rows, a].sum()))


# ===================================================================== the config
def mixed_precision_config(model: nn.Module, layer_configs: Mapping[str, QuantizationConfig | None],
                           base_config: Config | None = None, container: Container | None = None) -> Config:
    """The Config that gives each named layer exactly its config (``None``: float), as step 4 of the module
    docstring says; checked against ``model``'s plan."""
    base = _base(base_config)
    chosen = [c for c in layer_configs.values() if c is not None]
    if not chosen:
        raise BudgetError("every layer stays float in this assignment: there is nothing to quantize (lower the "
                          "budget, raise the metric target, or leave None out of the candidates)")
    distinct: list[QuantizationConfig] = []
    for candidate in chosen:
        if candidate not in distinct:
            distinct.append(candidate)
    roles = ("weight", "input_tensors", "output_tensors", "bias")

    def defers_cleanly(top: QuantizationConfig) -> bool:  # no chosen config inherits a spec from ``top``
        return all(getattr(top, r) is None for c in distinct for r in roles if getattr(c, r) is None)

    usable = [c for c in distinct if defers_cleanly(c)]
    top = max(usable, key=chosen.count) if usable else QLayerConfig()
    config = dataclasses.replace(
        base, global_quant_config=top, layer_type_quant_config={},
        layer_quant_config={literal_name(name): c for name, c in layer_configs.items() if c is not None and c != top},
        exclude=[literal_name(name) for name, c in layer_configs.items() if c is None])
    planned = {row.name: row.layer_config for row in ModelQuantizer(config, container).plan(model) if row.sources}
    wrong = [name for name, c in layer_configs.items() if planned.get(name, "missing") != c]
    if wrong or set(planned) != set(layer_configs):
        raise ModelError(f"the mixed-precision config does not resolve to the chosen layer configs for {wrong or ''} "
                         f"(planned layers {sorted(planned)}, assigned {sorted(layer_configs)})")
    return config


# ===================================================================== the search
@dataclass
class MixedPrecisionSearch:
    """What :func:`search_mixed_precision` found: the config, its assignment (candidate index per layer), and every
    assignment it measured for real, as ``(assignment, average weight bits, bytes, measured metric)``."""

    config: Config
    assignment: list[int]
    measurements: CandidateMeasurements
    metric_name: str
    higher_is_better: bool
    float_metric: float
    tried: list[tuple[list[int], float, float, float]] = field(default_factory=list)

    @property
    def metric(self) -> float:
        return next(value for assignment, _, _, value in self.tried if assignment == self.assignment)

    def rows(self) -> list[dict[str, Any]]:
        """One row per layer: its chosen candidate, weight bits and the SQNR measured with it alone."""
        m = self.measurements
        return [{"name": name, "module_type": m.module_types[i], "candidate": candidate_label(m.candidates[c]),
                 "weights": int(m.weights[i]), "average_weight_bits": float(m.weight_bits[i, c] / m.weights[i]),
                 "alone_sqnr_db": float(m.sqnr_db[i, c])} for i, (name, c) in enumerate(zip(m.names, self.assignment))]


def search_mixed_precision(model: nn.Module, candidates: Sequence[QuantizationConfig | None], calib_loader: Any,
                           budget_bits: float | None = None, budget_bytes: float | None = None,
                           min_metric: float | None = None, eval_fn: EvalFn | None = None, *,
                           base_config: Config | None = None, higher_is_better: bool = True, exact: bool = False,
                           max_batches: int | None = None, refine: int = 4,
                           measurements: CandidateMeasurements | None = None, container: Container | None = None,
                           batch_to_inputs: BatchToInputs | None = None) -> MixedPrecisionSearch:
    """:func:`auto_mixed_precision` with everything it found (pass ``measurements`` to reuse step 1)."""
    if budget_bits is not None and budget_bytes is not None:
        raise ValueError("give budget_bits or budget_bytes, not both")
    if budget_bits is None and budget_bytes is None and min_metric is None:
        raise ValueError("give a budget: budget_bits (average weight bits), budget_bytes or min_metric")
    if refine < 1:
        raise ValueError(f"refine must be >= 1 (assignments measured for real), got {refine}")
    base = _base(base_config)
    if measurements is None:
        measurements = measure_candidates(model, candidates, calib_loader, base_config=base, exact=exact,
                                          max_batches=max_batches, container=container,
                                          batch_to_inputs=batch_to_inputs)
    m = measurements
    if max_batches is None and not exact:
        max_batches = DEFAULT_MAX_BATCHES
    metric = Metric(model, evaluation_data(calib_loader, max_batches, batch_to_inputs), eval_fn, higher_is_better)
    tried: dict[tuple[int, ...], float] = {}

    def measure(assignment: list[int]) -> float:
        key = tuple(assignment)
        if key not in tried:
            config = mixed_precision_config(model, m.layer_configs(assignment), base, container)
            quant = ModelQuantizer(config, container).quantize_model(model, calib_loader,
                                                                    batch_to_inputs=batch_to_inputs)
            tried[key] = metric(quant, "Refinement")
            logger.info("assignment %s: %.3f average weight bits, %s %.4g",
                        [candidate_label(m.candidates[c]) for c in assignment], m.average_bits(assignment),
                        metric.name, tried[key])
        return tried[key]

    budget = {"budget_bits": budget_bits, "budget_bytes": budget_bytes}
    has_budget = budget_bits is not None or budget_bytes is not None
    if min_metric is None:
        proposals = _proposals(m, budget, refine)
        for assignment in tqdm(proposals, desc="Refinement", leave=False, disable=None):
            measure(assignment)
        chosen = max(proposals, key=lambda a: (-metric.sort_key(tried[tuple(a)]), -m.average_bits(a)))
    else:
        points = frontier(m, bytes_budget=budget_bytes is not None)
        if has_budget:
            costs, capacity = _budget_capacity(m, budget_bits, budget_bytes)
            rows = np.arange(len(m.names))
            points = [a for a in points if costs[rows, a].sum() <= capacity]
        chosen = _cheapest_meeting(points, min_metric, metric, measure)
    return MixedPrecisionSearch(mixed_precision_config(model, m.layer_configs(chosen), base, container), chosen, m,
                                metric.name, metric.higher_is_better, metric.float_value,
                                [(list(a), m.average_bits(a), m.total_bytes(a), v) for a, v in tried.items()])


def _proposals(m: CandidateMeasurements, budget: Mapping[str, float | None], count: int) -> list[list[int]]:
    """The knapsack optimum, then the best uniform assignment within the budget, then the best assignments with
    one layer forced to another candidate, by predicted noise: ``count`` distinct assignments in all."""
    best = solve_assignment(m, **budget)
    if best is None:
        costs, capacity = _budget_capacity(m, budget["budget_bits"], budget["budget_bytes"])
        cheapest = [int(c) for c in costs.argmin(axis=1)]
        raise BudgetError(f"no assignment of the candidates fits the budget; the cheapest (every layer at its cheapest "
                          f"candidate) has {m.average_bits(cheapest):.3f} average weight bits and "
                          f"{m.total_bytes(cheapest):.0f} bytes")
    costs, capacity = _budget_capacity(m, budget["budget_bits"], budget["budget_bytes"])
    rows = np.arange(len(m.names))
    noise = m.noise
    uniform = [[c] * len(m.names) for c in range(len(m.candidates))]
    uniform = [a for a in uniform if costs[rows, a].sum() <= capacity]
    uniform.sort(key=lambda a: noise[rows, a].sum())
    forced = [solve_assignment(m, **budget, forced={i: c}) for i in range(len(m.names))
              for c in range(len(m.candidates)) if c != best[i]]
    forced = sorted((a for a in forced if a is not None), key=lambda a: noise[rows, a].sum())
    proposals: list[list[int]] = []
    for assignment in [best, *uniform[:1], *forced]:
        if assignment not in proposals:
            proposals.append(assignment)
    return proposals[:count]


def _cheapest_meeting(points: list[list[int]], min_metric: float, metric: Metric, measure: Any) -> list[int]:
    """Bisection over the frontier (sorted by cost) for the cheapest point whose measured metric reaches
    ``min_metric`` (the measured metric is assumed to improve with cost along the frontier)."""
    if not points:
        raise BudgetError("no assignment of the candidates fits the budget")

    def meets(index: int) -> bool:
        value = measure(points[index])
        return value == min_metric or metric.better(value, min_metric)

    if not meets(len(points) - 1):
        raise BudgetError(f"min_metric {min_metric} is out of reach: the most precise assignment within the budget "
                          f"measures {measure(points[-1]):.4g} ({metric.name})")
    index = bisect.bisect_left(range(len(points)), True, key=meets)
    return points[index]


def auto_mixed_precision(model: nn.Module, candidates: Sequence[QuantizationConfig | None], calib_loader: Any,
                         budget_bits: float | None = None, budget_bytes: float | None = None,
                         min_metric: float | None = None, eval_fn: EvalFn | None = None, **options: Any) -> Config:
    """A Config giving each layer of ``model`` one of ``candidates`` (``None``: float), the most accurate within
    ``budget_bits`` (average weight bits) or ``budget_bytes``, or the smallest reaching ``min_metric`` (output SQNR
    in dB, or ``eval_fn(model)``'s value); see the module docstring for how. ``model`` is not modified.

    Keyword options (see :func:`search_mixed_precision`): ``base_config`` (algorithms and backend of the result),
    ``higher_is_better`` (False for a perplexity), ``exact``, ``max_batches``, ``refine`` (assignments quantized
    for real, default 4), ``container``, ``batch_to_inputs``.
    """
    return search_mixed_precision(model, candidates, calib_loader, budget_bits, budget_bytes, min_metric, eval_fn,
                                  **options).config
