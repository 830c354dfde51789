"""Quantization-aware training: quantized models train, scales learn or stay fixed, TQT thresholds
stay powers of two, and a QAT-trained model exports and matches in onnxruntime."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelExporter, ModelQuantizer, QLayerConfig, QTensorConfig, algos
from quark_brevitas.qat import QATConfig, QATError, prepare_qat, scale_parameters, threshold_from_tensor
from quark_brevitas.types import QSchemeType, ScaleType, TQTThresholdInitMeth

# The narrow int2 grid (-1..1) these tests were sized on: on the full -2..1 default the first steps' losses are
# 0.05-0.17 and 12 steps cut them by 18 %, under the 30 % the learning test asks for.
W2A4 = QLayerConfig(weight=QTensorConfig(bit_width=2, qscheme=QSchemeType.per_channel, narrow_range=True),
                    input_tensors=QTensorConfig(bit_width=4))
W4A8_POF2 = QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, scale_type=ScaleType.pof2),
                         input_tensors=QTensorConfig(bit_width=8, scale_type=ScaleType.pof2))


def quantize(model, data, layer, **kwargs):
    return ModelQuantizer(Config(global_quant_config=layer, **kwargs)).quantize_model(model, data.calib)


def train_steps(model: nn.Module, data, steps: int, lr: float = 3e-3) -> list[float]:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    batches = iter(data.train)
    model.train()
    for _ in range(steps):
        images, target = next(batches)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_loss_decreases_and_scales_learn(digits_model, digits_data) -> None:
    torch.manual_seed(0)
    quant = prepare_qat(quantize(digits_model, digits_data, W2A4), QATConfig(learn_scales=True))
    scales = scale_parameters(quant)
    assert len(scales) == 8  # weight and input scale of 2 convolutions and 2 linears
    before = {k: v.detach().clone() for k, v in scales.items()}
    losses = train_steps(quant, digits_data, 12)
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scales.values())
    assert all(not torch.equal(before[k], v) for k, v in scales.items())


def test_fixed_scales_stay_fixed(digits_model, digits_data) -> None:
    quant = prepare_qat(quantize(digits_model, digits_data, W2A4), QATConfig(learn_scales=False))
    scales = scale_parameters(quant)
    before = {k: v.detach().clone() for k, v in scales.items()}
    weight_before = quant.fc1.weight.detach().clone()
    train_steps(quant, digits_data, 4)
    assert all(torch.equal(before[k], v) for k, v in scales.items())
    assert not torch.equal(weight_before, quant.fc1.weight)


def _three_sd(x: torch.Tensor) -> float:
    """TQT's _3SD threshold: three standard deviations plus the magnitude of the mean."""
    return 3 * float(x.std()) + abs(float(x.mean()))


def _ll_j_brute_force(x: torch.Tensor, bit_width: int, bins: int = 2048, candidates: int = 13) -> float:
    """The _LL_J threshold written out from its description (README, QAT), in float64 numpy with plain loops:
    for each power-of-two threshold T from 2^(top-12) to 2^top (top = ceil(log2 max|x|)), compare the
    histogram of the nonzero |x| over [0, 2^top) in ``bins`` bins cut at T (the clipped mass counted in the last
    bin) with its quantized version (each of the 2^(b-1) levels' mass below T spread evenly over the bins of
    that level that hold data), by the symmetric KL (J) divergence with 1e-8 smoothing; the first smallest
    wins. Levels narrower than one bin are skipped."""
    mags = np.abs(x.detach().double().numpy().ravel())
    mags = mags[mags != 0]
    top = math.ceil(math.log2(mags.max()))
    hist = np.histogram(mags, bins=bins, range=(0.0, 2.0**top))[0].astype(np.float64)
    levels = 2 ** (bit_width - 1)
    best_j, best_t = math.inf, 2.0**top
    for k in range(top - candidates + 1, top + 1):
        kept = bins >> (top - k)
        if kept < levels:
            continue
        p = hist[:kept].copy()
        p[-1] += hist[kept:].sum()
        q = np.zeros(kept)
        width = kept // levels
        for start in range(0, kept, width):
            level = hist[start:start + width]
            used = level > 0
            if used.any():
                q[start:start + width][used] = level.sum() / used.sum()
        p, q = (p + 1e-8) / (p + 1e-8).sum(), (q + 1e-8) / (q + 1e-8).sum()
        j = float(np.sum((p - q) * (np.log(p) - np.log(q))))
        if j < best_j:
            best_j, best_t = j, 2.0**k
    return best_t


_THRESHOLDS = {TQTThresholdInitMeth._3SD: lambda x, bits: _three_sd(x), TQTThresholdInitMeth._LL_J: _ll_j_brute_force}


def _effective_scales(model: nn.Module) -> list[torch.Tensor]:
    return [m.quant_weight().scale for m in model.modules() if type(m).__name__ in ("QuantConv2d", "QuantLinear")]


@pytest.mark.parametrize("method", list(TQTThresholdInitMeth))
def test_tqt_thresholds_initialise_train_and_stay_powers_of_two(digits_model, digits_data, tmp_path, method) -> None:
    torch.manual_seed(0)
    quant = prepare_qat(quantize(digits_model, digits_data, W4A8_POF2), QATConfig(threshold_init=method),
                        digits_data.calib)
    # The initial fc2 weight threshold is the method's (computed here), rounded up to a power of two, over 2**(4-1).
    rows = quant.fc2.weight.detach()
    expected = torch.tensor([2.0 ** math.ceil(math.log2(_THRESHOLDS[method](r, 4))) / 8 for r in rows])
    torch.testing.assert_close(quant.fc2.quant_weight().scale.flatten(), expected)
    log_thresholds = {k: v.detach().clone() for k, v in scale_parameters(quant).items()}
    losses = train_steps(quant, digits_data, 10)
    assert all(math.isfinite(loss) for loss in losses)
    moved = [k for k, v in scale_parameters(quant).items() if not torch.equal(log_thresholds[k], v)]
    assert moved, "TQT thresholds received no update"
    quant.eval()
    for scale in _effective_scales(quant):
        exponents = torch.log2(scale)
        assert torch.equal(exponents, exponents.round()), scale
    report = ModelExporter(tmp_path / "tqt.onnx").export_onnx_model(quant, next(iter(digits_data.test))[0])
    assert report.max_abs_diff <= report.tolerance


def test_three_sd_threshold_on_known_statistics() -> None:
    """0.5 + 2 * (+-1, alternating): mean 0.5, standard deviation 2 * sqrt(n / (n - 1)) (sample std)."""
    n = 1000
    x = 0.5 + 2.0 * torch.tensor([1.0, -1.0]).repeat(n // 2)
    expected = 3 * 2.0 * math.sqrt(n / (n - 1)) + 0.5
    assert threshold_from_tensor(x, TQTThresholdInitMeth._3SD, 8) == pytest.approx(expected, rel=1e-6)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(100_000, generator=g) * 0.25 - 1.0
    assert threshold_from_tensor(y, TQTThresholdInitMeth._3SD, 8) == pytest.approx(_three_sd(y), rel=1e-6)
    assert _three_sd(y) == pytest.approx(3 * 0.25 + 1.0, rel=0.01)


def test_ll_j_threshold_known_by_construction() -> None:
    """4 bits: 8 levels of width 1/8 below the threshold 1. The data sit at the 8 level centres with counts
    alternating 1000 / 10, plus one outlier at 1.9, so max|x| = 1.9 and the largest candidate is 2. At T = 1
    every level holds one value (the quantized histogram equals the float one) and only the outlier's clipped
    count differs; at T = 2 each level merges a 1000 and a 10 (spread evenly: 505 / 505, far from the data);
    below 1 whole levels are clipped. So the best power-of-two threshold is 1, not max|x| rounded up."""
    counts = [1000 if j % 2 == 0 else 10 for j in range(8)]
    x = torch.cat([torch.full((c,), (j + 0.5) / 8) for j, c in enumerate(counts)] + [torch.tensor([1.9])])
    x = x * torch.where(torch.arange(len(x)) % 2 == 0, 1.0, -1.0)  # magnitudes count, signs do not
    assert threshold_from_tensor(x, TQTThresholdInitMeth._LL_J, 4) == 1.0
    assert _ll_j_brute_force(x, 4) == 1.0


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_ll_j_threshold_matches_brute_force(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for trial in range(20):
        x = torch.randn(int(torch.randint(16, 3000, (1,), generator=g)), generator=g) * (0.01 + 3 * trial / 20)
        if trial % 3 == 0:
            x = torch.relu(x)  # exact zeros, as after a ReLU
        assert threshold_from_tensor(x, TQTThresholdInitMeth._LL_J, bits) == _ll_j_brute_force(x, bits), trial


def test_tqt_needs_power_of_two_scales(digits_model, digits_data) -> None:
    quant = quantize(digits_model, digits_data, W2A4)
    with pytest.raises(QATError, match="power-of-two scales.*conv1 \\(weight\\)"):
        prepare_qat(quant, QATConfig(threshold_init=TQTThresholdInitMeth._3SD), digits_data.calib)


def test_bad_qat_config() -> None:
    with pytest.raises(QATError, match="learn_scales"):
        QATConfig(learn_scales="yes")  # type: ignore[arg-type]
    with pytest.raises(QATError, match="threshold_init"):
        QATConfig(threshold_init="_3SD")  # type: ignore[arg-type]
    with pytest.raises(QATError, match="no quantized layers"):
        prepare_qat(nn.Linear(2, 2))


def test_batch_norm_statistics_frozen_during_qat(digits_model, digits_data) -> None:
    keep_bn = [algos.Preprocess(merge_batch_norm=False)]
    quant = prepare_qat(quantize(digits_model, digits_data, W2A4, pre_quant_opt_config=keep_bn))
    bn = quant.bn1
    running = copy.deepcopy((bn.running_mean, bn.running_var))
    train_steps(quant, digits_data, 3)
    assert torch.equal(running[0], bn.running_mean) and torch.equal(running[1], bn.running_var)
    assert quant.training and not bn.training


@pytest.mark.slow
def test_qat_example_meets_the_target(tmp_path) -> None:
    """Done-when: PTQ loses more than 5 points at W2A4, QAT recovers to within 1.5 of float."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "qat_digits.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    acc = {k: float(v) for k, v in re.findall(r"^(float|PTQ|QAT) accuracy.*?([\d.]+) %", result.stdout, re.M)}
    assert acc["PTQ"] < acc["float"] - 5.0, acc
    assert acc["QAT"] >= acc["float"] - 1.5, acc
    assert "onnxruntime vs PyTorch" in result.stdout
