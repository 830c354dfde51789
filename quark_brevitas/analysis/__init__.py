"""See where accuracy goes: per-layer comparison, sensitivity analysis, automatic mixed precision, plots.

- :func:`compare_layers` (float model vs its quantized version, layer by layer: SQNR of weight, input, output,
  in the model's execution and alone), :func:`layer_table`, :func:`plot_layer_sqnr`;
- :func:`sensitivity` (one layer quantized at a time, all layers but one; cheap or exact), :func:`sensitivity_table`,
  :func:`plot_sensitivity`;
- :func:`auto_mixed_precision` (a Config choosing one of several candidate layer configs per layer, under an
  average-weight-bits or bytes budget or a metric target), :func:`search_mixed_precision` (the same, with what it
  measured), :func:`model_size` (storage of a model under a config, from the plan);
- :func:`write_rows` / :func:`write_json` / :func:`write_csv` and :func:`plot_pareto`.

Everything quantizes through :class:`~quark_brevitas.api.ModelQuantizer` (the pipeline), feeds batches through
the pipeline's :class:`~quark_brevitas.calibration.data.CalibrationData` loop, and leaves the caller's model untouched.
Plots need the ``plot`` extra (matplotlib).
"""

from quark_brevitas.analysis.compare import LayerComparison, compare_layers
from quark_brevitas.analysis.metrics import Rows
from quark_brevitas.analysis.mixed_precision import (
    CANDIDATES,
    DEFAULT_CANDIDATES,
    BudgetError,
    CandidateMeasurements,
    MixedPrecisionSearch,
    auto_mixed_precision,
    candidate_label,
    measure_candidates,
    mixed_precision_config,
    search_mixed_precision,
    solve_assignment,
)
from quark_brevitas.analysis.plots import plot_layer_sqnr, plot_pareto, plot_sensitivity
from quark_brevitas.analysis.report import (
    format_table,
    layer_table,
    most_harmful_layer,
    sensitivity_table,
    write_csv,
    write_json,
    write_rows,
)
from quark_brevitas.analysis.sensitivity import SensitivityRow, sensitivity
from quark_brevitas.analysis.sizes import LayerStorage, ModelSize, model_size

__all__ = [
    "CANDIDATES",
    "DEFAULT_CANDIDATES",
    "BudgetError",
    "CandidateMeasurements",
    "LayerComparison",
    "LayerStorage",
    "MixedPrecisionSearch",
    "ModelSize",
    "Rows",
    "SensitivityRow",
    "auto_mixed_precision",
    "candidate_label",
    "compare_layers",
    "format_table",
    "layer_table",
    "measure_candidates",
    "mixed_precision_config",
    "model_size",
    "most_harmful_layer",
    "plot_layer_sqnr",
    "plot_pareto",
    "plot_sensitivity",
    "search_mixed_precision",
    "sensitivity",
    "sensitivity_table",
    "solve_assignment",
    "write_csv",
    "write_json",
    "write_rows",
]
