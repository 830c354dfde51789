"""Quark's LLM algorithms (SmoothQuantConfig, AWQConfig, GPTQConfig), the structure inference they rely on, and
the sample-count warnings of the data-driven algorithms.

References are independent of the code under test: the float model's output, a textbook GPTQ written here from
the paper on the plain-torch quantizer of ``tests/helpers/reference.py``, hand-computed SmoothQuant scales,
Brevitas's own
quantized weight (``quant_weight()``) for the grid.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from helpers import reference as ref  # noqa: E402
from helpers.llm_models import (  # noqa: E402
    INT4_G32,
    LLAMA_SCALING_LAYERS,
    UINT4_G32,
    relative_error,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_opt,
    token_batches,
)
from helpers.llm_models import llm_config as _config  # noqa: E402

from quark_brevitas import algos  # noqa: E402
from quark_brevitas.algorithms import apply_algorithm, describe_algorithms, handler_for  # noqa: E402
from quark_brevitas.algorithms.gptq import gptq_columns  # noqa: E402
from quark_brevitas.algorithms.structure import model_structure  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.blocks.capture import capture_block_inputs  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer, weight_grid  # noqa: E402
from quark_brevitas.calibration.data import (
    BlockInputs,  # noqa: E402
    CalibrationData,  # noqa: E402
)
from quark_brevitas.config import (  # noqa: E402
    AWQConfig,
    Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationSpec,
    SmoothQuantConfig,
)
from quark_brevitas.config.specs import narrow_range_of  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

INT8_CHANNEL = QuantizationSpec(qscheme=QSchemeType.per_channel)
INT8_TENSOR = QuantizationSpec()


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return token_batches()


# ===================================================================== structure inference
@pytest.mark.parametrize(("build", "decoder", "groups", "skipped"), [
    (tiny_llama, "model.layers", ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                                  "self_attn.v_proj -> self_attn.o_proj",
                                  "post_attention_layernorm -> mlp.gate_proj, mlp.up_proj",
                                  "mlp.up_proj -> mlp.down_proj"], 0),
    (tiny_opt, "model.decoder.layers", ["self_attn_layer_norm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
                                        "self_attn.v_proj -> self_attn.out_proj", "final_layer_norm -> fc1",
                                        "fc1 -> fc2"], 0),
    (tiny_gpt2, "transformer.h", ["ln_1 -> attn.c_attn", "ln_2 -> mlp.c_fc"], 1),
    (tiny_bert, "encoder.layer", ["attention.self.value -> attention.output.dense"], 2),
])
def test_structure_is_inferred_for_the_families(build, decoder, groups, skipped) -> None:
    structure = model_structure(build())
    assert structure.decoder_layers == decoder
    assert [str(g) for g in structure.scaling_layers] == groups
    assert len(structure.skipped) == skipped
    assert structure.inferred == {"model_decoder_layers", "scaling_layers", "embedding_layers"}
    assert structure.embedding_layers and all("emb" in name or name.endswith(("wte", "wpe"))
                                              for name in structure.embedding_layers)


def test_structure_skips_inexact_groups_with_the_reason() -> None:
    bert = model_structure(tiny_bert())
    reasons = {s.group: s.reason for s in bert.skipped}
    assert "residual" in reasons["attention.output.LayerNorm -> intermediate.dense"]
    gqa = model_structure(tiny_llama(kv_heads=2))
    assert "self_attn.v_proj -> self_attn.o_proj" not in [str(g) for g in gqa.scaling_layers]
    assert "grouped-query" in gqa.skipped[0].reason


def test_explicit_fields_override_inference_and_are_checked() -> None:
    model = tiny_llama()
    given = model_structure(model, decoder_layers="model.layers", scaling_layers=LLAMA_SCALING_LAYERS[:1],
                            embedding_layers=["model.embed_tokens"])
    assert given.inferred == frozenset()
    assert [str(g) for g in given.scaling_layers] == ["input_layernorm -> self_attn.q_proj, self_attn.k_proj, "
                                                      "self_attn.v_proj"]
    with pytest.raises(ConfigError, match=r"model_decoder_layers.*'model.layers'"):
        model_structure(model, decoder_layers="model.blocks", path="AWQConfig")
    with pytest.raises(ConfigError, match=r"AWQConfig.scaling_layers\[0\].*'self_attn.q'"):
        model_structure(model, scaling_layers=[{"prev_op": "input_layernorm", "layers": ["self_attn.q"]}],
                        path="AWQConfig")
    with pytest.raises(ConfigError, match=r"scaling_layers\[0\].*64 output channels but mlp.down_proj has 128"):
        model_structure(model, scaling_layers=[{"prev_op": "input_layernorm", "layers": ["mlp.down_proj"]}])
    with pytest.raises(ConfigError, match=r"embedding_layers\[0\]"):
        model_structure(model, embedding_layers=["model.embed"])


def test_awq_needs_scaling_layers_it_can_infer_or_is_given(batches) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    config = Config(QuantizationConfig(weight=QuantizationSpec(dtype=Dtype.uint4, symmetric=False,
                                                                qscheme=QSchemeType.per_group, group_size=32)),
                    pre_quant_opt_config=[], algo_config=AWQConfig(group_size=32))
    with pytest.raises(ConfigError, match=r"AWQConfig.scaling_layers.*none could be inferred"):
        describe_algorithms(config, model)
    with pytest.raises(ConfigError, match=r"AWQConfig.scaling_layers"):
        ModelQuantizer(config).quantize_model(model, [torch.randn(4, 64)])
    given = AWQConfig(group_size=32, scaling_layers=[{"prev_op": "0", "layers": ["2"]}])
    described = describe_algorithms(_config(UINT4_G32, given), model)
    assert "  decoder layers: none: the model is one block" in described
    assert "    0 -> 2" in described


def test_plan_lines_show_what_was_inferred() -> None:
    config = _config(UINT4_G32, [AWQConfig(group_size=32), GPTQConfig(group_size=32)], pre=[SmoothQuantConfig()])
    lines = describe_algorithms(config, tiny_llama())
    assert lines[0] == "pre_quant_opt_config[0] SmoothQuantConfig:"
    assert "  decoder layers: model.layers (2 blocks, inferred)" in lines
    assert "algo_config[1] GPTQConfig:" in lines
    assert any("self_attn.q_proj, self_attn.k_proj" in line and "inferred" in line for line in lines)


# ===================================================================== config checks
@pytest.mark.parametrize(("algo", "weight", "field"), [
    (GPTQConfig(bit=4), INT8_CHANNEL, r"bit: 4, but global_quant_config.weight has bit_width 8"),
    (GPTQConfig(bit=8, sym=True, group_size=128), INT8_CHANNEL,
     r"group_size: 128, but global_quant_config.weight is per_channel"),
    (GPTQConfig(group_size=64), UINT4_G32, r"group_size: 64, but .* group_size 32"),
    (AWQConfig(sym=False, group_size=32), INT4_G32, r"sym: False, but .* symmetric=True"),
    (AWQConfig(bit=8, sym=True, group_size=-1), QuantizationSpec(dtype=Dtype.fp8_e4m3), r"integers"),
    (GPTQConfig(bit=8, sym=True, group_size=32),
     QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.int8), r"MX"),
    (GPTQConfig(name="GPTQ", group_size=32), UINT4_G32, r"name: must be 'gptq'"),
    (GPTQConfig(group_size=32, damp_percent=0.0), UINT4_G32, r"damp_percent"),
])
def test_config_errors_name_the_field(algo, weight, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelQuantizer(_config(weight, algo))


def test_bad_scaling_layers_entries_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"scaling_layers\[0\].layers"):
        ModelQuantizer(_config(INT8_TENSOR, pre=[SmoothQuantConfig(scaling_layers=[{"prev_op": "ln", "layers": []}])]))
    with pytest.raises(ConfigError, match=r"scaling_layers\[0\].inp"):
        ModelQuantizer(_config(INT8_TENSOR, pre=[SmoothQuantConfig(
            scaling_layers=[{"prev_op": "ln", "layers": ["fc"], "inp": "other"}])]))
    with pytest.raises(ConfigError, match=r"scaling_layers\[0\].prev_opp: unknown key"):
        ModelQuantizer(_config(INT8_TENSOR, pre=[SmoothQuantConfig(scaling_layers=[{"prev_opp": "ln"}])]))


def test_a_layer_level_weight_spec_contradicting_the_algorithm_fails_naming_the_layer(batches) -> None:
    config = _config(UINT4_G32, GPTQConfig(bit=4, group_size=32),
                     layer_quant_config={"model.layers.1.mlp.down_proj": QuantizationConfig(weight=INT8_CHANNEL)})
    with pytest.raises(ConfigError, match=r"GPTQConfig.bit: 4, but in decoder layer 'model.layers.1' mlp.down_proj "
                                          r"quantizes its weight to 8 bits"):
        ModelQuantizer(config).quantize_model(tiny_llama(), batches)


def test_configs_round_trip_in_quarks_file_format() -> None:
    config = _config(UINT4_G32, [AWQConfig(group_size=32, scaling_layers=LLAMA_SCALING_LAYERS,
                                           model_decoder_layers="model.layers"), GPTQConfig(group_size=32)],
                     pre=[SmoothQuantConfig(alpha=0.5)])
    data = config.to_dict()
    assert [a["name"] for a in data["algo_config"]] == ["awq", "gptq"]
    assert data["pre_quant_opt_config"][0] == {"name": "smoothquant", "alpha": 0.5, "scale_clamp_min": 0.001,
                                               "scaling_layers": None, "embedding_layers": None,
                                               "model_decoder_layers": None}
    assert Config.from_dict(data) == config
    assert Config.from_yaml(config.to_yaml()) == config
    data["algo_config"][1]["name"] = "GPTQConfig"  # the class name is read too
    assert Config.from_dict(data) == config


# ===================================================================== SmoothQuant
@pytest.mark.parametrize("build", [tiny_llama, tiny_opt, tiny_gpt2, tiny_bert])
def test_smoothquant_folds_without_changing_the_float_model(build, batches) -> None:
    model = build()
    smoothed = apply_algorithm(SmoothQuantConfig(alpha=0.5), copy.deepcopy(model), batches)
    assert relative_error(smoothed, model, batches[:1]) < 1e-5
    changed = [n for (n, a), b in zip(model.named_parameters(), smoothed.parameters()) if not torch.equal(a, b)]
    assert changed, "SmoothQuant changed no weight"
    assert [type(m) for m in smoothed.modules()] == [type(m) for m in model.modules()], "no module may be added"


def test_smoothquant_scales_follow_quarks_formula() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    inputs = [torch.randn(6, 8) * torch.linspace(0.5, 4, 8) for _ in range(3)]
    with torch.no_grad():
        act_max = torch.stack([model[0](x).abs().amax(0) for x in inputs]).amax(0)
    weight_max = model[1].weight.detach().abs().amax(0)
    alpha, clamp = 0.7, 0.05
    scales = (act_max.pow(alpha) / weight_max.pow(1 - alpha)).clamp(min=clamp)
    expected_norm = model[0].weight.detach() / scales
    expected_linear = model[1].weight.detach() * scales
    algo = SmoothQuantConfig(alpha=alpha, scale_clamp_min=clamp, scaling_layers=[{"prev_op": "0", "layers": ["1"]}])
    smoothed = apply_algorithm(algo, copy.deepcopy(model), inputs)
    torch.testing.assert_close(smoothed[0].weight.detach(), expected_norm)
    torch.testing.assert_close(smoothed[1].weight.detach(), expected_linear)


def test_smoothquant_rejects_an_explicit_group_that_changes_the_model(batches) -> None:
    entry = {"prev_op": "attention.output.LayerNorm", "layers": ["intermediate.dense"]}
    algo = SmoothQuantConfig(alpha=0.5, scaling_layers=[entry])
    with pytest.raises(ConfigError, match=r"SmoothQuantConfig.scaling_layers\[0\].*changes the model's output"):
        apply_algorithm(algo, tiny_bert(), batches)


def test_smoothquant_lowers_the_w8a8_error_on_activation_outliers(batches) -> None:
    model = tiny_llama()
    plain = ModelQuantizer(_config(INT8_CHANNEL, act=INT8_TENSOR)).quantize_model(model, batches)
    smooth = ModelQuantizer(_config(INT8_CHANNEL, act=INT8_TENSOR, pre=[SmoothQuantConfig(alpha=0.5)]))
    smoothed = smooth.quantize_model(model, batches)
    assert relative_error(smoothed, model, batches) < 0.8 * relative_error(plain, model, batches)


# ===================================================================== GPTQ
def _textbook_scale(work: torch.Tensor, group_size: int) -> torch.Tensor:
    """INT4_G32's min-max scale per element: ``max|group| / 7`` on the narrow grid, Quark's ``/ 7.5`` on the full
    one (the default for 4-bit weights), so the textbook follows whichever grid the spec has."""
    return ref.group_absmax(work, group_size, 1) / (7.0 if narrow_range_of(INT4_G32) else 7.5)


def _textbook_gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, static: bool) -> torch.Tensor:
    """GPTQ column by column (Frantar et al., Algorithm 1 without lazy batches), symmetric int4 per group on
    INT4_G32's grid (:func:`_textbook_scale`): scales from the weight before GPTQ (static), or from the updated
    weight when a group's first column is reached."""
    narrow = narrow_range_of(INT4_G32)
    work = weight.clone()
    h = hessian + 0.01 * torch.diag(hessian).mean() * torch.eye(hessian.shape[0])
    factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scale = _textbook_scale(work, group_size)
    quantized = torch.zeros_like(work)
    for j in range(work.shape[1]):
        if not static and j % group_size == 0:
            scale[:, j:j + group_size] = _textbook_scale(work, group_size)[:, j:j + group_size]
        quantized[:, j] = ref.int_qdq(work[:, j], scale[:, j], 0.0, 4, True, narrow)
        error = (work[:, j] - quantized[:, j]) / factor[j, j]
        work[:, j:] -= error[:, None] * factor[j, j:][None, :]
    return quantized


def _correlated_inputs(tokens: int = 1024, features: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    basis = torch.randn(12, features, generator=generator)
    return torch.randn(tokens, 12, generator=generator) @ basis + 0.05 * torch.randn(tokens, features,
                                                                                     generator=generator)


@pytest.mark.parametrize("static", [True, False])
def test_gptq_matches_the_textbook_algorithm_and_beats_rounding(static: bool) -> None:
    inputs = _correlated_inputs()
    model = nn.Sequential(nn.Linear(96, 48, bias=False))
    config = _config(INT4_G32, GPTQConfig(bit=4, sym=True, group_size=32, desc_act=False, static_groups=static))
    config.exclude = []
    rounded = ModelQuantizer(Config(QuantizationConfig(weight=INT4_G32), pre_quant_opt_config=[])).quantize_model(
        model, [inputs])
    result = ModelQuantizer(config).quantize_model(model, inputs.split(256))
    weight = model[0].weight.detach()
    expected = _textbook_gptq(weight, inputs.t() @ inputs / len(inputs), 32, static)
    ours = result[0].quant_weight().value.detach()
    # The blocked update sums in another order: scales may differ in the last bit, and a rare value close to a
    # rounding boundary may round the other way.
    same = (ours - expected).abs() <= 1e-5 * weight.abs().max()
    assert same.float().mean() > 0.99

    def output_error(q: torch.Tensor) -> float:
        return float((inputs @ (q - weight).t()).norm() / (inputs @ weight.t()).norm())

    assert abs(output_error(ours) - output_error(expected)) < 0.01 * output_error(expected)
    assert output_error(ours) < 0.5 * output_error(rounded[0].quant_weight().value.detach())


def test_gptq_lazy_block_updates_do_not_change_the_result() -> None:
    """Static grid: the blocked update gives the textbook result exactly, whatever the block size."""
    import brevitas.nn as qnn

    from quark_brevitas.quantizers import build_quantizer

    inputs = _correlated_inputs()
    torch.manual_seed(0)
    layer = qnn.QuantLinear(96, 48, bias=False, weight_quant=build_quantizer(INT4_G32, "weight"))
    weight, hessian = layer.weight.detach().clone(), inputs.t() @ inputs / len(inputs)
    expected = _textbook_gptq(weight, hessian, 32, static=True)
    for block_size in (7, 32, 128):
        result = gptq_columns(weight, hessian, lambda tensor: weight_grid(layer, tensor), damp_percent=0.01,
                              act_order=False, group_size=32, static_groups=True, block_size=block_size)
        assert torch.equal(result.quantized, expected)


@pytest.mark.parametrize(("weight", "algo"), [
    (UINT4_G32, GPTQConfig(group_size=32)),
    (UINT4_G32, GPTQConfig(group_size=32, static_groups=True)),
    (INT4_G32, GPTQConfig(bit=4, sym=True, group_size=32, desc_act=False)),
    (QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel), GPTQConfig(sym=True, group_size=-1)),
], ids=["uint4-g32-dynamic-act-order", "uint4-g32-static", "int4-g32-dynamic", "int4-per-channel"])
def test_gptq_weights_sit_on_brevitas_grid_bit_for_bit(weight, algo, batches) -> None:
    model = tiny_llama()
    quantized = ModelQuantizer(_config(weight, algo)).quantize_model(model, batches)
    layers = [m for name, m in quantized.named_modules() if isinstance(m, QuantLayer) and name != "lm_head"]
    assert len(layers) == 14
    for layer in layers:
        assert torch.equal(layer.quant_weight().value, layer.weight)
    rounded = ModelQuantizer(_config(weight)).quantize_model(model, batches)
    assert relative_error(quantized, model, batches) < relative_error(rounded, model, batches)


class _CountingData(BlockInputs):
    """Block inputs that count the passes and the reductions, and reduce as if a second process held the same
    data (sums doubled, maxima unchanged): results must not change."""

    def __init__(self, inputs: BlockInputs) -> None:
        calls = list(inputs.loader)
        super().__init__(calls.__getitem__, len(calls), inputs.parent, inputs.label)
        self.passes = 0
        self.reductions = 0

    def forward(self, model, desc, *, on_output=None):
        self.passes += 1
        return super().forward(model, desc, on_output=on_output)

    def all_reduce(self, tensor, op="sum"):
        self.reductions += 1
        return tensor.mul_(2) if op == "sum" else tensor


# Sequential: the q/k/v and o groups' passes over the block's inputs, then one that captures the MLP's inputs, on
# which the gate/up and down groups' passes run (quark_brevitas.algorithms.narrowing).
@pytest.mark.parametrize(("sequential", "passes"), [(True, 3), (False, 1)])
def test_gptq_block_contract_groups_layers_by_shared_input(sequential: bool, passes: int, batches) -> None:
    config = _config(UINT4_G32, GPTQConfig(group_size=32, true_sequential=sequential))
    model = ModelQuantizer(Config(config.global_quant_config, pre_quant_opt_config=[], exclude=["lm_head"])
                           ).quantize_model(tiny_llama(), batches)
    plain = copy.deepcopy(model)
    algo = config.algo_config[0]
    handler = handler_for(algo)
    assert handler.blocks(algo, model) == ["model.layers.0", "model.layers.1"]
    block = model.get_submodule("model.layers.0")
    with handler.inputs_context(model):
        inputs = capture_block_inputs(model, block, CalibrationData(batches), "inputs")
    counting = _CountingData(inputs)
    handler.apply_block(algo, block, counting, "model.layers.0")
    assert counting.passes == passes
    assert counting.reductions > 0
    handler.apply_block(algo, plain.get_submodule("model.layers.0"), inputs, "model.layers.0")
    for a, b in zip(block.modules(), plain.get_submodule("model.layers.0").modules()):
        if isinstance(a, QuantLayer):
            assert torch.equal(a.weight, b.weight), "reducing over (simulated) processes changed the result"


def test_gptq_on_gpt2_conv1d_layers(batches) -> None:
    model = tiny_gpt2()
    quantized = ModelQuantizer(_config(UINT4_G32, GPTQConfig(group_size=32))).quantize_model(model, batches)
    attention = quantized.transformer.h[0].attn.c_attn
    assert type(attention).__name__ == "QuantConv1D"
    assert torch.equal(attention.quant_weight().value, attention.weight)
    rounded = ModelQuantizer(_config(UINT4_G32)).quantize_model(model, batches)
    assert relative_error(quantized, model, batches) < relative_error(rounded, model, batches)


# ===================================================================== sample-count warnings
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize("algo", [algos.GPTQ(), algos.GPFQ(), GPTQConfig(bit=4, sym=True, group_size=-1)],
                         ids=["GPTQ", "GPFQ", "GPTQConfig"])
def test_too_few_samples_are_warned_about_with_the_number_needed(algo, caplog) -> None:
    spec = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
    act = QuantizationSpec() if isinstance(algo, algos.GPFQ) else None
    config = Config(QuantizationConfig(weight=spec, input_tensors=act), pre_quant_opt_config=[], algo_config=[algo])
    with caplog.at_level(logging.WARNING, logger="quark_brevitas"):
        ModelQuantizer(config).quantize_model(_mlp(), [torch.randn(4, 64) for _ in range(4)])
    warnings = [r.getMessage() for r in caplog.records if "fewer calibration samples" in r.getMessage()]
    assert len(warnings) == 1
    assert "(16 < 64)" in warnings[0] and "at least 64 samples" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quark_brevitas"):
        ModelQuantizer(config).quantize_model(_mlp(), [torch.randn(32, 64) for _ in range(4)])
    assert not [r for r in caplog.records if "fewer calibration samples" in r.getMessage()]


# ===================================================================== AWQ
def test_awq_lowers_the_w4_error_and_keeps_brevitas_grid(batches) -> None:
    model = tiny_llama()
    rounded = ModelQuantizer(_config(UINT4_G32)).quantize_model(model, batches)
    awq = ModelQuantizer(_config(UINT4_G32, AWQConfig(group_size=32))).quantize_model(model, batches)
    assert relative_error(awq, model, batches) < 0.85 * relative_error(rounded, model, batches)
    for name, layer in awq.named_modules():
        if isinstance(layer, QuantLayer) and name != "lm_head":
            before = layer.quant_weight().value.clone()
            weight_grid(layer)  # a grid computed afresh from the final weight is the one the layer has
            assert torch.equal(layer.quant_weight().value, before)


def test_awq_recalibrates_activation_quantizers_it_changed(batches) -> None:
    model = tiny_llama()
    config = _config(UINT4_G32, AWQConfig(group_size=32), act=INT8_TENSOR)
    # The whole-model path, so that a whole-model calibration is the reference (block by block, a block is
    # calibrated on the quantized outputs of the blocks before it).
    awq = ModelQuantizer(config).quantize_model(model, batches, blocks=False)
    plain = ModelQuantizer(_config(UINT4_G32, act=INT8_TENSOR)).quantize_model(model, batches, blocks=False)
    assert relative_error(awq, model, batches) < relative_error(plain, model, batches)
    # the scales AWQ left are those a fresh calibration of the final model gives
    fresh = copy.deepcopy(awq)
    from quark_brevitas.brevitas_adapter import restart_activation_statistics
    from quark_brevitas.calibration import calibrate

    restart_activation_statistics(fresh)
    calibrate(fresh, CalibrationData(batches))
    q_proj = "model.layers.1.self_attn.q_proj"
    torch.testing.assert_close(awq.get_submodule(q_proj).input_quant.scale(),
                               fresh.get_submodule(q_proj).input_quant.scale())


def test_awq_with_quarks_explicit_scaling_layers_on_opt(batches) -> None:
    model = tiny_opt()
    layers = [{"prev_op": "self_attn_layer_norm", "layers": ["self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj"], "inp": "self_attn.q_proj"},
              {"prev_op": "final_layer_norm", "layers": ["fc1"], "inp": "fc1"}]
    awq = AWQConfig(group_size=32, scaling_layers=layers, model_decoder_layers="model.decoder.layers")
    rounded = ModelQuantizer(_config(UINT4_G32)).quantize_model(model, batches)
    quantized = ModelQuantizer(_config(UINT4_G32, awq)).quantize_model(model, batches)
    assert relative_error(quantized, model, batches) < relative_error(rounded, model, batches)


def test_llm_algorithms_survive_a_checkpoint(batches, tmp_path) -> None:
    from quark_brevitas import load_quantized, save_quantized

    config = _config(UINT4_G32, [AWQConfig(group_size=32), GPTQConfig(group_size=32)], act=INT8_TENSOR,
                     pre=[SmoothQuantConfig(alpha=0.5)])
    quantized = ModelQuantizer(config).quantize_model(tiny_llama(), batches)
    save_quantized(quantized, tmp_path / "ckpt")
    loaded = load_quantized(tiny_llama(), tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(batches[0]).logits, quantized(batches[0]).logits)


def test_gptq_config_excludes_the_other_weight_rounding_algorithms() -> None:
    with pytest.raises(ConfigError, match=r"algo_config: use at most one of .*GPTQConfig"):
        ModelQuantizer(_config(UINT4_G32, [algos.GPTQ(), GPTQConfig(group_size=32)]))


@pytest.mark.parametrize("build", [tiny_llama, tiny_opt, tiny_gpt2, tiny_bert])
def test_hugging_face_decoder_stacks_are_chained(build, batches) -> None:
    from quark_brevitas.algorithms.blocks import blocks_are_chained

    model = build()
    structure = model_structure(model, want_scaling=False)
    blocks = [model.get_submodule(name) for name in structure.blocks]
    assert blocks_are_chained(model, blocks, CalibrationData(batches), "check")


def test_a_stack_that_is_not_chained_is_recognised(batches) -> None:
    from quark_brevitas.algorithms.blocks import blocks_are_chained

    class Scaled(nn.Module):  # does something between its blocks
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](2 * self.layers[0](x))

    model = Scaled()
    assert not blocks_are_chained(model, list(model.layers), CalibrationData([torch.randn(2, 8)]), "check")


def test_chained_blocks_give_the_result_of_capturing_each_block(batches, monkeypatch) -> None:
    from quark_brevitas.algorithms import blocks

    config = _config(UINT4_G32, GPTQConfig(group_size=32))
    chained = ModelQuantizer(config).quantize_model(tiny_llama(layers=3), batches, blocks=False)
    monkeypatch.setattr(blocks, "blocks_are_chained", lambda *args: False)
    captured = ModelQuantizer(config).quantize_model(tiny_llama(layers=3), batches, blocks=False)
    for a, b in zip(chained.parameters(), captured.parameters()):
        assert torch.equal(a, b)


def test_cli_plan_prints_what_the_algorithms_work_on(tmp_path, capsys) -> None:
    from quark_brevitas.cli import main

    config = Config(QuantizationConfig(weight=QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)),
                    pre_quant_opt_config=[], algo_config=GPTQConfig(sym=True, group_size=-1))
    path = tmp_path / "gptq.json"
    path.write_text(config.to_json())
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "algo_config[0] GPTQConfig:" in out
    assert "decoder layers: none: the model is one block" in out and "fc1, fc2" in out


def test_gptq_passes_stop_after_their_group_without_changing_the_result(batches, monkeypatch) -> None:
    """From the second batch on, a true-sequential pass stops once its group's layers have had their calls:
    the MLP's last layer runs in every batch of its own pass only, and the weights equal full passes'."""
    from quark_brevitas.algorithms import gptq as gptq_module

    config = _config(UINT4_G32, GPTQConfig(group_size=32))

    def run() -> tuple[nn.Module, int]:
        calls = []
        add = gptq_module.HessianPass.add

        def counting_add(self, name, rows, raw):  # every hooked layer call of every pass
            calls.append(name)
            return add(self, name, rows, raw)

        with monkeypatch.context() as patch:
            patch.setattr(gptq_module.HessianPass, "add", counting_add)
            quantized = ModelQuantizer(config).quantize_model(tiny_llama(), batches)
        return quantized, len(calls)

    stopping, stopped_calls = run()
    original = gptq_module.HessianPass.batch_done

    def never_stop(self, index, output):
        original(self, index, output)
        self.calls_per_batch = {name: 10**9 for name in self.calls_per_batch}
        self.one_input = False  # nor at the group's first call (one product credited to the whole group)

    monkeypatch.setattr(gptq_module.HessianPass, "batch_done", never_stop)
    full, full_calls = run()
    layers = [(n, m) for n, m in stopping.named_modules() if isinstance(m, QuantLayer)]
    assert layers
    for name, layer in layers:
        assert torch.equal(layer.weight, full.get_submodule(name).weight), name
    assert 0 < stopped_calls < full_calls, (stopped_calls, full_calls)


def test_whole_model_path_walks_blocks_with_the_block_engine(batches, monkeypatch) -> None:
    """One walker over blocks: apply_algorithm (and blocks=False) run the algorithm through BlockwiseEngine, with
    the handler's inputs_context, and give what the pipeline's whole-model path gives."""
    from quark_brevitas.blocks import engine

    runs: list[tuple[str, bool]] = []
    original = engine.BlockwiseEngine.run

    def spy(self, **kwargs):
        runs.append((self.stack_name, self.chained))
        return original(self, **kwargs)

    monkeypatch.setattr(engine.BlockwiseEngine, "run", spy)
    config = _config(UINT4_G32, GPTQConfig(group_size=32))
    whole = ModelQuantizer(config).quantize_model(tiny_llama(layers=3), batches, blocks=False)
    assert runs == [("model.layers", True)]
    rtn = ModelQuantizer(_config(UINT4_G32)).quantize_model(tiny_llama(layers=3), batches, blocks=False)
    applied = apply_algorithm(GPTQConfig(group_size=32), rtn, batches)
    assert runs == [("model.layers", True)] * 2
    for a, b in zip(whole.parameters(), applied.parameters()):
        assert torch.equal(a, b)
