"""Canaries of the adapter: scales and weight grids (quark_brevitas/brevitas_adapter/grids.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

import pytest
import torch
from helpers.adapter_layers import quant_linear
from torch import nn

from quark_brevitas import brevitas_adapter as adapter


def test_scale_parameters_live_in_scaling_impl() -> None:
    layer = quant_linear()
    scales = adapter.scale_parameters(nn.Sequential(layer))
    assert scales, "no parameter under a 'scaling_impl' module: Brevitas renamed the scale module"
    assert all(".scaling_impl." in name for name in scales)
    assert adapter.scale_impl(layer.weight_quant) is not None


def test_scale_initialisation_flags() -> None:
    """``init_done`` (parameter-from-stats scalings) / ``counter`` and ``collect_stats_steps`` (runtime
    statistics): marking a scale initialised must stop Brevitas from re-deriving it."""
    from quark_brevitas.config import QTensorConfig

    layer = quant_linear(act=QTensorConfig())
    impl = adapter.scale_impl(layer.input_quant)
    assert hasattr(impl, "counter") and hasattr(impl, "collect_stats_steps"), type(impl).__name__
    with torch.no_grad():
        impl.value.fill_(0.5)
    adapter.mark_scale_initialised(impl)
    layer.train()
    layer(torch.randn(4, 8) * 100)
    assert float(impl.value.detach()) == 0.5, "a scale marked initialised was re-estimated from statistics"
    weight_impl = adapter.scale_impl(layer.weight_quant)
    assert hasattr(weight_impl, "init_done"), type(weight_impl).__name__


def _grid_specs():
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import Dtype, ParamType, QSchemeType, RoundType, ScaleType

    return [
        QTensorConfig(),
        QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
        QTensorConfig(bit_width=3, symmetric=False),
        QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=4, symmetric=False),
        QTensorConfig(qscheme=QSchemeType.per_group, group_size=4, bit_width=4, param_type=ParamType.mse),
        QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4, round_method=RoundType.round,
                      scale_type=ScaleType.pof2),
    ]


@pytest.mark.parametrize("spec", _grid_specs(), ids=lambda s: s.short())
def test_weight_grid_repeats_int_quant_and_reinitialises_from_any_tensor(spec) -> None:
    """Guards ``IntQuant`` (x / scale + zero point, float_to_int_impl, tensor_clamp_impl, min_int/max_int, then
    (codes - zero point) * scale), the proxy's QuantTensor scale/zero point, and ``init_done`` plus the
    parameter-from-stats value folding (x 1 for scales, + 0 for zero points) of weight scales and zero points."""
    layer = quant_linear(spec)
    grid = adapter.weight_grid(layer)
    assert torch.equal(grid.quantize(layer.weight.detach()), layer.quant_weight().value)
    other = torch.randn_like(layer.weight) * 3
    fresh = quant_linear(spec)
    with torch.no_grad():
        fresh.weight.copy_(other)
    expected = fresh.quant_weight().value  # a quantizer initialised from ``other`` the first time
    for _ in range(2):  # re-initialising twice must give the same grid (no accumulation in the parameters)
        grid = adapter.weight_grid(layer, other)
    assert torch.equal(grid.quantize(other), expected)
    with torch.no_grad():
        layer.weight.copy_(grid.quantize(other))
    assert torch.equal(layer.quant_weight().value, layer.weight), "values on the grid must stay where they are"
    with adapter.quantization_disabled(layer):  # works while quantization is switched off too
        assert torch.equal(adapter.weight_grid(layer, other).quantize(other), expected)


def test_int_weight_format() -> None:
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import Dtype, QSchemeType

    assert adapter.int_weight_format(quant_linear()) == adapter.IntWeightFormat(8, -1, True)
    per_group = QTensorConfig(dtype=Dtype.uint4, qscheme=QSchemeType.per_group, group_size=4, symmetric=False)
    assert adapter.int_weight_format(quant_linear(per_group)) == adapter.IntWeightFormat(4, 4, False)
    assert adapter.int_weight_format(quant_linear(QTensorConfig(dtype=Dtype.fp8_e4m3))) is None
    assert adapter.int_weight_format(nn.Linear(2, 2)) is None


def test_int_weight_format_runs_the_quantizer_once_for_what_bit_width_and_scale_read(monkeypatch) -> None:
    """Guards Brevitas's ``retrieve_attribute`` (``_cached_weight``, else a run on ``tracked_parameter_list[0]``),
    which ``proxy.bit_width()`` and ``proxy.scale()`` each go through: int_weight_format reads both from one run."""
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import QSchemeType

    for spec in (QTensorConfig(), QTensorConfig(qscheme=QSchemeType.per_channel)):
        layer = quant_linear(spec)
        proxy = layer.weight_quant
        with torch.no_grad():
            expected = (int(proxy.bit_width()), proxy.scale().numel() == 1)
        runs = _count_runs(monkeypatch, type(proxy))
        found = adapter.int_weight_format(layer)
        monkeypatch.undo()
        assert (found.bit_width, found.per_tensor) == expected and found.group_size == -1
        assert len(runs) == 1


def _count_runs(monkeypatch, proxy_class: type) -> list[int]:  # type: ignore[no-untyped-def]
    """A list that grows by one at each call of ``proxy_class``'s ``forward`` until the monkeypatch is undone."""
    runs: list[int] = []
    forward = proxy_class.forward
    monkeypatch.setattr(proxy_class, "forward", lambda self, *a, **k: (runs.append(1), forward(self, *a, **k))[1])
    return runs


@pytest.mark.parametrize("symmetric", [True, False])
def test_restart_activation_statistics_gives_a_fresh_calibration(symmetric: bool) -> None:
    """Guards ``ParameterFromRuntimeStatsScaling`` / ``ParameterFromRuntimeZeroPoint``: ``counter``, ``buffer``
    and ``value`` (1 for scales, 0 for zero points) are the whole calibration state."""
    from quark_brevitas.calibration import calibrate
    from quark_brevitas.config import QTensorConfig

    act = QTensorConfig(symmetric=symmetric)
    torch.manual_seed(1)
    first = [torch.randn(16, 8) for _ in range(3)]
    second = [torch.randn(16, 8) * 4 + 1 for _ in range(3)]
    layer, reference = quant_linear(act=act), quant_linear(act=act)
    calibrate(layer, first)
    assert adapter.has_static_activation_quantizers(layer)
    assert adapter.restart_activation_statistics(layer) >= 1
    calibrate(layer, second)
    calibrate(reference, second)
    assert torch.equal(layer.input_quant.scale(), reference.input_quant.scale())
    assert torch.equal(layer.input_quant.zero_point(), reference.input_quant.zero_point())
