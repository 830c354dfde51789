"""KV-cache quantization (issue 30): Quark 0.13's fields and template arguments, the quantizers' numerics against
references computed here from the float model, the cache transformers keeps, and the exported scales."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.consumer import run_consumer  # noqa: E402
from helpers.llm_models import incremental_logits, logits, tiny_llama, token_batches  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import Config, QConfig, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.config.template import LLMTemplate  # noqa: E402
from quark_brevitas.errors import ConfigError, ModelError  # noqa: E402
from quark_brevitas.export import ExportError, export_safetensors  # noqa: E402
from quark_brevitas.model_parts.kv_cache import kv_plan_lines, kv_quantization_disabled, kv_scales  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

FP8 = QTensorConfig(dtype=Dtype.fp8_e4m3, is_dynamic=False)
INT8 = QTensorConfig(dtype=Dtype.int8, is_dynamic=False)
GRID = {"fp8": 448.0, "int8": 127.0}


def kv_config(spec: QTensorConfig = FP8, *, post_rope: bool = True, group: bool = True, min_kv_scale: float = 0.0,
              weights: QLayerConfig | None = None) -> Config:
    """Quark 0.13's spelling: QConfig with kv_cache_quant_config on the key/value projections."""
    return QConfig(global_quant_config=weights or QLayerConfig(), pre_quant_opt_config=[],
                   kv_cache_quant_config={"*k_proj": QLayerConfig(output_tensors=spec),
                                          "*v_proj": QLayerConfig(output_tensors=spec)},
                   kv_cache_group=["*k_proj", "*v_proj"] if group else [], min_kv_scale=min_kv_scale,
                   kv_cache_post_rope=post_rope)


def _float_maxima(model: torch.nn.Module, batches: list[torch.Tensor], post_rope: bool) -> list[tuple[float, float]]:
    """Per layer, max |K| and max |V| of the float model over ``batches``: after RoPE from the DynamicCache the
    model fills, before RoPE from the projections' outputs."""
    layers = model.config.num_hidden_layers
    maxima = [[0.0, 0.0] for _ in range(layers)]
    hooks = []
    if not post_rope:
        for i, layer in enumerate(model.model.layers):
            for j, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj)):
                def hook(module, args, out, i=i, j=j):
                    maxima[i][j] = max(maxima[i][j], float(out.abs().max()))
                hooks.append(proj.register_forward_hook(hook))
    with torch.no_grad():
        for batch in batches:
            out = model(batch, use_cache=True)
            if post_rope:
                for i, layer in enumerate(out.past_key_values.layers):
                    maxima[i][0] = max(maxima[i][0], float(layer.keys.abs().max()))
                    maxima[i][1] = max(maxima[i][1], float(layer.values.abs().max()))
    for hook in hooks:
        hook.remove()
    return [tuple(m) for m in maxima]


# ===================================================================== Quark 0.13 code, imports changed only
def test_quark_013_kv_cache_fields_run() -> None:
    """Quark 0.13's QConfig(kv_cache_quant_config=..., kv_cache_group=..., min_kv_scale=..., kv_cache_post_rope=...)
    builds a Config that quantizes (these fields were refused before issue 30)."""
    config = kv_config(post_rope=False)
    assert set(config.kv_cache_quant_config) == {"*k_proj", "*v_proj"} and config.kv_cache_group
    model = tiny_llama()
    quant = ModelQuantizer(config).quantize_model(model, token_batches(2))
    assert len(kv_scales(quant)) == 2
    assert Config.from_dict(json.loads(config.to_json())) == config


def test_quark_013_template_kv_cache_scheme() -> None:
    """LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8") as Quark writes it: the cache
    entries carry the projections' weight/input specs and the cache spec; the cache is not quantized twice (the
    projections' layer entries keep no output spec)."""
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", min_kv_scale=1e-4)
    assert config.kv_cache_group == ["*k_proj", "*v_proj"] and config.min_kv_scale == 1e-4
    for pattern in ("*k_proj", "*v_proj"):
        entry = config.kv_cache_quant_config[pattern]
        assert entry.output_tensors.dtype is Dtype.fp8_e4m3 and entry.output_tensors.is_dynamic is False
        assert entry.weight == config.global_quant_config.weight
        assert config.layer_quant_config[pattern].output_tensors is None
    assert Config.from_dict(config.to_dict()) == config
    quant = ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2))
    assert {s.fmt for s in kv_scales(quant)} == {"fp8_e4m3"}
    int8 = LLMTemplate.get("llama").get_config(scheme="int8", kv_cache_scheme="int8")
    assert int8.kv_cache_quant_config["*k_proj"].output_tensors.dtype is Dtype.int8


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_cache_scheme": "fp4"}, "kv_cache_scheme"),
    ({"kv_cache_scheme": "fp8", "attention_scheme": "fp16"}, "attention_scheme"),
])
def test_template_refuses_what_it_cannot_execute(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        LLMTemplate.get("llama").get_config(scheme="fp8", **kwargs)


@pytest.mark.parametrize("spec, post_rope, match", [
    (QTensorConfig(dtype=Dtype.fp8_e4m3, is_dynamic=True), True, "is_dynamic"),
    (QTensorConfig(dtype=Dtype.int8, symmetric=False), True, "symmetric"),
    (QTensorConfig(dtype=Dtype.int4), True, "not a cache format"),
    (QTensorConfig(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_channel, ch_axis=1), False, "per_channel"),
])
def test_unexecutable_cache_specs_are_refused(spec: QTensorConfig, post_rope: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelQuantizer(kv_config(spec, post_rope=post_rope))


def test_patterns_matching_no_projection_or_half_a_cache_are_refused() -> None:
    config = Config(QLayerConfig(), pre_quant_opt_config=[], kv_cache_quant_config={
        "*key_proj": QLayerConfig(output_tensors=FP8)})
    with pytest.raises(ModelError, match="match no key/value projection"):
        ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(1))
    config = Config(QLayerConfig(), pre_quant_opt_config=[], kv_cache_quant_config={
        "*k_proj": QLayerConfig(output_tensors=FP8)})
    with pytest.raises(ModelError, match="v_proj"):
        ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(1))


# ===================================================================== numerics against the float model
@pytest.mark.parametrize("post_rope", [True, False])
@pytest.mark.parametrize("name, spec", [("fp8", FP8), ("int8", INT8)])
def test_scales_are_the_calibration_maxima_of_the_float_model(name: str, spec: QTensorConfig, post_rope: bool) -> None:
    """Whole-model calibration sees the float model's keys and values (nothing else is quantized): the scale of a
    layer is max(max|K|, max|V|) / grid maximum (kv_cache_group shares it), K after RoPE or before."""
    model, batches = tiny_llama(), token_batches(3)
    quant = ModelQuantizer(kv_config(spec, post_rope=post_rope)).quantize_model(model, batches, blocks=False)
    expected = _float_maxima(model, batches, post_rope)
    for scales, (k_max, v_max) in zip(kv_scales(quant), expected):
        assert float(scales.key) == pytest.approx(max(k_max, v_max) / GRID[name], rel=1e-6)
        assert float(scales.value) == float(scales.key)


def test_without_a_group_keys_and_values_keep_their_scales_and_min_kv_scale_floors() -> None:
    model, batches = tiny_llama(), token_batches(3)
    quant = ModelQuantizer(kv_config(group=False)).quantize_model(model, batches, blocks=False)
    for scales, (k_max, v_max) in zip(kv_scales(quant), _float_maxima(model, batches, True)):
        assert float(scales.key) == pytest.approx(k_max / 448, rel=1e-6)
        assert float(scales.value) == pytest.approx(v_max / 448, rel=1e-6)
    floor = 0.05
    floored = ModelQuantizer(kv_config(min_kv_scale=floor)).quantize_model(model, batches, blocks=False)
    for scales, (k_max, v_max) in zip(kv_scales(floored), _float_maxima(model, batches, True)):
        assert float(scales.key) == pytest.approx(max(k_max / 448, v_max / 448, floor), rel=1e-6)


@pytest.mark.parametrize("name, spec", [("fp8", FP8), ("int8", INT8)])
def test_the_cache_holds_quantized_values_and_decoding_matches_the_full_forward(name: str,
                                                                               spec: QTensorConfig) -> None:
    """After RoPE, what transformers' DynamicCache stores is on the grid (x / scale is an FP8 E4M3 value / an
    integer in -128..127); decoding token by token through the cache gives the logits of the full forward (the
    past is stored quantized, as it is read)."""
    quant = ModelQuantizer(kv_config(spec)).quantize_model(tiny_llama(), token_batches(2))
    tokens = token_batches(1, batch=2, length=12, seed=3)[0]
    with torch.no_grad():
        out = quant(tokens, use_cache=True)
        for scales, layer in zip(kv_scales(quant), out.past_key_values.layers):
            for stored, scale in ((layer.keys, scales.key), (layer.values, scales.value)):
                codes = stored.float() / scale
                if name == "fp8":
                    assert torch.allclose(codes.to(torch.float8_e4m3fn).float(), codes, rtol=1e-5, atol=0)
                else:
                    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 128
        full = out.logits
    assert torch.allclose(incremental_logits(quant, tokens, 8), full, atol=1e-5)
    with kv_quantization_disabled(quant):
        assert not torch.allclose(logits(quant, tokens), full, atol=1e-5)  # the cache's quantization is felt
    generated = quant.generate(tokens[:, :6], attention_mask=torch.ones_like(tokens[:, :6]), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 10)


def test_block_by_block_calibrates_every_layer_and_plan_shows_the_cache() -> None:
    config = kv_config(INT8)
    model = tiny_llama(layers=3)
    quant = ModelQuantizer(config).quantize_model(model, token_batches(2), blocks=True)
    scales = kv_scales(quant)
    assert [s.key_target for s in scales] == [f"model.layers.{i}.self_attn.k_proj" for i in range(3)]
    assert all(float(s.key) > 0 for s in scales)
    lines = kv_plan_lines(model, config)
    assert "3 attention layers" in lines[0] and "after RoPE" in lines[0]
    assert "  model.layers.2.self_attn.v_proj: int8 static, per tensor (*v_proj)" in lines


# ===================================================================== exports
def _tokens() -> torch.Tensor:
    return token_batches(1, batch=2, length=16, seed=7)[0]


def test_compressed_tensors_folder_carries_kv_cache_scheme_and_scales(tmp_path: Path) -> None:
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8")
    with pytest.raises(ExportError, match="before RoPE"):
        export_safetensors(ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2)), tmp_path / "pre")
    config.kv_cache_post_rope = True
    quant = ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2))
    folder = export_safetensors(quant, tmp_path / "ct")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(quantization)
    assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.strategy == "tensor"
    tensors = load_file(folder / "model.safetensors")
    for scales in kv_scales(quant):
        assert torch.equal(tensors[f"{scales.attention}.k_scale"], scales.key.reshape(1))
        assert torch.equal(tensors[f"{scales.attention}.v_scale"], scales.value.reshape(1))


_CONSUMER = """
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            result[folder] = model(tokens).logits.float()
"""


def test_quark_folder_carries_output_scales_and_kv_config(tmp_path: Path) -> None:
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", min_kv_scale=1e-6)
    quant = ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2))
    folder = export_safetensors(quant, tmp_path / "quark", format="quark")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["kv_cache_post_rope"] is False
    assert quantization["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    assert quantization["export"]["min_kv_scale"] == 1e-6
    tensors = load_file(folder / "model.safetensors")
    for scales in kv_scales(quant):
        for target, scale in ((scales.key_target, scales.key), (scales.value_target, scales.value)):
            assert torch.equal(tensors[f"{target}.output_scale"], scale.reshape(()))
            entry = quantization["kv_cache_quant_config"][target]
            assert entry["output_tensors"]["dtype"] == "fp8_e4m3" and entry["weight"]["dtype"] == "fp8_e4m3"
            assert quantization["layer_quant_config"][target]["output_tensors"] == entry["output_tensors"]
    # the file's recipe (Quark's spelling of every spec, kv_cache_quant_config's included) reads back as a Config
    again = Config.from_dict(quantization)
    assert set(again.kv_cache_quant_config) == {s.key_target for s in kv_scales(quant)} | {
        s.value_target for s in kv_scales(quant)}


@pytest.mark.slow
def test_amd_quarks_importer_computes_our_logits_with_the_quantized_cache(tmp_path: Path) -> None:
    """amd-quark 0.13 (in a process without quark_brevitas) loads the Quark folder of the template's config and
    quantizes the k_proj/v_proj outputs with our scales: our logits exactly."""
    from helpers.consumer import quark_interpreter

    found = quark_interpreter()
    if found is None:
        pytest.skip("amd-quark is not importable (set QUARK_PYTHON to an interpreter with amd-quark==0.13)")
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8")
    quant = ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2))
    folder = export_safetensors(quant, tmp_path / "quark", format="quark")
    tokens = _tokens()
    theirs = run_consumer(_CONSUMER, [folder], tokens, tmp_path, python=found[0], pythonpath=found[1],
                          timeout=1200)[str(folder)]
    ours = logits(quant, tokens)
    assert torch.allclose(theirs, ours, atol=1e-5)
    with kv_quantization_disabled(quant):
        assert not torch.allclose(theirs, logits(quant, tokens), atol=1e-5)


def test_cli_plan_shows_the_kv_quantizers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.cli import main

    tiny_llama().save_pretrained(tmp_path / "model")
    assert main(["plan", "--model", str(tmp_path / "model"), "--template", "llama", "--scheme", "fp8",
                 "--kv-cache-scheme", "int8"]) == 0
    shown = capsys.readouterr().out
    assert "KV cache: 2 attention layers quantized on the k_proj/v_proj outputs, before RoPE" in shown
    assert "  model.layers.1.self_attn.v_proj: int8 static, per tensor (*v_proj)" in shown


def test_checkpoints_refuse_a_quantized_cache_they_would_drop(tmp_path: Path) -> None:
    from quark_brevitas.checkpoint import CheckpointError, save_quantized

    quant = ModelQuantizer(kv_config()).quantize_model(tiny_llama(), token_batches(1))
    with pytest.raises(CheckpointError, match="KV-cache"):
        save_quantized(quant, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_streamed_quantization_refuses_a_quantized_cache_it_would_drop(tmp_path: Path) -> None:
    from quark_brevitas.checkpoint import CheckpointError
    from quark_brevitas.hf.streaming import quantize_pretrained

    tiny_llama().save_pretrained(tmp_path / "model")
    with pytest.raises(CheckpointError, match="KV-cache"):
        quantize_pretrained(tmp_path / "model", kv_config(), token_batches(1), tmp_path / "out")
    assert not (tmp_path / "out").exists()
