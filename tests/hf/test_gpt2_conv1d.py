"""Hugging Face GPT-2's Conv1D layers (a Linear with its weight stored transposed) are quantized, not skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from helpers import reference as ref  # noqa: E402
from helpers.llm_models import relative_error, tiny_gpt2, token_batches  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from quark_brevitas import load_quantized, save_quantized  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.backend.layers import QuantConv1D  # noqa: E402
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

W8_CHANNEL = QuantizationSpec(qscheme=QSchemeType.per_channel)


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return token_batches(count=2)


def _w8a8() -> Config:
    return Config(QuantizationConfig(weight=W8_CHANNEL, input_tensors=QuantizationSpec()), pre_quant_opt_config=[])


def test_every_conv1d_is_quantized_and_the_model_stays_close(batches) -> None:
    model = tiny_gpt2()
    quantizer = ModelQuantizer(_w8a8())
    rows = {row.name: row for row in quantizer.plan(model)}
    assert rows["transformer.h.0.attn.c_attn"].quantized and rows["transformer.h.1.mlp.c_proj"].quantized
    quantized = quantizer.quantize_model(model, batches)
    assert not any(isinstance(m, Conv1D) for m in quantized.modules())
    assert sum(isinstance(m, QuantConv1D) for m in quantized.modules()) == 8
    assert relative_error(quantized, model, batches) < 0.05


@pytest.mark.parametrize("nf", [12, 8], ids=["rectangular", "square"])  # a square weight fits either layout
def test_quant_conv1d_computes_the_reference_quantized_linear(nf: int) -> None:
    torch.manual_seed(0)
    float_layer = Conv1D(nf, 8)
    nn.init.normal_(float_layer.weight)
    nn.init.normal_(float_layer.bias)
    container = nn.Sequential(float_layer)
    quantized = ModelQuantizer(Config(QuantizationConfig(weight=W8_CHANNEL), pre_quant_opt_config=[])
                               ).quantize_model(container)[0]
    weight = float_layer.weight.detach().t()  # [out, in]
    scale = ref.symmetric_scale(weight, 8, per_channel=True)
    expected_weight = ref.int_qdq(weight, scale, 0.0, 8, True, True)
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), x @ expected_weight.t() + float_layer.bias)
    # the state dict keeps Conv1D's layout, key for key and shape for shape
    assert {k: v.shape for k, v in float_layer.state_dict().items()} == {
        k: v.shape for k, v in quantized.state_dict().items() if k in ("weight", "bias")}


def test_layer_type_config_and_checkpoint_round_trip(batches, tmp_path) -> None:
    model = tiny_gpt2()
    int4 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
    config = Config(QuantizationConfig(weight=W8_CHANNEL), pre_quant_opt_config=[],
                    layer_type_quant_config={"Conv1D": QuantizationConfig(weight=int4)})
    quantized = ModelQuantizer(config).quantize_model(model)
    assert int(quantized.transformer.h[0].attn.c_attn.quant_weight().bit_width) == 4
    assert int(quantized.lm_head.quant_weight().bit_width) == 8
    save_quantized(quantized, tmp_path / "ckpt")
    loaded = load_quantized(tiny_gpt2(), tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]).logits, quantized(batches[0]).logits)


@pytest.mark.slow
def test_importing_the_package_does_not_import_transformers() -> None:
    code = ("import sys, quark_brevitas; assert 'transformers' not in sys.modules; "
            "from quark_brevitas import DEFAULT_LAYER_MAP; names = [c.__name__ for c in DEFAULT_LAYER_MAP]; "
            "assert 'Conv1D' in names, names")
    subprocess.run([sys.executable, "-c", code], check=True)
