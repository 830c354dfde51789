"""RotationConfig (Quark 0.13's Hadamard rotations): folded rotations leave the float model's function unchanged,
the online R4 Hadamard is a real module that the quantizer sees and ONNX exports, a rotated and quantized model
runs, saves, loads and exports, the order rules with the other algorithms, and the config errors.

References are independent of the code under test: the float model's own output, and orthogonality checked with
plain matrix products.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.llm_models import VOCAB, logits, relative_error, tiny_bert, tiny_llama, token_batches, with_outliers  # noqa: E402

from quark_brevitas import load_quantized, save_quantized  # noqa: E402
from quark_brevitas.algorithms import apply_algorithm, describe_algorithms  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import OnlineHadamard, RotatedInput, rotation_matrix  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationSpec,
    RotationConfig,
    SmoothQuantConfig,
)
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.pipeline import Pipeline  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

W4_CHANNEL = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
A8_TOKEN = QuantizationSpec(is_dynamic=True, qscheme=QSchemeType.per_channel)
ALL = {"r1": True, "r2": True, "r4": True}


def _tiny(kind: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
          tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    config = cls[0](vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                    tie_word_embeddings=tied)
    return with_outliers(cls[1](config).eval())


def _max_relative_change(model: torch.nn.Module, reference: torch.nn.Module, tokens: torch.Tensor) -> float:
    ref = logits(reference, tokens)
    return float((logits(model, tokens) - ref).abs().max() / ref.abs().max())


def _config(algos: list, act: QuantizationSpec | None = A8_TOKEN) -> Config:
    return Config(QuantizationConfig(weight=W4_CHANNEL, input_tensors=act), pre_quant_opt_config=[],
                  algo_config=algos, exclude=["lm_head"])


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return token_batches(count=2)


# ===================================================================== the float model is unchanged
@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True), ("mistral", False)])
@pytest.mark.parametrize("random", [False, True], ids=["hadamard", "random"])
def test_folded_rotations_leave_the_float_model_unchanged(kind: str, tied: bool, random: bool, batches) -> None:
    model = _tiny(kind, tied=tied)
    rotated = apply_algorithm(RotationConfig(**ALL, random_r1=random, random_r2=random), copy.deepcopy(model))
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4
    # the weights did change: the rotation is folded, not skipped
    layer = rotated.model.layers[0]
    assert not torch.allclose(layer.self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))
    assert isinstance(layer.mlp.down_proj, RotatedInput)
    assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight  # untied when it was tied


def test_hadamard_matrices_are_orthonormal_and_the_online_module_computes_them() -> None:
    for n, block in [(64, None), (96, None), (128, 16), (512, None)]:
        q = rotation_matrix(n, block)
        assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(q.abs(), torch.full_like(q, q.abs().max().item())) or block is not None
        x = torch.randn(3, 5, n)
        assert torch.allclose(OnlineHadamard(n, block)(x), (x.double() @ q).float(), atol=1e-5)


def test_a_non_power_of_two_width_uses_brevitas_blocks_or_rotation_size(batches) -> None:
    # 96 = 12 * 8: Brevitas's 12-block (heads of 24 = 12 * 2, intermediate 192 = 12 * 16)
    model = _tiny("llama", hidden=96, heads=4, kv_heads=4, intermediate=192)
    rotated = apply_algorithm(RotationConfig(**ALL), copy.deepcopy(model))
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4
    # 88 = 11 * 8 has no Hadamard matrix: a clear error, and rotation_size=8 rotates blocks of 8
    model = _tiny("llama", hidden=88, heads=11, kv_heads=11, intermediate=176)
    with pytest.raises(ConfigError, match="no Hadamard matrix of size 88.*rotation_size"):
        apply_algorithm(RotationConfig(**ALL), copy.deepcopy(model))
    rotated = apply_algorithm(RotationConfig(**ALL, rotation_size=8), copy.deepcopy(model))
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4


def test_bert_gets_only_the_exact_rotations_and_plan_says_why_not_r1(batches) -> None:
    model = tiny_bert()
    config = _config([RotationConfig(**ALL)])
    lines = describe_algorithms(config, model)
    assert any(line.strip().startswith("R1: not applied: post-norm LayerNorm") for line in lines), lines
    assert any("R4: online Hadamard" in line and "output.dense" in line for line in lines), lines
    rotated = apply_algorithm(RotationConfig(**ALL), copy.deepcopy(model))
    assert isinstance(rotated.encoder.layer[0].output.dense, RotatedInput)
    assert not isinstance(rotated.encoder.layer[0].attention.self.query, RotatedInput)  # no R1
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama])
def test_online_r1_puts_hadamards_before_the_layers_reading_each_norm(build, batches) -> None:
    model = build()
    algo = RotationConfig(**ALL, online_r1_rotation=True, rotation_size=32)
    rotated = apply_algorithm(algo, copy.deepcopy(model))
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4
    block = rotated.get_submodule("encoder.layer.0" if build is tiny_bert else "model.layers.0")
    readers = [n for n, m in block.named_modules() if isinstance(m, RotatedInput)]
    expected = (["attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense",
                 "output.dense"] if build is tiny_bert else
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"])
    assert sorted(readers) == sorted(expected)
    assert "R1 (online): Hadamard (blocks of 32)" in "\n".join(describe_algorithms(_config([algo]), model))


def test_plan_says_what_was_applied_where() -> None:
    lines = describe_algorithms(_config([RotationConfig(**ALL, rotation_size=32)]), tiny_llama())
    text = "\n".join(lines)
    assert "R1: residual stream (64 channels, Hadamard, blocks of 32) folded into model.embed_tokens" in text
    assert "input_layernorm (weight merged, set to 1) -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj" in text
    assert "R2: per head (16 channels" in text and "R4: online Hadamard (blocks of 32) on mlp.down_proj" in text


# ===================================================================== rotated and quantized
@pytest.mark.slow
def test_rotated_w4a8_model_runs_saves_loads_and_exports(batches, tmp_path) -> None:
    from quark_brevitas.export.onnx.qcdq import export_onnx_qcdq

    model = tiny_llama()
    quantized = ModelQuantizer(_config([RotationConfig(**ALL)])).quantize_model(model, batches)
    down = quantized.model.layers[0].mlp.down_proj
    assert isinstance(down, RotatedInput) and down.layer.input_quant.is_quant_enabled  # the quantizer sees x @ H
    assert relative_error(quantized, model, batches) < 0.5
    save_quantized(quantized, tmp_path / "ckpt")
    loaded = load_quantized(tiny_llama(), tmp_path / "ckpt")
    assert torch.equal(logits(loaded, batches[0]), logits(quantized, batches[0]))
    inputs = {"input_ids": batches[0], "attention_mask": torch.ones_like(batches[0])}
    report = export_onnx_qcdq(quantized, inputs, tmp_path / "rotated.onnx")
    assert report.max_abs_diff <= report.tolerance
    import onnx

    names = [node.name for node in onnx.load(report.path).graph.node if node.op_type == "MatMul"]
    assert sum("down_proj/rotation" in name for name in names) == 2, names  # the online Hadamards, as MatMul


@pytest.mark.parametrize("rotation", [RotationConfig(), RotationConfig(r2=True, r4=True)], ids=["r1", "r1-r2-r4"])
def test_rotation_runs_first_with_smoothquant_and_gptq(rotation, batches) -> None:
    config = _config([rotation, SmoothQuantConfig(alpha=0.5), GPTQConfig()])
    quantized = ModelQuantizer(config).quantize_model(tiny_llama(), batches[:1])
    # SmoothQuant folded its scales into the norm that the rotation had set to 1: it ran after the rotation
    assert not torch.equal(quantized.model.layers[0].input_layernorm.weight, torch.ones(64))
    assert [type(a).__name__ for _, a in config.run_order()] == ["RotationConfig", "SmoothQuantConfig", "GPTQConfig"]


@pytest.mark.parametrize("algos", [
    [SmoothQuantConfig(), RotationConfig()],
    [GPTQConfig(), RotationConfig()],
], ids=["after-smoothquant", "after-gptq"])
def test_rotation_after_another_weight_algorithm_is_refused(algos) -> None:
    with pytest.raises(ConfigError, match=r"algo_config\[1\].*RotationConfig"):
        Pipeline(_config(algos))


def test_rotation_in_algo_config_after_smoothquant_in_pre_quant_is_refused() -> None:
    config = Config(QuantizationConfig(weight=W4_CHANNEL), pre_quant_opt_config=[SmoothQuantConfig()],
                    algo_config=[RotationConfig()])
    with pytest.raises(ConfigError, match=r"algo_config\[0\].*runs after SmoothQuantConfig"):
        Pipeline(config)


def _quark_sites(online: bool) -> dict:
    """Quark's explicit R1 sites for Llama (its ``scaling_layers`` format, ``layer_id`` for the layer index)."""
    layer, previous = "model.layers.layer_id.", "model.layers.pre_layer_id."
    qkv = [f"{layer}self_attn.{p}_proj" for p in "qkv"]
    mlp = [f"{layer}mlp.up_proj", f"{layer}mlp.gate_proj"]
    if online:
        return {part: [{"target_modules": qkv}, {"target_modules": mlp}] for part in ("first_layer", "middle_layers")}
    attention = {"prev_modules": [f"{layer}self_attn.o_proj"], "norm_module": f"{layer}post_attention_layernorm",
                 "next_modules": mlp}
    return {"first_layer": [{"prev_modules": ["model.embed_tokens"], "norm_module": f"{layer}input_layernorm",
                             "next_modules": qkv}, attention],
            "middle_layers": [{"prev_modules": [f"{previous}mlp.down_proj"], "norm_module": f"{layer}input_layernorm",
                               "next_modules": qkv}, attention],
            "last_layer": [{"prev_modules": [f"{layer}mlp.down_proj"], "norm_module": "model.norm",
                            "next_modules": ["lm_head"]}]}


@pytest.mark.parametrize("online", [False, True], ids=["folded", "online"])
def test_quarks_explicit_scaling_layers_give_the_inferred_rotation(online: bool, batches) -> None:
    model = tiny_llama()
    explicit = RotationConfig(**ALL, online_r1_rotation=online or None, scaling_layers=_quark_sites(online),
                              backbone="model", model_decoder_layers="model.layers", v_proj="self_attn.v_proj",
                              o_proj="self_attn.o_proj", self_attn="self_attn", mlp="mlp")
    inferred = RotationConfig(**ALL, online_r1_rotation=online or None)
    given = apply_algorithm(explicit, copy.deepcopy(model))
    assert torch.equal(logits(given, batches[0]), logits(apply_algorithm(inferred, copy.deepcopy(model)), batches[0]))
    assert _max_relative_change(given, model, batches[0]) < 1e-4
    with pytest.raises(ConfigError, match=r"RotationConfig.backbone: 'transformer' is not a module"):
        apply_algorithm(RotationConfig(backbone="transformer"), copy.deepcopy(model))
    bad = _quark_sites(online)
    bad["middle_layers"][0]["target_modules" if online else "next_modules"][0] = "model.layers.layer_id.self_attn.q"
    with pytest.raises(ConfigError, match=r"scaling_layers.middle_layers\[0\].*'self_attn.q' is not a module"):
        apply_algorithm(RotationConfig(online_r1_rotation=online or None, scaling_layers=bad), copy.deepcopy(model))


# ===================================================================== config
@pytest.mark.parametrize(("fields", "where"), [
    ({"r3": True}, "r3"), ({"trainable": True}, "trainable"), ({"online_config": {"a": 1}}, "online_config"),
    ({"online_r1_rotation": True, "random_r1": True}, "random_r1"),
    ({"r1": False, "online_r1_rotation": False}, "online_r1_rotation"), ({"train_smooth": True}, "train_smooth"),
    ({"rotation_size": 1}, "rotation_size"), ({"rotation_size": 7}, "rotation_size"),
    ({"r1": False}, "algo_config[0]"), ({"name": "spinquant"}, "name"),
    ({"scaling_layers": {"first_layers": []}}, "scaling_layers.first_layers"),
    ({"scaling_layers": {"last_layer": [{"norm": "model.norm"}]}}, "scaling_layers.last_layer[0].norm"),
])
def test_config_errors_name_the_field(fields: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=rf"algo_config\[0\](\.{where})?"):
        Pipeline(_config([RotationConfig(**fields)]))
    with pytest.raises(ConfigError) as info:
        Pipeline(_config([RotationConfig(**fields)]))
    assert where in str(info.value)


def test_config_round_trips_and_a_model_without_weights_is_refused() -> None:
    config = _config([RotationConfig(r2=True, r4=True, rotation_size=32, random_r1=True)])
    data = config.to_dict()
    assert data["algo_config"][0]["name"] == "rotation" and data["algo_config"][0]["rotation_size"] == 32
    assert Config.from_dict(data) == config
    with torch.device("meta"):
        skeleton = tiny_llama()
    with pytest.raises(ConfigError, match="not loaded.*quantize_pretrained, which rotates each block as it loads"):
        apply_algorithm(RotationConfig(), skeleton)


# ===================================================================== other formats
@pytest.mark.slow
def test_folded_rotations_export_to_gguf_and_online_ones_are_refused(tmp_path) -> None:
    import dataclasses

    pytest.importorskip("gguf")
    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.export import ExportError, export_gguf, export_safetensors

    preset = get_preset("gguf_q4_0")
    folded = dataclasses.replace(preset, algo_config=[RotationConfig(r1=True, r2=True)])
    quant = ModelQuantizer(folded).quantize_model(tiny_llama(kv_heads=2), token_batches(1))
    export_gguf(quant, tmp_path / "folded")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    assert torch.allclose(logits(loaded, tokens), logits(quant, tokens), atol=1e-5, rtol=0)
    online = dataclasses.replace(preset, algo_config=[RotationConfig(r4=True)])
    quant = ModelQuantizer(online).quantize_model(tiny_llama(), token_batches(1))
    with pytest.raises(ExportError, match=r"GGUF cannot hold online Hadamard rotations .*model\.layers\.0\.mlp"):
        export_gguf(quant, tmp_path / "online")
    with pytest.raises(ExportError, match="compressed-tensors cannot hold online Hadamard rotations"):
        export_safetensors(quant, tmp_path / "ct")


def test_block_by_block_and_whole_model_paths_give_the_same_rotated_model(batches) -> None:
    config = _config([RotationConfig(**ALL)])
    model = tiny_llama()
    blockwise = ModelQuantizer(config).quantize_model(model, batches, blocks=True)
    whole = ModelQuantizer(config).quantize_model(model, batches, blocks=False)
    assert torch.equal(logits(blockwise, batches[0]), logits(whole, batches[0]))
    assert isinstance(blockwise.model.layers[1].mlp.down_proj, RotatedInput)


# ===================================================================== online R2 (one Hadamard on o_proj's input)
@pytest.mark.parametrize("build", [tiny_bert, tiny_llama])
def test_online_r2_puts_one_hadamard_before_the_attention_output_and_leaves_values_alone(build, batches) -> None:
    """``online_r2_rotation``: o_proj behind an online Hadamard of its whole input (not per head), v_proj untouched,
    the float model unchanged, and plan says so."""
    model = build()
    algo = RotationConfig(r1=False, r2=True, online_r2_rotation=True)
    rotated = apply_algorithm(algo, copy.deepcopy(model))
    assert _max_relative_change(rotated, model, batches[0]) < 1e-4
    prefix, o_proj, v_proj = (("encoder.layer.0", "attention.output.dense", "attention.self.value")
                              if build is tiny_bert else ("model.layers.0", "self_attn.o_proj", "self_attn.v_proj"))
    block, original = rotated.get_submodule(prefix), model.get_submodule(prefix)
    assert [n for n, m in block.named_modules() if isinstance(m, RotatedInput)] == [o_proj]
    assert torch.equal(block.get_submodule(v_proj).weight, original.get_submodule(v_proj).weight)
    wrapped = block.get_submodule(o_proj)
    width = original.get_submodule(o_proj).in_features
    assert torch.allclose(wrapped.rotation.matrix().double(), rotation_matrix(width, None).double(), atol=1e-6)
    lines = "\n".join(describe_algorithms(_config([algo]), model))
    assert f"R2 (online): Hadamard (full width) on the input of {o_proj}" in lines


def test_online_r2_fields_are_checked_and_written_only_when_set() -> None:
    assert "online_r2_rotation" not in _config([RotationConfig()]).to_dict()["algo_config"][0]
    config = _config([RotationConfig(r2=True, online_r2_rotation=True)])
    assert Config.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"online_r2_rotation: True has no effect with r2=False"):
        ModelQuantizer(_config([RotationConfig(online_r2_rotation=True)]))
    with pytest.raises(ConfigError, match=r"random_r2: online R2 rotations are Hadamard matrices"):
        ModelQuantizer(_config([RotationConfig(r2=True, online_r2_rotation=True, random_r2=True)]))


def test_online_r2_model_quantizes_saves_and_loads(batches, tmp_path) -> None:
    """A checkpoint replays the online R2 wrapper: the loaded model computes the saved one's logits exactly."""
    model = tiny_llama()
    quantized = ModelQuantizer(_config([RotationConfig(r1=False, r2=True, online_r2_rotation=True)])).quantize_model(
        model, batches)
    o_proj = quantized.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, RotatedInput) and o_proj.layer.input_quant.is_quant_enabled
    save_quantized(quantized, tmp_path / "ckpt")
    loaded = load_quantized(tiny_llama(), tmp_path / "ckpt")
    assert isinstance(loaded.model.layers[0].self_attn.o_proj, RotatedInput)
    assert torch.equal(logits(loaded, batches[0]), logits(quantized, batches[0]))
