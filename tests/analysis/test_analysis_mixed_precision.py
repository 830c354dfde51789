"""Tests of automatic mixed precision: the knapsack against brute force, the generated Config (YAML round trip,
exactly the planned per-layer configs, the quantized layers' real formats), budgets and errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos, integer_weights
from quark_brevitas.analysis import (
    CANDIDATES,
    BudgetError,
    CandidateMeasurements,
    auto_mixed_precision,
    measure_candidates,
    mixed_precision_config,
    model_size,
    search_mixed_precision,
    solve_assignment,
)
from quark_brevitas.analysis.mixed_precision import frontier

NAMES = ("w8a8", "w4a8", "w2a8", "float")


@pytest.fixture(scope="module")
def candidates() -> list:
    return [CANDIDATES[name] for name in NAMES]


@pytest.fixture(scope="module")
def measurements(digits_model, digits_data, candidates) -> CandidateMeasurements:
    return measure_candidates(digits_model, candidates, digits_data.calib)


def _brute_force(m: CandidateMeasurements, capacity_bits: float) -> list[int]:
    best, best_noise = None, math.inf
    rows = np.arange(len(m.names))
    for assignment in itertools.product(range(len(m.candidates)), repeat=len(m.names)):
        if m.weight_bits[rows, list(assignment)].sum() <= capacity_bits:
            noise = m.noise[rows, list(assignment)].sum()
            if noise < best_noise:
                best, best_noise = list(assignment), noise
    return best


def test_measurements(measurements: CandidateMeasurements, digits_model, candidates) -> None:
    assert measurements.names == ["conv1", "conv2", "fc1", "fc2"]
    float_column = NAMES.index("float")
    assert np.all(np.isinf(measurements.sqnr_db[:, float_column]))
    for i in range(len(measurements.names)):  # more bits, less noise, for every layer
        assert measurements.sqnr_db[i, 0] > measurements.sqnr_db[i, 1] > measurements.sqnr_db[i, 2]
    # Storage per choice is the plan-based count of the config that gives the layer that candidate.
    for j, candidate in enumerate(candidates):
        if candidate is None:
            continue
        size = model_size(digits_model, Config(candidate))
        assert list(measurements.weight_bits[:, j]) == [layer.weight_bits for layer in size.layers]


def test_exact_measurement_runs_the_pipeline_per_layer(measurements, digits_model, digits_data) -> None:
    from quark_brevitas.analysis.sensitivity import sensitivity

    exact = measure_candidates(digits_model, [CANDIDATES["w2a8"]], digits_data.calib, exact=True, max_batches=4)
    ranking = sensitivity(digits_model, Config(CANDIDATES["w2a8"]), digits_data.calib, modes=("only",))
    by_name = {row.name: row.only for row in ranking}
    for i, name in enumerate(exact.names):  # exact (pipeline with exclude) == cheap toggles, without algorithms
        assert exact.sqnr_db[i, 0] == pytest.approx(by_name[name], abs=1e-4)
        assert exact.sqnr_db[i, 0] == pytest.approx(measurements.sqnr_db[i, NAMES.index("w2a8")], abs=1e-4)


@pytest.mark.parametrize("budget", [2.2, 3.0, 4.103, 5.0, 9.0, 20.0])
def test_knapsack_equals_brute_force(measurements: CandidateMeasurements, budget: float) -> None:
    expected = _brute_force(measurements, budget * measurements.weights.sum())
    got = solve_assignment(measurements, budget_bits=budget)
    assert got is not None and measurements.average_bits(got) <= budget
    rows = np.arange(len(measurements.names))
    assert measurements.noise[rows, got].sum() == pytest.approx(measurements.noise[rows, expected].sum(), rel=1e-9)


def test_knapsack_bytes_budget_and_forced_layers(measurements: CandidateMeasurements) -> None:
    uniform_w4 = [NAMES.index("w4a8")] * 4
    budget = measurements.total_bytes(uniform_w4)
    got = solve_assignment(measurements, budget_bytes=budget)
    assert measurements.total_bytes(got) <= budget
    assert solve_assignment(measurements, budget_bits=1.0) is None  # below every candidate
    forced = solve_assignment(measurements, budget_bits=5.0, forced={2: NAMES.index("w2a8")})
    assert forced[2] == NAMES.index("w2a8") and measurements.average_bits(forced) <= 5.0
    points = frontier(measurements)
    bits = [measurements.average_bits(a) for a in points]
    assert bits == sorted(bits) and len(points) >= 3


def test_generated_config_round_trips_and_quantizes_to_the_plan(measurements, digits_model, digits_data,
                                                                 candidates) -> None:
    search = search_mixed_precision(digits_model, candidates, digits_data.calib, budget_bits=4.103,
                                    measurements=measurements)
    config = search.config
    assert model_size(digits_model, config).average_weight_bits <= 4.103
    assert Config.from_yaml(config.to_yaml()) == config
    chosen = measurements.layer_configs(search.assignment)
    planned = {row.name: row.layer_config for row in ModelQuantizer(Config.from_yaml(config.to_yaml()))
               .plan(digits_model) if row.sources}
    assert planned == chosen
    # The quantized model has exactly those formats: integer weights at the chosen widths, float layers untouched.
    quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
    weights = integer_weights(quant)
    modules = dict(quant.named_modules())
    for name, candidate in chosen.items():
        if candidate is None:
            assert type(modules[name]) in (nn.Conv2d, nn.Linear) and name not in weights
        else:
            assert weights[name].bit_width == candidate.weight.bit_width, name
    # Its measured metric is the one reported for the chosen assignment.
    assert search.metric == max(value for _, _, _, value in search.tried)


def test_mixed_precision_config_places_each_candidate(digits_model) -> None:
    w8, w4, fp8 = CANDIDATES["w8a8"], CANDIDATES["w4a8"], CANDIDATES["fp8"]
    weight_only = QLayerConfig(weight=QTensorConfig(bit_width=3))
    wanted = {"conv1": w8, "conv2": weight_only, "fc1": w4, "fc2": None}
    config = mixed_precision_config(digits_model, wanted)
    # A weight-only layer must not inherit the input spec of a global level: only the weight-only config (whose
    # unset roles every other candidate sets too) can be the global level.
    assert config.global_quant_config == weight_only and config.exclude == ["fc2"]
    assert config.layer_quant_config == {"conv1": w8, "fc1": w4}
    wanted = {"conv1": w8, "conv2": weight_only, "fc1": QLayerConfig(input_tensors=QTensorConfig()), "fc2": w4}
    config = mixed_precision_config(digits_model, wanted)  # no config can be the global level: it stays empty
    assert config.global_quant_config == QLayerConfig() and len(config.layer_quant_config) == 4
    wanted = {"conv1": w8, "conv2": w8, "fc1": w4, "fc2": w8}
    config = mixed_precision_config(digits_model, wanted)  # the most common candidate is the global level
    assert config.global_quant_config == w8 and config.layer_quant_config == {"fc1": w4} and not config.exclude
    wanted = {"conv1": w8, "conv2": w8, "fc1": fp8, "fc2": w8}
    config = mixed_precision_config(digits_model, wanted)  # fp8 has no bias spec: w8's int32 bias must not reach it
    assert config.global_quant_config == fp8 and list(config.layer_quant_config) == ["conv1", "conv2", "fc2"]
    with pytest.raises(BudgetError, match="float"):
        mixed_precision_config(digits_model, dict.fromkeys(wanted))


def test_min_metric_gives_the_cheapest_assignment_that_reaches_it(measurements, digits_model, digits_data,
                                                                  candidates) -> None:
    search = search_mixed_precision(digits_model, candidates, digits_data.calib, min_metric=30.0,
                                    measurements=measurements)
    assert search.metric >= 30.0
    cheaper = [(bits, value) for _, bits, _, value in search.tried
               if bits < measurements.average_bits(search.assignment)]
    assert all(value < 30.0 for _, value in cheaper)  # every cheaper frontier point measured misses it
    with pytest.raises(BudgetError, match="out of reach"):
        search_mixed_precision(digits_model, candidates[:3], digits_data.calib, min_metric=80.0,
                               measurements=measure_candidates(digits_model, candidates[:3], digits_data.calib))


def test_eval_fn_drives_the_refinement(measurements, digits_model, digits_data, candidates) -> None:
    from quark_brevitas.cli.digits import evaluate

    calls = []

    def accuracy(model: nn.Module) -> float:
        calls.append(model)
        return evaluate(model, digits_data.calib)

    config = auto_mixed_precision(digits_model, candidates, digits_data.calib, budget_bits=3.0, eval_fn=accuracy,
                                  measurements=measurements, refine=3)
    assert len(calls) == 1 + 3  # the float model, then the three proposals
    assert model_size(digits_model, config).average_weight_bits <= 3.0


def test_algorithms_of_the_base_config_are_kept(digits_model, digits_data) -> None:
    base = Config(QLayerConfig(), algo_config=[algos.GPTQ()])
    config = auto_mixed_precision(digits_model, [CANDIDATES["w8a8"], CANDIDATES["w4a8"]], digits_data.calib,
                                  budget_bits=6.0, base_config=base, refine=1)
    assert config.algo_config == [algos.GPTQ()]
    assert model_size(digits_model, config).average_weight_bits <= 6.0


def test_bad_arguments(digits_model, digits_data, measurements, candidates) -> None:
    with pytest.raises(TypeError, match="candidates"):
        auto_mixed_precision(digits_model, CANDIDATES["w8a8"], digits_data.calib, budget_bits=4)
    with pytest.raises(TypeError, match=r"candidates\[1\]"):
        auto_mixed_precision(digits_model, [CANDIDATES["w8a8"], "w4"], digits_data.calib, budget_bits=4)
    with pytest.raises(ValueError, match="without any spec"):
        auto_mixed_precision(digits_model, [QLayerConfig()], digits_data.calib, budget_bits=4)
    with pytest.raises(ValueError, match="not both"):
        auto_mixed_precision(digits_model, candidates, digits_data.calib, budget_bits=4, budget_bytes=1e4)
    with pytest.raises(ValueError, match="give a budget"):
        auto_mixed_precision(digits_model, candidates, digits_data.calib)
    with pytest.raises(ValueError, match="base_config.exclude"):
        auto_mixed_precision(digits_model, candidates, digits_data.calib, budget_bits=4,
                             base_config=Config(QLayerConfig(), exclude=["fc1"]))
    with pytest.raises(BudgetError, match="cheapest"):
        search_mixed_precision(digits_model, candidates, digits_data.calib, budget_bits=1.0,
                               measurements=measurements)


def test_a_transformer_gets_a_config_for_its_attention() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0),
                          nn.Linear(32, 4)).eval()
    data = [torch.randn(4, 6, 8) for _ in range(2)]
    search = search_mixed_precision(model, [CANDIDATES["w8a8"], CANDIDATES["w4a8"]], data, budget_bits=6.0, refine=2)
    assert "1.self_attn" in search.measurements.names
    planned = {row.name: row.layer_config for row in ModelQuantizer(search.config).plan(model) if row.sources}
    assert planned == search.measurements.layer_configs(search.assignment)
