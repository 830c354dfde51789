"""Code written for Quark 0.13 (``QConfig``, ``GPTQConfig(block_size=...)``, every algorithm in ``algo_config``,
``observer_cls``, ``ch_axis=-1``) runs after changing only its imports, and gives what the same recipe written in
the reference's style (reference 002: ``bit``/``sym``/``group_size``, SmoothQuant in ``pre_quant_opt_config``) gives.

The Quark-0.13 bodies below are written the way Quark 0.13's LLM examples write them; the models are tiny (64
wide), so group sizes are 32 rather than Quark's 128.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import LLAMA_SCALING_LAYERS, tiny_llama, tiny_opt, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer, QConfig  # noqa: E402  # was: from quark.torch import ModelQuantizer
from quark_brevitas.config import (  # noqa: E402  # was: quark.torch.quantization.config.config
    AWQConfig,
    GPTQConfig,
    QLayerConfig,
    QTensorConfig,
    SmoothQuantConfig,
)
from quark_brevitas.config.observers import (  # noqa: E402  # was: quark.torch.quantization.observer.observer
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
)
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.types import DeviceType, Dtype, QSchemeType, RoundType, ScaleType  # noqa: E402

LLAMA_LAYERS = ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj",
                "mlp.gate_proj", "mlp.down_proj"]
OPT_SCALING_LAYERS = [
    {"prev_op": "self_attn_layer_norm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
     "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.out_proj"], "inp": "self_attn.out_proj"},
    {"prev_op": "final_layer_norm", "layers": ["fc1"], "inp": "fc1"},
    {"prev_op": "fc1", "layers": ["fc2"], "inp": "fc2"},
]
LLAMA_SMOOTH_LAYERS = LLAMA_SCALING_LAYERS[:1] + [LLAMA_SCALING_LAYERS[2]]


# ---------------------------------------------------------------- Quark 0.13 style
def q013_spec(dtype: Dtype, symmetric: bool) -> QTensorConfig:
    return QTensorConfig(dtype=dtype, observer_cls=PerGroupMinMaxObserver, symmetric=symmetric,
                         scale_type=ScaleType.float, round_method=RoundType.half_even, qscheme=QSchemeType.per_group,
                         ch_axis=-1, is_dynamic=False, group_size=32)


Q013_W8A8 = QLayerConfig(
    weight=QTensorConfig(dtype=Dtype.int8, observer_cls=PerChannelMinMaxObserver, symmetric=True,
                         scale_type=ScaleType.float, round_method=RoundType.half_even, qscheme=QSchemeType.per_channel,
                         ch_axis=0, is_dynamic=False),
    input_tensors=QTensorConfig(dtype=Dtype.int8, observer_cls=PerTensorMinMaxObserver, symmetric=True,
                                scale_type=ScaleType.float, round_method=RoundType.half_even,
                                qscheme=QSchemeType.per_tensor, is_dynamic=False, percentile=99.999),
)


def q013_gptq(decoder_layers: str, inside: list[str] | None = None, block_size: int = 16) -> GPTQConfig:
    return GPTQConfig(block_size=block_size, damp_percent=0.01, desc_act=True, static_groups=True,
                      inside_layer_modules=inside, model_decoder_layers=decoder_layers)


# ---------------------------------------------------------------- the same recipes in the reference's style
def ref_spec(dtype: Dtype, symmetric: bool) -> QTensorConfig:
    return QTensorConfig(dtype=dtype, symmetric=symmetric, scale_type=ScaleType.float,
                         round_method=RoundType.half_even, qscheme=QSchemeType.per_group, ch_axis=1, is_dynamic=False,
                         group_size=32)


REF_W8A8 = QLayerConfig(
    weight=QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_channel, symmetric=True, ch_axis=0,
                         round_method=RoundType.half_even, is_dynamic=False),
    input_tensors=QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_tensor, symmetric=True,
                                round_method=RoundType.half_even, is_dynamic=False, percentile=99.999),
)


def ref_gptq(decoder_layers: str, bit: int, sym: bool, group_size: int, inside: list[str] | None = None) -> GPTQConfig:
    return GPTQConfig(bit=bit, sym=sym, group_size=group_size, damp_percent=0.01, desc_act=True, static_groups=True,
                      inside_layer_modules=inside, model_decoder_layers=decoder_layers)


def _recipes() -> dict[str, tuple]:
    """id -> (model builder, Quark 0.13 config, reference-style config)."""
    return {
        "llama-gptq": (
            tiny_llama,
            QConfig(global_quant_config=QLayerConfig(weight=q013_spec(Dtype.uint4, False)), exclude=["lm_head"],
                    algo_config=[q013_gptq("model.layers", LLAMA_LAYERS)]),
            QConfig(global_quant_config=QLayerConfig(weight=ref_spec(Dtype.uint4, False)), exclude=["lm_head"],
                    algo_config=[ref_gptq("model.layers", 4, False, 32, LLAMA_LAYERS)]),
        ),
        "llama-awq-sym": (
            tiny_llama,
            QConfig(global_quant_config=QLayerConfig(weight=q013_spec(Dtype.int4, True)), exclude=["lm_head"],
                    algo_config=[AWQConfig(scaling_layers=LLAMA_SCALING_LAYERS, model_decoder_layers="model.layers")]),
            QConfig(global_quant_config=QLayerConfig(weight=ref_spec(Dtype.int4, True)), exclude=["lm_head"],
                    algo_config=[AWQConfig(bit=4, sym=True, group_size=32, scaling_layers=LLAMA_SCALING_LAYERS,
                                           model_decoder_layers="model.layers")]),
        ),
        "llama-smoothquant-gptq-w8a8": (
            tiny_llama,
            QConfig(global_quant_config=Q013_W8A8, exclude=["lm_head"], pre_quant_opt_config=[],
                    algo_config=[SmoothQuantConfig(alpha=0.5, scaling_layers=LLAMA_SMOOTH_LAYERS,
                                                   model_decoder_layers="model.layers"),
                                 q013_gptq("model.layers")]),
            QConfig(global_quant_config=REF_W8A8, exclude=["lm_head"],
                    pre_quant_opt_config=[SmoothQuantConfig(alpha=0.5, scaling_layers=LLAMA_SMOOTH_LAYERS,
                                                            model_decoder_layers="model.layers")],
                    algo_config=[ref_gptq("model.layers", 8, True, -1)]),
        ),
        "opt-awq-gptq-sym": (
            tiny_opt,
            QConfig(global_quant_config=QLayerConfig(weight=q013_spec(Dtype.int4, True)), exclude=["lm_head"],
                    algo_config=[AWQConfig(scaling_layers=OPT_SCALING_LAYERS,
                                           model_decoder_layers="model.decoder.layers"),
                                 q013_gptq("model.decoder.layers")]),
            QConfig(global_quant_config=QLayerConfig(weight=ref_spec(Dtype.int4, True)), exclude=["lm_head"],
                    algo_config=[AWQConfig(bit=4, sym=True, group_size=32, scaling_layers=OPT_SCALING_LAYERS,
                                           model_decoder_layers="model.decoder.layers"),
                                 ref_gptq("model.decoder.layers", 4, True, 32)]),
        ),
    }


@pytest.fixture(scope="module")
def calib_dataloader() -> list[torch.Tensor]:
    return token_batches()


def _quantized_weights(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each quantized layer's weight as Brevitas computes it (on the integer grid) and its scales: equal values and
    scales mean equal integer codes (per-group weights included, which ``integer_weights`` does not cover)."""
    with torch.no_grad():
        return {name: (module.quant_weight().value, module.quant_weight().scale)
                for name, module in model.named_modules()
                if hasattr(module, "quant_weight") and module.weight_quant.is_quant_enabled}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(_recipes()))
def test_quark013_code_gives_the_reference_styles_result(recipe: str, calib_dataloader) -> None:
    build, quark013, reference = _recipes()[recipe]
    model = build()
    ours = ModelQuantizer(quark013).quantize_model(model, calib_dataloader)
    theirs = ModelQuantizer(reference).quantize_model(model, calib_dataloader)
    codes, expected = _quantized_weights(ours), _quantized_weights(theirs)
    assert list(codes) == list(expected) and codes
    for name, (value, scale) in codes.items():
        assert torch.equal(value, expected[name][0]), name
        assert torch.equal(scale, expected[name][1]), name
    with torch.no_grad():
        for batch in calib_dataloader[:2]:
            assert torch.equal(ours(batch).logits, theirs(batch).logits)


# ---------------------------------------------------------------- fields of both generations
def test_restated_fields_default_to_the_weight_spec_and_only_contradictions_fail() -> None:
    sym = QLayerConfig(weight=q013_spec(Dtype.int4, True))
    ModelQuantizer(QConfig(global_quant_config=sym, algo_config=[AWQConfig(), GPTQConfig()]))  # nothing restated
    ModelQuantizer(QConfig(global_quant_config=sym, algo_config=GPTQConfig(bit=4, sym=True, group_size=32)))
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(QConfig(global_quant_config=sym, algo_config=AWQConfig(sym=False)))
    assert info.value.path == "algo_config[0].sym"
    assert "global_quant_config.weight has symmetric=True" in str(info.value)


def test_serialisation_writes_what_the_user_wrote_and_round_trips() -> None:
    config = QConfig(global_quant_config=QLayerConfig(weight=q013_spec(Dtype.uint4, False)),
                     algo_config=[SmoothQuantConfig(alpha=0.5), AWQConfig(), q013_gptq("model.layers", block_size=64)])
    data = config.to_dict()
    gptq = data["algo_config"][2]
    assert gptq["block_size"] == 64 and gptq["static_groups"] is True
    restated = {"bit", "sym", "group_size"}
    assert not restated & set(gptq) and not restated & set(data["algo_config"][1])
    assert [a["name"] for a in data["algo_config"]] == ["smoothquant", "awq", "gptq"]
    assert data["global_quant_config"]["weight"]["observer_cls"] == "PerGroupMinMaxObserver"
    assert QConfig.from_dict(data) == config
    assert QConfig.from_yaml(config.to_yaml()) == config
    reference = dataclasses.replace(config, algo_config=[GPTQConfig(bit=4, sym=False, group_size=32)])
    written = reference.to_dict()["algo_config"][0]
    assert (written["bit"], written["sym"], written["group_size"]) == (4, False, 32)
    assert QConfig.from_dict(reference.to_dict()) == reference


def test_quark013s_smooth_name_is_read_and_ours_written() -> None:
    """Quark 0.13 names SmoothQuant ``"smooth"`` (its files, its ``SmoothQuantConfig.name``): read in both lists,
    written back as ``"smoothquant"``, and the same config as the one spelled our way."""
    assert SmoothQuantConfig(name="smooth", alpha=0.5) == SmoothQuantConfig(alpha=0.5)
    data = QConfig(global_quant_config=W4, pre_quant_opt_config=[], algo_config=[AWQConfig()]).to_dict()
    quark_entry = {"name": "smooth", "alpha": 0.5, "scale_clamp_min": 0.001, "model_decoder_layers": "model.layers"}
    for key in ("algo_config", "pre_quant_opt_config"):
        written_by_quark = {**data, key: [dict(quark_entry), *data[key]]}
        config = QConfig.from_dict(written_by_quark)
        smooth = getattr(config, key)[0]
        assert smooth == SmoothQuantConfig(alpha=0.5, model_decoder_layers="model.layers")
        assert config.to_dict()[key][0]["name"] == "smoothquant"
        assert [type(a).__name__ for _, a in config.run_order()] == ["SmoothQuantConfig", "AWQConfig"]
    with pytest.raises(ConfigError, match=r"algo_config\[0\].name: 'smoth' is not a AlgorithmConfig; did you mean "
                                          r"'smooth'"):
        QConfig.from_dict({**data, "algo_config": [{"name": "smoth"}]})


def test_gptq_block_size_is_used_by_the_update(monkeypatch, calib_dataloader) -> None:
    from quark_brevitas.algorithms import gptq

    seen: list[int] = []
    original = gptq.gptq_columns

    def spy(*args, **kwargs):
        seen.append(kwargs["block_size"])
        return original(*args, **kwargs)

    monkeypatch.setattr(gptq, "gptq_columns", spy)
    config = QConfig(global_quant_config=QLayerConfig(weight=q013_spec(Dtype.uint4, False)), exclude=["lm_head"],
                     algo_config=q013_gptq("model.layers", ["mlp.down_proj"], block_size=8))
    ModelQuantizer(config).quantize_model(tiny_llama(), calib_dataloader[:1])
    assert seen == [8, 8]
    with pytest.raises(ConfigError, match=r"algo_config\[0\].block_size: must be >= 1"):
        ModelQuantizer(dataclasses.replace(config, algo_config=[GPTQConfig(block_size=0)]))


# ---------------------------------------------------------------- algo_config: every algorithm, in order
W4 = QLayerConfig(weight=q013_spec(Dtype.uint4, False))


@pytest.mark.parametrize(("algo_config", "path", "fragment"), [
    ([GPTQConfig(), SmoothQuantConfig()], "algo_config[1]",
     "SmoothQuantConfig after GPTQConfig (algo_config[0]) would undo it"),
    ([GPTQConfig(), AWQConfig()], "algo_config[1]", "Put AWQConfig before GPTQConfig"),
    ([AWQConfig(), AWQConfig()], "algo_config[1]", "AWQConfig is listed twice (also at algo_config[0])"),
])
def test_orders_that_undo_a_step_and_duplicates_are_refused(algo_config, path, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(QConfig(global_quant_config=W4, algo_config=algo_config))
    assert info.value.path == path
    assert fragment in str(info.value)
    assert "the order that works" in str(info.value) or "listed twice" in fragment


def test_smoothquant_in_both_lists_is_listed_twice() -> None:
    with pytest.raises(ConfigError, match=r"algo_config\[0\]: SmoothQuantConfig is listed twice \(also at "
                                          r"pre_quant_opt_config\[0\]\)"):
        ModelQuantizer(QConfig(global_quant_config=W4, pre_quant_opt_config=[SmoothQuantConfig()],
                               algo_config=[SmoothQuantConfig()]))


def test_run_order_and_plan_show_the_algorithms_in_the_order_they_run() -> None:
    from quark_brevitas.cli import run_order_lines

    config = QConfig(global_quant_config=W4, algo_config=[SmoothQuantConfig(), AWQConfig(), GPTQConfig()])
    assert [where for where, _ in config.run_order()] == ["pre_quant_opt_config[0]", "algo_config[0]",
                                                          "algo_config[1]", "algo_config[2]"]
    lines = run_order_lines(config)
    assert lines[0] == "algorithms, in the order they run:"
    assert lines[2] == "  2. algo_config[0] SmoothQuantConfig (before quantization, on the float model)"
    assert lines[4] == "  4. algo_config[2] GPTQConfig (after quantization and calibration)"


# ---------------------------------------------------------------- Quark's spec conventions
def test_ch_axis_minus_one_means_the_input_channels_of_per_group_weights() -> None:
    ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=ref_spec(Dtype.int4, True))))
    spec = dataclasses.replace(ref_spec(Dtype.int4, True), ch_axis=-1)
    ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=spec)))
    per_channel = QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_channel, ch_axis=-1)
    with pytest.raises(ConfigError, match=r"global_quant_config.weight.ch_axis: -1 is not supported for per_channel"):
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=per_channel)))


def test_observer_classes_map_to_param_type_or_are_refused_with_the_reason() -> None:
    from quark_brevitas.config.observers import PerTensorMSEObserver
    from quark_brevitas.quantizers import build_quantizer

    mse = QTensorConfig(dtype=Dtype.int8, observer_cls=PerTensorMSEObserver).resolved()
    assert mse.param_type.name == "mse" and mse.observer_cls == "PerTensorMSEObserver"
    contradiction = QTensorConfig(dtype=Dtype.int4, observer_cls=PerChannelMinMaxObserver,
                                  qscheme=QSchemeType.per_group, group_size=32)
    with pytest.raises(ConfigError, match=r"weight.qscheme: observer_cls=PerChannelMinMaxObserver means "
                                          r"qscheme=per_channel, but qscheme is per_group"):
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=contradiction)))
    with pytest.raises(ConfigError, match=r"weight.observer_cls: PerTensorHistogramObserver is not supported: "
                                          r"Brevitas has no histogram"):
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=QTensorConfig(
            observer_cls="PerTensorHistogramObserver"))))
    # a min-max observer calibrates static activations on the maximum, not on the default percentile
    minmax = build_quantizer(QTensorConfig(dtype=Dtype.int8, observer_cls=PerTensorMinMaxObserver), "input_tensors")
    default = build_quantizer(QTensorConfig(dtype=Dtype.int8), "input_tensors")
    assert minmax.high_percentile_q == 100.0 and default.high_percentile_q != 100.0


def test_target_device_cpu_is_honoured_and_ipu_refused() -> None:
    ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=QTensorConfig(), target_device=DeviceType.CPU)))
    with pytest.raises(ConfigError, match=r"global_quant_config.target_device: IPU is not supported"):
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=QTensorConfig(), target_device=DeviceType.IPU)))


def test_quarks_top_level_names() -> None:
    import quark_brevitas
    from quark_brevitas.config import Config

    assert "QConfig" in quark_brevitas.__all__ and quark_brevitas.QConfig is QConfig
    # one class under two names: QConfig builds a Config, and every Config is a QConfig
    built = QConfig(global_quant_config=W4)
    assert type(built) is Config and built == Config(global_quant_config=W4)
    assert isinstance(Config(global_quant_config=W4), QConfig) and issubclass(Config, QConfig)
    assert quark_brevitas.ModelQuantizer is ModelQuantizer


# ---------------------------------------------------------------- Quark 0.13's QConfig fields that Config lacks
QUARK_DEFAULTS = {"kv_cache_quant_config": {}, "kv_cache_group": [], "min_kv_scale": 0.0, "kv_cache_post_rope": False,
                  "shared_scale_groups": [], "softmax_quant_spec": None, "quant_mode": "eager_mode",
                  "quant_flow": "standard", "gpu_resident_blocks": 0, "sync_moe_expert_input_amax": False,
                  "keep_prequantized_layers": True, "log_severity_level": 1, "version": "0.13.0"}


def test_quarks_qconfig_fields_at_their_defaults_and_metadata_are_accepted() -> None:
    import enum

    from quark_brevitas.config.quark_fields import QUARK_ONLY_FIELDS

    class QuantizationMode(enum.Enum):  # Quark's enum, as Quark 0.13 code passes it
        eager_mode = 1
        fx_graph_mode = 2

    kv_fields = {"kv_cache_quant_config", "kv_cache_group", "min_kv_scale", "kv_cache_post_rope",
                 "softmax_quant_spec"}  # Config's own now
    assert (set(QUARK_DEFAULTS) - kv_fields) | {"quant_method"} == set(QUARK_ONLY_FIELDS)
    plain = QConfig(global_quant_config=W4, algo_config=[AWQConfig()])
    spelled_out = QConfig(global_quant_config=W4, algo_config=[AWQConfig()],
                          **{**QUARK_DEFAULTS, "quant_mode": QuantizationMode.eager_mode})
    assert spelled_out == plain
    # a file Quark 0.13 writes carries them (and its quant_method marker) at the top level
    written_by_quark = {**plain.to_dict(), **QUARK_DEFAULTS, "quant_method": "quark", "log_severity_level": None}
    assert QConfig.from_dict(written_by_quark) == plain


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("quant_mode", "dynamic_mode", "'dynamic_mode' is not supported: quant_mode picks the backend"),
    ("quant_flow", "per_block", "quantize_pretrained"),
    ("keep_prequantized_layers", False, "float models only"),
    ("version", 13, "13 is the version of Quark that wrote the config (metadata); allowed: a str or None"),
])
def test_quarks_qconfig_fields_that_would_change_something_are_refused(field: str, value, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        QConfig(global_quant_config=W4, **{field: value})
    assert info.value.path == field and fragment in str(info.value)
    with pytest.raises(ConfigError) as from_file:
        QConfig.from_dict({**QConfig(global_quant_config=W4).to_dict(), field: value if field != "kv_cache_quant_config"
                           else {"*k_proj": {"output_tensors": {}}}})
    assert from_file.value.path == field
