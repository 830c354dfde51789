"""The rest of the library on graph-quantized models (issue 29, item 4): MSE calibration of the graph points, TQT
threshold initialisation of the points, bias correction, GPTQ/GPFQ, graph equalization, analysis and mixed
precision. Each result is checked against an independent reference (the float model, the quantization error of the
point's own input, a hand-computed threshold), and the model still exports to a QONNX file FINN can take."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised
from torch import nn

from quark_brevitas.algos import GPFQ, GPTQ, BiasCorrection, Preprocess
from quark_brevitas.analysis import auto_mixed_precision, compare_layers, sensitivity
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.brevitas_adapter import quantization_disabled
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.enums import ParamType, QSchemeType, ScaleType, TQTThresholdInitMeth
from quark_brevitas.config.presets import get_preset
from quark_brevitas.export import export_qonnx, finn_readiness
from quark_brevitas.qat import QATConfig, prepare_qat

X = input_batch(32)
CALIB = [X[:16], X[16:]]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return randomised(GRAPH_ZOO["residual_cnn"]())


def _finn_w4a4(**fields) -> Config:
    """finn_w4a4 with ``fields`` set on both the weight and the point specs (e.g. ``param_type``)."""
    config = get_preset("finn_w4a4")
    layer = config.global_quant_config
    layer = dataclasses.replace(layer, weight=dataclasses.replace(layer.weight, **fields),
                                input_tensors=dataclasses.replace(layer.input_tensors, **fields))
    return dataclasses.replace(config, global_quant_config=layer)


def _float_inputs(quant: nn.Module, module: str) -> torch.Tensor:
    """What ``module`` of ``quant`` receives on the calibration data with quantization switched off, every call
    (a shared point is called once per input). Not the float model's: the default Preprocess merges BatchNorm and
    equalizes channels, which changes the tensors between layers (not the output)."""
    seen: list[torch.Tensor] = []
    handle = quant.get_submodule(module).register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    was_training = quant.training
    quant.eval()
    with quantization_disabled(quant), torch.no_grad():
        for batch in CALIB:
            quant(batch)
    handle.remove()
    quant.train(was_training)
    return torch.cat([value.flatten() for value in seen])


def _exports_for_finn(quant: nn.Module, tmp_path) -> None:
    report = export_qonnx(quant, X[:1], tmp_path / "m.onnx")
    with torch.no_grad():
        scale = quant(X[:1]).abs().max().item()
    assert report.max_abs_diff <= 1e-5 * max(scale, 1.0)
    assert finn_readiness(tmp_path / "m.onnx") == []


def test_mse_calibration_fits_the_graph_points() -> None:
    model = _model()
    # float scales: the preset's power-of-two scales leave the two searches few values to differ by
    stats = ModelQuantizer(_finn_w4a4(scale_type=ScaleType.float)).quantize_model(model, CALIB)
    mse = ModelQuantizer(_finn_w4a4(param_type=ParamType.mse, scale_type=ScaleType.float)).quantize_model(model, CALIB)
    # relu1's point quantizes ReLU(bn1(...)); its MSE scale must quantize that tensor with a smaller error than
    # the statistics (percentile) scale does
    values = torch.relu(_float_inputs(stats, "relu1"))
    assert torch.equal(values, torch.relu(_float_inputs(mse, "relu1")))  # one tensor, two scales
    with torch.no_grad():
        errors = {name: float((q.relu1(values) - values).square().mean()) for name, q in (("stats", stats),
                                                                                           ("mse", mse))}
        scales = {name: float(q.relu1.act_quant.scale()) for name, q in (("stats", stats), ("mse", mse))}
    assert scales["mse"] != scales["stats"]
    assert errors["mse"] < errors["stats"], errors


def test_tqt_initialises_the_graph_points_thresholds() -> None:
    config = _finn_w4a4(scale_type=ScaleType.pof2)
    model = _model()
    quant = ModelQuantizer(config).quantize_model(model, CALIB)
    prepare_qat(quant, QATConfig(threshold_init=TQTThresholdInitMeth._3SD), CALIB)

    def expected(values: torch.Tensor, signed: bool) -> float:
        # TQT: threshold 3 sd + |mean|, scale 2**ceil(log2 t) over the codes above zero: 2**(b-1) signed, 2**b
        # unsigned (b = 4)
        threshold = 3 * float(values.std()) + float(values.mean().abs())
        return 2.0 ** torch.tensor(threshold).log2().ceil().item() / (8 if signed else 16)

    relu1 = torch.relu(_float_inputs(quant, "relu1"))  # a QuantReLU's point quantizes the ReLU of its input
    both = _float_inputs(quant, "graph_quant_add")  # the shared point: both inputs of the residual add
    assert both.numel() == 2 * relu1.numel()
    with torch.no_grad():
        assert float(quant.relu1.act_quant.scale()) == pytest.approx(expected(relu1, signed=False))
        assert float(quant.graph_quant_add.act_quant.scale()) == pytest.approx(expected(both, signed=True))


def test_bias_correction_reduces_the_mean_output_error() -> None:
    model = _model()
    with torch.no_grad():
        reference = torch.cat([model(batch) for batch in CALIB])
    plain = ModelQuantizer(get_preset("finn_w4a4")).quantize_model(model, CALIB)
    corrected = ModelQuantizer(dataclasses.replace(get_preset("finn_w4a4"), algo_config=[BiasCorrection()])
                               ).quantize_model(model, CALIB)
    with torch.no_grad():
        bias = {name: float((torch.cat([q(batch) for batch in CALIB]) - reference).mean(0).abs().mean())
                for name, q in (("plain", plain), ("corrected", corrected))}
    assert bias["corrected"] < bias["plain"], bias


@pytest.mark.parametrize("algorithm", [GPTQ(), GPFQ()], ids=["gptq", "gpfq"])
def test_gptq_gpfq_round_graph_model_weights(algorithm, tmp_path) -> None:
    model = _model()
    plain = ModelQuantizer(get_preset("finn_w4a4")).quantize_model(model, CALIB)
    rounded = ModelQuantizer(dataclasses.replace(get_preset("finn_w4a4"), algo_config=[algorithm])
                             ).quantize_model(model, CALIB)
    with torch.no_grad():
        changed = [name for name in ("conv0", "conv1", "conv2", "fc")
                   if not torch.equal(plain.get_submodule(name).quant_weight().value,
                                      rounded.get_submodule(name).quant_weight().value)]
    assert changed, "the algorithm left every weight as round-to-nearest"
    _exports_for_finn(rounded, tmp_path)


def test_preprocess_equalization_before_graph_quantization(tmp_path) -> None:
    model = _model()
    config = dataclasses.replace(get_preset("finn_w4a4"), pre_quant_opt_config=[Preprocess()])
    quant = ModelQuantizer(config).quantize_model(model, CALIB)
    with torch.no_grad():
        agree = float((quant(X).argmax(1) == model(X).argmax(1)).float().mean())
    assert agree >= 0.5  # 4-bit everything on a random net: close to the float model, not equal
    _exports_for_finn(quant, tmp_path)


def test_analysis_and_mixed_precision_on_graph_configs(tmp_path) -> None:
    model = _model()
    quant = ModelQuantizer(get_preset("finn_w4a4")).quantize_model(model, CALIB)
    rows = compare_layers(model, quant, CALIB)
    assert {row.name for row in rows} == {"conv0", "conv1", "conv2", "fc"}
    ranking = sensitivity(model, get_preset("finn_w4a4"), CALIB)
    assert {row.name for row in ranking} == {"conv0", "conv1", "conv2", "fc"}
    # candidates differ in weight bits only: every graph point keeps one spec, as a shared point must
    point = QTensorConfig(bit_width=4)
    candidates = [QLayerConfig(weight=QTensorConfig(bit_width=bits, qscheme=QSchemeType.per_channel),
                               input_tensors=point) for bits in (8, 4, 2)]
    config = auto_mixed_precision(model, candidates, CALIB, budget_bits=4.0, base_config=get_preset("finn_w4a4"))
    mixed = ModelQuantizer(config).quantize_model(model, CALIB)
    bits = {name: int(mixed.get_submodule(name).quant_weight().bit_width) for name in ("conv0", "conv1", "conv2",
                                                                                       "fc")}
    assert len(set(bits.values())) > 1, bits  # a real mix within the budget
    _exports_for_finn(mixed, tmp_path)
