"""Quark's LLM code (reference 002: SmoothQuantConfig, AWQConfig, GPTQConfig) runs after changing only its imports.

The body is written the way Quark's LLM examples write it: module-level specs, algorithm configs with Quark's
field names and its per-family scaling layers, one algorithm passed without a list, ``exclude=["lm_head"]``,
a calibration loader of token-id tensors. Two deviations: Quark's ``observer_cls`` spec field is not part of
quark_brevitas's ``QuantizationSpec`` (calibration is chosen by ``param_type``), and the models are tiny (64 wide),
so group sizes are 32 rather than Quark's 128.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from llm_models import relative_error, tiny_gpt2, tiny_llama, tiny_opt, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402  # was: from quark.torch import ModelQuantizer
from quark_brevitas.config import (  # noqa: E402  # was: quark.torch.quantization.config.config
    AWQConfig,
    Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationSpec,
    SmoothQuantConfig,
)
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ScaleType  # noqa: E402  # was: ...config.type

# ---------------------------------------------------------------- Quark-style code from here on
UINT4_PER_GROUP_ASYM_SPEC = QuantizationSpec(dtype=Dtype.uint4, symmetric=False, scale_type=ScaleType.float,
                                             round_method=RoundType.half_even, qscheme=QSchemeType.per_group,
                                             ch_axis=1, is_dynamic=False, group_size=32)
INT8_PER_TENSOR_SPEC = QuantizationSpec(dtype=Dtype.int8, qscheme=QSchemeType.per_tensor, symmetric=True,
                                        scale_type=ScaleType.float, round_method=RoundType.half_even, is_dynamic=False)
INT8_PER_CHANNEL_SPEC = QuantizationSpec(dtype=Dtype.int8, qscheme=QSchemeType.per_channel, symmetric=True,
                                         scale_type=ScaleType.float, round_method=RoundType.half_even, ch_axis=0,
                                         is_dynamic=False)
W_UINT4_PER_GROUP_CONFIG = QuantizationConfig(weight=UINT4_PER_GROUP_ASYM_SPEC)
W_INT8_A_INT8_PER_TENSOR_CONFIG = QuantizationConfig(input_tensors=INT8_PER_TENSOR_SPEC, weight=INT8_PER_CHANNEL_SPEC)
EXCLUDE_LAYERS = ["lm_head"]

LLAMA_AWQ_CONFIG = AWQConfig(
    group_size=32,
    scaling_layers=[
        {"prev_op": "input_layernorm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
        {"prev_op": "self_attn.v_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
        {"prev_op": "post_attention_layernorm", "layers": ["mlp.gate_proj", "mlp.up_proj"], "inp": "mlp.gate_proj",
         "module2inspect": "mlp"},
        {"prev_op": "mlp.up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
    ],
    model_decoder_layers="model.layers",
)
LLAMA_GPTQ_CONFIG = GPTQConfig(
    group_size=32,
    damp_percent=0.01,
    desc_act=True,
    static_groups=False,
    true_sequential=True,
    inside_layer_modules=["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.o_proj",
                          "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj"],
    model_decoder_layers="model.layers",
)
LLAMA_SMOOTH_CONFIG = SmoothQuantConfig(
    alpha=0.5,
    scale_clamp_min=1e-3,
    scaling_layers=[
        {"prev_op": "input_layernorm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
        {"prev_op": "post_attention_layernorm", "layers": ["mlp.gate_proj", "mlp.up_proj"], "inp": "mlp.gate_proj",
         "module2inspect": "mlp"},
    ],
    model_decoder_layers="model.layers",
)
OPT_AWQ_CONFIG = AWQConfig(
    group_size=32,
    scaling_layers=[
        {"prev_op": "self_attn_layer_norm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
        {"prev_op": "self_attn.v_proj", "layers": ["self_attn.out_proj"], "inp": "self_attn.out_proj"},
        {"prev_op": "final_layer_norm", "layers": ["fc1"], "inp": "fc1"},
        {"prev_op": "fc1", "layers": ["fc2"], "inp": "fc2"},
    ],
    model_decoder_layers="model.decoder.layers",
)


def quantize(model, quant_config, calib_dataloader):
    quantizer = ModelQuantizer(quant_config)
    return quantizer.quantize_model(model, calib_dataloader)
# ---------------------------------------------------------------- end of Quark-style code


@pytest.fixture(scope="module")
def calib_dataloader() -> list[torch.Tensor]:
    return token_batches()


def _plain_error(model, global_config, data) -> float:
    plain = quantize(model, Config(global_quant_config=global_config, exclude=EXCLUDE_LAYERS), data)
    return relative_error(plain, model, data)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [LLAMA_AWQ_CONFIG, LLAMA_GPTQ_CONFIG], ids=["awq", "gptq"])
def test_llama_w4_with_quark_algorithm_configs(algo, calib_dataloader) -> None:
    model = tiny_llama()
    quant_config = Config(global_quant_config=W_UINT4_PER_GROUP_CONFIG, algo_config=algo, exclude=EXCLUDE_LAYERS)
    quantized = quantize(model, quant_config, calib_dataloader)
    assert relative_error(quantized, model, calib_dataloader) < _plain_error(model, W_UINT4_PER_GROUP_CONFIG,
                                                                             calib_dataloader)


@pytest.mark.slow
def test_llama_w8a8_with_quark_smoothquant(calib_dataloader) -> None:
    model = tiny_llama()
    quant_config = Config(global_quant_config=W_INT8_A_INT8_PER_TENSOR_CONFIG, pre_quant_opt_config=LLAMA_SMOOTH_CONFIG,
                          exclude=EXCLUDE_LAYERS)
    quantized = quantize(model, quant_config, calib_dataloader)
    assert relative_error(quantized, model, calib_dataloader) < _plain_error(model, W_INT8_A_INT8_PER_TENSOR_CONFIG,
                                                                             calib_dataloader)


@pytest.mark.slow
def test_opt_w4_with_quarks_opt_awq_config(calib_dataloader) -> None:
    model = tiny_opt()
    quant_config = Config(global_quant_config=W_UINT4_PER_GROUP_CONFIG, algo_config=[OPT_AWQ_CONFIG],
                          exclude=EXCLUDE_LAYERS)
    quantized = quantize(model, quant_config, calib_dataloader)
    assert relative_error(quantized, model, calib_dataloader) < _plain_error(model, W_UINT4_PER_GROUP_CONFIG,
                                                                             calib_dataloader)


@pytest.mark.slow
def test_gpt2_with_inferred_structure(calib_dataloader) -> None:
    """No scaling layers or decoder layers given: inferred (GPT-2's Conv1D projections quantized)."""
    model = tiny_gpt2()
    quant_config = Config(global_quant_config=W_UINT4_PER_GROUP_CONFIG,
                          pre_quant_opt_config=SmoothQuantConfig(alpha=0.5),
                          algo_config=[AWQConfig(group_size=32), GPTQConfig(group_size=32)], exclude=EXCLUDE_LAYERS)
    quantized = quantize(model, quant_config, calib_dataloader)
    assert relative_error(quantized, model, calib_dataloader) < _plain_error(model, W_UINT4_PER_GROUP_CONFIG,
                                                                             calib_dataloader)
