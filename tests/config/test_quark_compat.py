"""Code written for quark.torch.extensions.brevitas runs after changing only its imports.

The body below is written the way Quark's Brevitas extension documents its API (module aliases,
positional arguments in Quark's field order, ``args=`` for the exporter); only the imports differ.
"""

from __future__ import annotations

import pytest
import torch

import quark_brevitas.algos as brevitas_algos  # was: quark.torch.extensions.brevitas.algos
import quark_brevitas.api as brevitas_api  # was: quark.torch.extensions.brevitas.api
import quark_brevitas.config as brevitas_config  # was: quark.torch.extensions.brevitas.config
import quark_brevitas.types as quark_config_type  # was: quark.torch.quantization.config.type
from quark_brevitas.cli.digits import evaluate


@pytest.mark.slow
def test_quark_style_script(digits_model, digits_data, tmp_path) -> None:
    weight_spec = brevitas_config.QTensorConfig(
        quark_config_type.QSchemeType.per_channel, True, quark_config_type.ScaleType.float,
        brevitas_config.QuantType.int_quant, brevitas_config.ParamType.stats, 8,
    )
    act_spec = brevitas_config.QuantizationSpec()
    bias_spec = brevitas_config.QuantizationSpec(bit_width=32)
    global_config = brevitas_config.QuantizationConfig(input_tensors=act_spec, weight=weight_spec, bias=bias_spec)
    config = brevitas_config.Config(
        global_quant_config=global_config,
        pre_quant_opt_config=[brevitas_algos.Preprocess(True, 20, True, True, 0.0, False),
                              brevitas_algos.ActivationEqualization(is_layerwise=True, alpha=0.5)],
        algo_config=[brevitas_algos.GPTQ(act_order=True), brevitas_algos.BiasCorrection()],
        backend=brevitas_config.Backend.layerwise,
    )
    quantizer = brevitas_api.ModelQuantizer(config)
    quant_model = quantizer.quantize_model(digits_model, digits_data.calib)

    exporter = brevitas_api.ModelExporter(str(tmp_path / "model.onnx"))
    exporter.export_onnx_model(quant_model, args=torch.ones(1, 1, 8, 8))

    assert (tmp_path / "model.onnx").stat().st_size > 0
    assert evaluate(quant_model, digits_data.test) > evaluate(digits_model, digits_data.test) - 1.0


def test_quark_positional_orders() -> None:
    spec = brevitas_config.QuantizationSpec(quark_config_type.QSchemeType.per_tensor, False,
                                            quark_config_type.ScaleType.pof2, brevitas_config.QuantType.int_quant,
                                            brevitas_config.ParamType.mse, 6)
    assert (spec.symmetric, spec.scale_type, spec.param_type, spec.bit_width) == (
        False, quark_config_type.ScaleType.pof2, brevitas_config.ParamType.mse, 6)
    a2q = brevitas_algos.GPFA2Q(True, 1.0, 20)
    assert (a2q.act_order, a2q.percentage_of_processed_inputs, a2q.accumulator_bit_width) == (True, 1.0, 20)
    assert brevitas_algos.Preprocess().channel_splitting_split_input is False
    assert brevitas_algos.ActivationEqualization().alpha == 0.5
    assert brevitas_algos.GPTQ().act_order is False
    assert issubclass(brevitas_algos.GPFA2Q, brevitas_algos.AlgoConfig)
    assert issubclass(brevitas_algos.Preprocess, brevitas_algos.PreQuantOptConfig)
