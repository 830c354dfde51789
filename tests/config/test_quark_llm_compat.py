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

from helpers.llm_models import (  # noqa: E402
    LLAMA_SCALING_LAYERS,
    relative_error,
    tiny_gpt2,
    tiny_llama,
    tiny_opt,
    token_batches,
)

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
    scaling_layers=LLAMA_SCALING_LAYERS,  # Quark's Llama scaling layers (its documentation's JSON)
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


@pytest.mark.slow
@pytest.mark.parametrize(("build", "global_config", "algorithms"), [
    (tiny_llama, W_UINT4_PER_GROUP_CONFIG, {"algo_config": LLAMA_AWQ_CONFIG}),
    (tiny_llama, W_UINT4_PER_GROUP_CONFIG, {"algo_config": LLAMA_GPTQ_CONFIG}),
    (tiny_llama, W_INT8_A_INT8_PER_TENSOR_CONFIG, {"pre_quant_opt_config": LLAMA_SMOOTH_CONFIG}),
    (tiny_opt, W_UINT4_PER_GROUP_CONFIG, {"algo_config": [OPT_AWQ_CONFIG]}),
    # nothing given: decoder and scaling layers inferred, GPT-2's Conv1D projections quantized
    (tiny_gpt2, W_UINT4_PER_GROUP_CONFIG, {"pre_quant_opt_config": SmoothQuantConfig(alpha=0.5),
                                           "algo_config": [AWQConfig(group_size=32), GPTQConfig(group_size=32)]}),
], ids=["llama-awq", "llama-gptq", "llama-w8a8-smoothquant", "opt-awq", "gpt2-inferred"])
def test_quark_llm_configs_run_and_beat_plain_rounding(build, global_config, algorithms, calib_dataloader) -> None:
    model = build()
    quant_config = Config(global_quant_config=global_config, exclude=EXCLUDE_LAYERS, **algorithms)
    quantized = quantize(model, quant_config, calib_dataloader)
    plain = quantize(model, Config(global_quant_config=global_config, exclude=EXCLUDE_LAYERS), calib_dataloader)
    assert relative_error(quantized, model, calib_dataloader) < relative_error(plain, model, calib_dataloader)
