"""Quark 0.13's LLMTemplate: schemes map to Quark's specs, unknown names are refused with the supported ones,
registration, serialisation, and Quark 0.13's documented LLM flow (template -> quantize -> evaluate -> export)
on tiny Llama, Qwen2 and OPT models with only the imports changed.

The expected specs below are written by hand from Quark 0.13's scheme definitions
(``quark/torch/quantization/config/template.py`` and the ``*Spec`` classes it uses): per-group and MX weights
keep Quark's ``ch_axis=-1`` (the same axis of a Linear weight as ``1``), its min-max observer of static
activations ``percentile=100``, its OCP MX specs ``dtype=mx`` with the element format.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quark_brevitas.config import AWQConfig, Config, GPTQConfig, QLayerConfig, QTensorConfig, SmoothQuantConfig
from quark_brevitas.config.enums import Dtype, QSchemeType, QuantType, ScaleType
from quark_brevitas.config.families import BLOCK_STACK_PATHS, FAMILIES
from quark_brevitas.config.template import UNSUPPORTED_SCHEMES, LLMTemplate
from quark_brevitas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

INT, FLOAT = QuantType.int_quant, QuantType.float_quant
PG, PC, PT = QSchemeType.per_group, QSchemeType.per_channel, QSchemeType.per_tensor


def _int(bits: int, qscheme: QSchemeType, *, sym: bool = True, group: int | None = None, axis: int | None = None,
         dynamic: bool = False, percentile: float | None = None) -> dict:
    return {"quant_type": INT, "bit_width": bits, "qscheme": qscheme, "symmetric": sym, "group_size": group,
            "ch_axis": axis, "is_dynamic": dynamic, "scale_type": ScaleType.float, "percentile": percentile}


def _fp(e: int, m: int, qscheme: QSchemeType, *, axis: int | None = None, dynamic: bool = False,
        percentile: float | None = None) -> dict:
    return {"quant_type": FLOAT, "bit_width": 1 + e + m, "exponent_bit_width": e, "mantissa_bit_width": m,
            "qscheme": qscheme, "symmetric": True, "ch_axis": axis, "is_dynamic": dynamic,
            "scale_type": ScaleType.float, "percentile": percentile}


def _mx(e: int, m: int, *, dynamic: bool) -> dict:
    return {"dtype": Dtype.mx, "quant_type": FLOAT, "bit_width": 1 + e + m, "exponent_bit_width": e,
            "mantissa_bit_width": m, "qscheme": PG, "group_size": 32, "scale_type": ScaleType.pof2,
            "symmetric": True, "ch_axis": None if dynamic else -1, "is_dynamic": dynamic}


MIN_MAX = 100.0
#: scheme -> (weight, input_tensors), by hand from Quark 0.13's definitions.
EXPECTED: dict[str, tuple[dict, dict | None]] = {
    "int4_wo_32": (_int(4, PG, group=32, axis=-1), None),
    "int4_wo_64": (_int(4, PG, group=64, axis=-1), None),
    "int4_wo_128": (_int(4, PG, group=128, axis=-1), None),
    "int4_wo_per_channel": (_int(4, PC, axis=0), None),
    "int4_wa_64": (_int(4, PG, group=64, axis=-1), _int(4, PG, group=64, dynamic=True)),
    "uint4_wo_32": (_int(4, PG, sym=False, group=32, axis=-1), None),
    "uint4_wo_64": (_int(4, PG, sym=False, group=64, axis=-1), None),
    "uint4_wo_128": (_int(4, PG, sym=False, group=128, axis=-1), None),
    "uint4_wo_per_channel": (_int(4, PC, sym=False, axis=0), None),
    "int8": (_int(8, PT), _int(8, PT, percentile=MIN_MAX)),
    "fp8": (_fp(4, 3, PT), _fp(4, 3, PT, percentile=MIN_MAX)),
    "ptpc_fp8": (_fp(4, 3, PC, axis=0), _fp(4, 3, PC, dynamic=True)),
    "mxfp4": (_mx(2, 1, dynamic=False), _mx(2, 1, dynamic=True)),
    "mxfp4_weight_only": (_mx(2, 1, dynamic=False), None),
    "mxfp6_e3m2": (_mx(3, 2, dynamic=False), _mx(3, 2, dynamic=True)),
    "mxfp6_e2m3": (_mx(2, 3, dynamic=False), _mx(2, 3, dynamic=True)),
    "mxfp4_mxfp6_e2m3": (_mx(2, 1, dynamic=False), _mx(2, 3, dynamic=True)),
    "mxfp4_fp8": (_mx(2, 1, dynamic=False), _fp(4, 3, PT, percentile=MIN_MAX)),
}


def _fields(spec: QTensorConfig | None, expected: dict | None) -> dict | None:
    if spec is None:
        return None
    resolved = spec.resolved()
    return {name: getattr(resolved, name) for name in (expected or {})}


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_each_scheme_has_quarks_specs(scheme: str) -> None:
    config = LLMTemplate.get("llama").get_config(scheme=scheme)
    weight, inputs = EXPECTED[scheme]
    layer = config.global_quant_config
    assert _fields(layer.weight, weight) == weight
    assert _fields(layer.input_tensors, inputs) == inputs
    assert layer.output_tensors is None and layer.bias is None
    assert config.exclude == ["lm_head"] and config.pre_quant_opt_config == [] and config.algo_config == []


def test_the_supported_schemes_are_exactly_those_specified() -> None:
    assert LLMTemplate.get_supported_schemes() == list(EXPECTED)
    assert not set(UNSUPPORTED_SCHEMES) & set(EXPECTED)


@pytest.mark.parametrize("scheme", ["nvfp4", "mx6", "int4_fp8", "int3_wo_128"])
def test_a_scheme_that_cannot_run_is_refused_listing_the_supported_ones(scheme: str) -> None:
    with pytest.raises(ConfigError, match=r"^scheme: .*supported: int4_wo_32, int4_wo_64, .*mxfp4_fp8$") as info:
        LLMTemplate.get("llama").get_config(scheme=scheme)
    if scheme in UNSUPPORTED_SCHEMES:
        assert "cannot be executed here" in str(info.value) and UNSUPPORTED_SCHEMES[scheme] in str(info.value)
    else:
        assert "unknown scheme 'int3_wo_128'" in str(info.value)


def test_unknown_algorithms_and_templates_name_what_exists() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\[1\]: .*'gptaq' .*Quark's.*supported: awq, gptq, smoothquant, "
                                          r"qronos, autoround"):
        LLMTemplate.get("llama").get_config(scheme="int4_wo_128", algorithm=["awq", "gptaq"])
    with pytest.raises(ConfigError, match=r"no LLMTemplate for 'falcon'; available: llama, mistral, qwen2, qwen3, "
                                          r"gemma2, gemma3_text, phi3, mixtral, qwen2_moe, qwen3_moe, opt, gpt2, bert"):
        LLMTemplate.get("falcon")
    with pytest.raises(ConfigError, match="kv_cache_scheme: 'fp16'; allowed: fp8, int8 or None"):
        LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp16")


def test_templates_read_the_family_table() -> None:
    assert LLMTemplate.list_available() == ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                                            "mixtral", "qwen2_moe", "qwen3_moe", "opt", "gpt2", "bert"]
    opt = LLMTemplate.get("opt")
    assert opt.family is FAMILIES["opt"] and opt.family.decoder_layers == "model.decoder.layers"
    assert opt.exclude_layers_name == ["lm_head"] and opt.kv_layers_name == ["*k_proj", "*v_proj"]
    assert LLMTemplate.get("bert").exclude_layers_name == []
    assert BLOCK_STACK_PATHS[:4] == ("model.layers", "model.decoder.layers", "transformer.h", "encoder.layer")
    assert "  scaling groups of the family (those exact in the model are used):" in opt.describe()
    assert "    fc1 -> fc2" in opt.describe()


def test_algorithms_in_order_with_quarks_defaults_and_overrides() -> None:
    template = LLMTemplate.get("qwen2")
    config = template.get_config(scheme="uint4_wo_64", algorithm=["smoothquant", "gptq"])
    # As Quark 0.13's template writes them: every algorithm in algo_config, in the order given, the restated
    # bit/sym/group_size left None (the weight spec says them), GPTQ with Quark's block_size.
    assert config.pre_quant_opt_config == []
    assert config.algo_config == [SmoothQuantConfig(alpha=1.0),
                                  GPTQConfig(damp_percent=0.01, desc_act=True, static_groups=True, block_size=128)]
    assert [(algo.bit, algo.sym, algo.group_size) for algo in config.algo_config[1:]] == [(None, None, None)]
    assert [where for where, _ in config.run_order()] == ["algo_config[0]", "algo_config[1]"]
    assert config.pre_quant_algorithms() == [SmoothQuantConfig(alpha=1.0)]  # still on the float model
    per_channel = template.get_config(scheme="int4_wo_per_channel", algorithm="AWQ")
    assert per_channel.algo_config == [AWQConfig()]
    mine = AWQConfig(bit=4, sym=True, group_size=32, model_decoder_layers="model.layers")
    assert template.get_config(scheme="int4_wo_32", algorithm="awq", algo_configs={"awq": mine}).algo_config == [mine]
    with pytest.raises(ConfigError, match=r"algo_config\[0\]: AWQConfig quantizes weights to integers"):
        template.get_config(scheme="fp8", algorithm="awq")


def test_layer_and_type_schemes_and_exclusions() -> None:
    config = LLMTemplate.get("llama").get_config(scheme="int4_wo_128", layer_config={"*down_proj": "int8"},
                                                 layer_type_config={"Linear": "uint4_wo_32"},
                                                 exclude_layers=["lm_head", "*.0.mlp.*"])
    assert config.layer_quant_config["*down_proj"] == LLMTemplate.get_scheme("int8").config
    assert config.layer_type_quant_config["Linear"].weight.group_size == 32
    assert config.exclude == ["lm_head", "*.0.mlp.*"]
    with pytest.raises(ConfigError, match=r"layer_config\['\*o_proj'\]: unknown scheme 'w3'"):
        LLMTemplate.get("llama").get_config(scheme="int8", layer_config={"*o_proj": "w3"})


def test_register_scheme_and_template() -> None:
    int8_weights = QLayerConfig(weight=QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_channel, ch_axis=0))
    LLMTemplate.register_scheme("int8_wo", int8_weights)
    try:
        assert LLMTemplate.get_supported_schemes()[-1] == "int8_wo"
        assert LLMTemplate.get("opt").get_config(scheme="int8_wo").global_quant_config == int8_weights
        with pytest.raises(ConfigError, match="'int8_wo' is already registered"):
            LLMTemplate.register_scheme("int8_wo", int8_weights)
        with pytest.raises(ConfigError, match="'int8' is built in"):
            LLMTemplate.unregister_scheme("int8")
    finally:
        LLMTemplate.unregister_scheme("int8_wo")
    assert "int8_wo" not in LLMTemplate.get_supported_schemes()
    with pytest.raises(ConfigError, match=r"weight.bit_width: 1 is out of range"):
        LLMTemplate.register_scheme("w1", QLayerConfig(weight=QTensorConfig(bit_width=1)))
    assert "w1" not in LLMTemplate.get_supported_schemes()

    custom = LLMTemplate(model_type="my_llama", kv_layers_name=["*k_proj", "*v_proj"], q_layer_name="*q_proj",
                         exclude_layers_name=["lm_head", "*gate"], algorithm_configs={"AWQ": AWQConfig(group_size=32)})
    LLMTemplate.register_template(custom)
    try:
        assert LLMTemplate.get("my_llama") is custom and "my_llama" in LLMTemplate.list_available()
        config = custom.get_config(scheme="uint4_wo_32", algorithm="awq")
        assert config.exclude == ["lm_head", "*gate"] and config.algo_config == [AWQConfig(group_size=32)]
    finally:
        del LLMTemplate._templates["my_llama"]
    with pytest.raises(ConfigError, match="f2f_weight_converters"):
        LLMTemplate(model_type="x", f2f_weight_converters=[object()])


@pytest.mark.parametrize(("scheme", "algorithm"), [("int4_wo_128", "awq"), ("uint4_wo_32", ["smoothquant", "gptq"]),
                                                   ("mxfp4", None), ("ptpc_fp8", "smoothquant"), ("int4_wa_64", None)])
def test_the_config_round_trips_through_files(scheme: str, algorithm: str | list[str] | None) -> None:
    config = LLMTemplate.get("llama").get_config(scheme=scheme, algorithm=algorithm,
                                                 layer_config={"*down_proj": "int8"})
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert Config.from_yaml(config.to_yaml()) == config


def test_templates_import_neither_torch_nor_brevitas() -> None:
    code = """
import json, sys
from quark_brevitas.config import LLMTemplate
config = LLMTemplate.get("llama").get_config(scheme="int4_wo_128", algorithm=["smoothquant", "gptq"])
print(json.dumps({"torch": "torch" in sys.modules, "brevitas": "brevitas" in sys.modules,
                  "algos": [type(a).__name__ for a in config.pre_quant_opt_config + config.algo_config]}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"torch": False, "brevitas": False, "algos": ["SmoothQuantConfig", "GPTQConfig"]}


# ===================================================================== quark-brevitas plan --template
def test_plan_shows_what_the_template_chose(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.cli import main

    assert main(["plan", "--template", "opt", "--scheme", "uint4_wo_64", "--algorithm", "smoothquant",
                 "--algorithm", "gptq"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "template opt, scheme uint4_wo_64 (uint4 weights, asymmetric, groups of 64), exclude lm_head"
    assert lines[1] == "  weight: int4 per_group g64 asym stats" and lines[2] == "  input_tensors: float"
    assert lines[3] == "algorithms, in the order they run:"
    assert lines[4] == "  1. algo_config[0] SmoothQuantConfig (before quantization, on the float model)"
    assert lines[5] == "  2. algo_config[1] GPTQConfig (after quantization and calibration)"
    from quark_brevitas.config import LLMTemplate

    gptq = LLMTemplate.get("opt").get_config(scheme="uint4_wo_64", algorithm=["smoothquant", "gptq"]).algo_config[1]
    assert gptq.group_size is None and gptq.static_groups is True and gptq.block_size == 128
    assert "    final_layer_norm -> fc1" in lines


def test_plan_of_a_model_folder_with_a_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from quark_brevitas.cli import main

    transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--template", "llama", "--scheme", "int4_wo_32",
                 "--algorithm", "awq"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"LlamaForCausalLM plan ({tmp_path}; template llama, scheme int4_wo_32 (int4 "
                                   "weights, symmetric, groups of 32), exclude lm_head; pre-quant: -; algorithms: "
                                   "AWQConfig)")
    assert "  decoder layers: model.layers (2 blocks, inferred)" in out
    assert "not used: self_attn.v_proj -> self_attn.o_proj (grouped-query attention" in out


def test_plan_template_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.cli import main

    assert main(["plan", "--template", "llama", "--scheme", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --template llama: scheme: 'nvfp4' is Quark's but cannot be executed here")
    assert main(["plan", "--template", "llama"]) == 2
    assert "--template needs --scheme; supported: int4_wo_32" in capsys.readouterr().err
    assert main(["plan", "--scheme", "int8"]) == 2
    assert "give --template too" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["int4_wo_32", "uint4_wo_32", "int4_wa_64", "mxfp4_weight_only", "mxfp6_e2m3"])
def test_quarks_ch_axis_minus_one_quantizes_as_axis_one(scheme: str) -> None:
    """The template writes per-group and MX weights with Quark's ch_axis=-1; the model quantized with it equals the
    one quantized with ch_axis=1 (the same axis of a Linear weight), weight codes and scales alike."""
    import dataclasses

    import torch

    from quark_brevitas import ModelQuantizer

    from_template = LLMTemplate.get("llama").get_config(scheme=scheme, exclude_layers=[])
    assert from_template.global_quant_config.weight.ch_axis == -1
    axis_one = dataclasses.replace(from_template, global_quant_config=dataclasses.replace(
        from_template.global_quant_config,
        weight=dataclasses.replace(from_template.global_quant_config.weight, ch_axis=1)))
    models = []
    for config in (from_template, axis_one):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        models.append(ModelQuantizer(config).quantize_model(model, [torch.randn(4, 64)]))
    with torch.no_grad():
        for index in (0, 2):
            one, two = models[0][index].quant_weight(), models[1][index].quant_weight()
            assert torch.equal(one.value, two.value) and torch.equal(one.scale, two.scale)
            assert not torch.equal(one.value, models[0][index].weight)  # quantized
        sample = torch.randn(2, 64)
        assert torch.equal(models[0](sample), models[1](sample))
