"""Every algorithm does something measurable on the digits CNN: error against the float model's
logits with the algorithm is compared with the error without it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos
from quark_brevitas.algorithms import apply_algorithm
from quark_brevitas.types import QSchemeType

W3_PC_A8 = QLayerConfig(weight=QTensorConfig(bit_width=3, qscheme=QSchemeType.per_channel),
                        input_tensors=QTensorConfig())
#: Per-tensor int4 on the narrow grid (-7..7), the grid these tests were written for: on the full default grid the
#: digits CNN's W4A8 logits error is 0.266 without equalization and ActivationEqualization(alpha=0.5) raises it to
#: 0.307 (measured 2026-11-26), so the test would no longer show what equalization does on a grid it helps.
W4_A8 = QLayerConfig(weight=QTensorConfig(bit_width=4, narrow_range=True), input_tensors=QTensorConfig())


@pytest.fixture(scope="module")
def test_inputs(digits_data) -> torch.Tensor:
    return torch.cat([x for x, _ in digits_data.test])


@pytest.fixture(scope="module")
def logits_error(digits_model, digits_data, test_inputs):
    """Mean squared error of a quantized model's logits against the float model's."""
    with torch.no_grad():
        reference = digits_model(test_inputs)

    def error(layer: QLayerConfig, pre: list | None = None, post: list | None = None) -> tuple[float, nn.Module]:
        kwargs = {} if pre is None else {"pre_quant_opt_config": pre}
        config = Config(global_quant_config=layer, algo_config=post or [], **kwargs)
        quant = ModelQuantizer(config).quantize_model(digits_model, digits_data.calib)
        with torch.no_grad():
            return float(((quant(test_inputs) - reference) ** 2).mean()), quant

    return error


def int_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.quant_weight().int() for m in model.modules() if type(m).__name__ in ("QuantConv2d", "QuantLinear")]


@pytest.fixture(scope="module")
def baseline(logits_error):
    return logits_error(W3_PC_A8)


@pytest.mark.slow
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_changes_weights_and_lowers_error(logits_error, baseline, act_order: bool) -> None:
    base_error, base_model = baseline
    error, model = logits_error(W3_PC_A8, post=[algos.GPTQ(act_order=act_order)])
    changed = [not torch.equal(a, b) for a, b in zip(int_weights(base_model), int_weights(model))]
    assert sum(changed) >= 3  # every layer after the first sees GPTQ's update
    assert error < 0.6 * base_error, (error, base_error)


@pytest.fixture(scope="module")
def gpfq_run(logits_error):
    return logits_error(W3_PC_A8, post=[algos.GPFQ()])


@pytest.mark.slow
def test_gpfq_lowers_error(gpfq_run, baseline) -> None:
    assert gpfq_run[0] < 0.6 * baseline[0], (gpfq_run[0], baseline[0])


@pytest.mark.slow
def test_gpfa2q_bounds_the_accumulator(logits_error, gpfq_run) -> None:
    """With a P-bit accumulator and signed 8-bit inputs, sum|q| * 2^7 must fit in 2^(P-1)."""
    accumulator = 16
    bound = 2 ** (accumulator - 1) / 2 ** 7
    plain = gpfq_run[1]
    _, aware = logits_error(W3_PC_A8, post=[algos.GPFA2Q(accumulator_bit_width=accumulator)])
    plain_l1 = [float(w.flatten(1).abs().sum(1).max()) for w in int_weights(plain)]
    aware_l1 = [float(w.flatten(1).abs().sum(1).max()) for w in int_weights(aware)]
    assert max(plain_l1) > bound  # without the constraint the accumulator would overflow
    assert max(aware_l1) <= bound, aware_l1


@pytest.mark.slow
def test_bias_correction_lowers_error(logits_error, baseline) -> None:
    error, _ = logits_error(W3_PC_A8, post=[algos.BiasCorrection()])
    assert error < 0.8 * baseline[0], (error, baseline[0])


@pytest.mark.slow
def test_calibrate_batch_norm_lowers_error(logits_error) -> None:
    keep_bn = [algos.Preprocess(merge_batch_norm=False)]
    without, model = logits_error(W4_A8, pre=keep_bn)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    with_cbn, _ = logits_error(W4_A8, pre=keep_bn, post=[algos.CalibrateBatchNorm()])
    assert with_cbn < 0.95 * without, (with_cbn, without)


@pytest.mark.slow
def test_preprocess_equalization_lowers_error(logits_error) -> None:
    no_eq, _ = logits_error(W4_A8, pre=[algos.Preprocess(equalize_iterations=0)])
    eq, _ = logits_error(W4_A8, pre=[algos.Preprocess(equalize_iterations=20)])
    assert eq < 0.9 * no_eq, (eq, no_eq)


@pytest.mark.slow
def test_activation_equalization_lowers_error(logits_error) -> None:
    without, _ = logits_error(W4_A8, pre=[algos.Preprocess()])
    with_ae, _ = logits_error(W4_A8, pre=[algos.Preprocess(), algos.ActivationEqualization(alpha=0.5)])
    assert with_ae < 0.9 * without, (with_ae, without)


def test_preprocess_merges_batch_norm_and_keeps_the_function(digits_model, test_inputs) -> None:
    import copy

    processed = apply_algorithm(algos.Preprocess(), copy.deepcopy(digits_model))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in processed.modules())
    with torch.no_grad():
        torch.testing.assert_close(processed(test_inputs), digits_model(test_inputs), atol=1e-4, rtol=1e-4)


def test_preprocess_warns_once_for_untraceable_models(caplog) -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    model = DataDependent()
    with caplog.at_level(logging.WARNING, logger="quark_brevitas.algos"):
        out = apply_algorithm(algos.Preprocess(), model)
    assert out is model
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot be FX-traced" in warnings[0].getMessage()
    config = Config(global_quant_config=W4_A8)
    quant = ModelQuantizer(config).quantize_model(model, [torch.randn(3, 4)])
    assert type(quant.fc).__name__ == "QuantLinear"


@pytest.mark.parametrize("algo", [algos.GPTQ(), algos.BiasCorrection(), algos.CalibrateBatchNorm()])
def test_algorithms_need_data(algo) -> None:
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig()), algo_config=[algo])
    with pytest.raises(ValueError, match=type(algo).__name__):
        ModelQuantizer(config).quantize_model(nn.Linear(3, 3))


def test_gptq_accepts_weights_set_only_at_the_layer_type_level() -> None:
    from quark_brevitas.config import verify_config

    config = Config(global_quant_config=QLayerConfig(input_tensors=QTensorConfig()),
                    layer_type_quant_config={"Linear": QLayerConfig(weight=QTensorConfig(bit_width=4))},
                    algo_config=[algos.GPTQ(), algos.BiasCorrection()])
    verify_config(config)
    with pytest.raises(ValueError, match="needs weight quantization"):
        verify_config(Config(global_quant_config=QLayerConfig(input_tensors=QTensorConfig()),
                             algo_config=[algos.GPTQ()]))
