"""Attention quantization (issue 30, ``attention_scheme``): Quark 0.13's ``softmax_quant_spec`` and the query spec its
template writes, the quantizers' scales against the float model's queries and probabilities, and the quantized model's
logits against an eager attention written here that quantizes q and the probabilities by hand."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.llm_models import incremental_logits, logits, tiny_gpt2, tiny_llama, token_batches  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import Config, QConfig, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.config.template import LLMTemplate  # noqa: E402
from quark_brevitas.errors import ConfigError, ModelError  # noqa: E402
from quark_brevitas.model_parts.attention import (  # noqa: E402
    attention_quantization_disabled,
    attention_scales,
)
from quark_brevitas.model_parts.kv_cache import kv_quantization_disabled, kv_scales  # noqa: E402
from quark_brevitas.types import Backend, Dtype, QSchemeType  # noqa: E402

FP8 = QTensorConfig(dtype=Dtype.fp8_e4m3, is_dynamic=False)
INT8 = QTensorConfig(dtype=Dtype.int8, is_dynamic=False)
GRID = {"fp8_e4m3": 448.0, "int8": 127.0}


def attention_only(spec: QTensorConfig = FP8, *, post_rope: bool = True) -> Config:
    """Quark 0.13's spelling of attention quantization alone: softmax_quant_spec and the q_proj output spec."""
    return QConfig(global_quant_config=QLayerConfig(), pre_quant_opt_config=[], softmax_quant_spec=spec,
                   layer_quant_config={"*q_proj": QLayerConfig(output_tensors=spec)}, kv_cache_post_rope=post_rope)


def hand_quantize(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """``clamp(cast(x / s)) * s`` written out: FP8 E4M3 through torch's float8 dtype, int8 by rounding half to even."""
    y = x.float() / scale
    y = y.clamp(-448, 448).to(torch.float8_e4m3fn).float() if fmt == "fp8_e4m3" else torch.round(y).clamp(-128, 127)
    return (y * scale).to(x.dtype)


# ===================================================================== a reference attention
_STATE: dict[str, Callable] = {}


def _reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    return _STATE["attention"](module, query, key, value, attention_mask, scaling)


AttentionInterface.register("qb_test_reference", _reference_attention)


@contextlib.contextmanager
def routed(model: torch.nn.Module, attention: Callable) -> Iterator[None]:
    """Every attention of ``model`` calls ``attention(module, q, k, v, mask, scaling)`` (after RoPE)."""
    saved = []
    for layer in model.model.layers:
        module = layer.self_attn
        saved.append((module, module.config))
        own = type(module.config).from_dict(module.config.to_dict())
        own._attn_implementation_internal = "qb_test_reference"
        module.config = own
    _STATE["attention"] = attention
    try:
        yield
    finally:
        for module, config in saved:
            module.config = config


def eager(module, q, k, v, mask, scaling, *, q_scale=None, p_scale=None, fmt="fp8_e4m3", seen=None):
    """Eager attention from its definition, q and the probabilities quantized by hand where scales are given;
    ``seen`` collects max |q| and max p per module (for the scales' check)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if q_scale is not None:
        q = hand_quantize(q, q_scale(module), fmt)
    weights = q @ k.transpose(2, 3) * scaling
    if mask is not None:
        weights = weights + mask
    p = torch.softmax(weights.float(), dim=-1)
    if seen is not None:
        entry = seen.setdefault(id(module), [0.0, 0.0])
        entry[0], entry[1] = max(entry[0], float(q.abs().max())), max(entry[1], float(p.max()))
    if p_scale is not None:
        p = hand_quantize(p, p_scale(module), fmt)
    return (p.to(q.dtype) @ v).transpose(1, 2).contiguous(), p


def _scale_of(quant: torch.nn.Module, kind: str) -> Callable:
    scales = {id(quant.get_submodule(s.attention)): s for s in attention_scales(quant)}
    return lambda module: float(getattr(scales[id(module)], kind))


# ===================================================================== Quark 0.13 code, imports changed only
def test_quark_013_template_attention_scheme() -> None:
    """get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8") as Quark 0.13 builds it: the
    softmax_quant_spec and the query projections' output spec (static FP8 E4M3 per tensor), the weight/input specs
    kept; the config round-trips through its file."""
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")
    assert config.softmax_quant_spec.dtype is Dtype.fp8_e4m3 and config.softmax_quant_spec.is_dynamic is False
    query = config.layer_quant_config["*q_proj"]
    assert query.output_tensors == config.softmax_quant_spec and query.weight == config.global_quant_config.weight
    assert query.input_tensors == config.global_quant_config.input_tensors
    assert Config.from_dict(config.to_dict()) == config
    assert Config.from_dict(json.loads(config.to_json())).softmax_quant_spec == config.softmax_quant_spec
    int8 = LLMTemplate.get("llama").get_config(scheme="int8", attention_scheme="int8")
    assert int8.softmax_quant_spec.dtype is Dtype.int8
    # an excluded query projection gets no query spec (Quark's template skips it too)
    kept = LLMTemplate.get("llama").get_config(scheme="fp8", attention_scheme="fp8", exclude_layers=["*q_proj"])
    assert "*q_proj" not in kept.layer_quant_config and kept.softmax_quant_spec is not None


@pytest.mark.parametrize("kwargs, field", [
    ({"attention_scheme": "fp4"}, "attention_scheme"),
    ({"attention_scheme": "mxfp8"}, "attention_scheme"),
])
def test_template_refuses_unknown_attention_schemes(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        LLMTemplate.get("llama").get_config(scheme="fp8", **kwargs)


@pytest.mark.parametrize("spec, match", [
    (QTensorConfig(dtype=Dtype.fp8_e4m3, is_dynamic=True), "is_dynamic"),
    (QTensorConfig(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_channel, ch_axis=1), "qscheme"),
    (QTensorConfig(dtype=Dtype.int8, symmetric=False), "symmetric"),
    (QTensorConfig(dtype=Dtype.int4), "not a cache format"),
])
def test_unexecutable_softmax_specs_are_refused(spec: QTensorConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(), softmax_quant_spec=spec))
    assert info.value.path.startswith("softmax_quant_spec")


def test_graph_backend_and_models_without_attention_are_refused() -> None:
    with pytest.raises(ConfigError, match="Backend.layerwise"):
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(), softmax_quant_spec=FP8, backend=Backend.graph))
    with pytest.raises(ModelError, match="no attention module with q_proj"):  # GPT-2: one fused c_attn
        ModelQuantizer(QConfig(global_quant_config=QLayerConfig(), pre_quant_opt_config=[],
                               softmax_quant_spec=FP8)).quantize_model(tiny_gpt2(), token_batches(1))


def test_a_query_spec_that_the_attention_cannot_execute_names_the_projection() -> None:
    config = attention_only()
    config.layer_quant_config["*q_proj"] = QLayerConfig(output_tensors=QTensorConfig(dtype=Dtype.int8,
                                                                                     symmetric=False))
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj\.output_tensors.*symmetric"):
        ModelQuantizer(config).quantize_model(model, token_batches(1))
    assert model.model.layers[0].self_attn.q_proj.__class__ is torch.nn.Linear  # refused before any work


# ===================================================================== numerics
def test_sdpa_models_are_switched_to_eager_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    with caplog.at_level(logging.WARNING):
        ModelQuantizer(attention_only()).quantize_model(model, token_batches(1))
    assert "switched to eager attention" in caplog.text and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("post_rope", [True, False])
@pytest.mark.parametrize("spec", [FP8, INT8], ids=["fp8", "int8"])
def test_scales_are_the_float_models_maxima(post_rope: bool, spec: QTensorConfig) -> None:
    """Nothing else quantized: the query scale is max |q| / grid maximum of the float model (after RoPE, or the
    q_proj output before it) and the probability scale max p / grid maximum (the first token's p is 1)."""
    model, batches = tiny_llama(), token_batches(3)
    model.set_attn_implementation("eager")
    quant = ModelQuantizer(attention_only(spec, post_rope=post_rope)).quantize_model(model, batches, blocks=False)
    seen: dict[int, list[float]] = {}
    before = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda m, a, out, i=i: before.__setitem__(i, max(before.get(i, 0.0), float(out.abs().max()))))
        for i, layer in enumerate(model.model.layers)]
    with routed(model, lambda *a: eager(*a, seen=seen)), torch.no_grad():
        for batch in batches:
            model(batch)
    for hook in hooks:
        hook.remove()
    fmt = "fp8_e4m3" if spec is FP8 else "int8"
    for i, (scales, layer) in enumerate(zip(attention_scales(quant), model.model.layers)):
        q_max, p_max = seen[id(layer.self_attn)]
        assert scales.query_fmt == scales.prob_fmt == fmt and scales.post_rope is post_rope
        assert float(scales.query) == pytest.approx((q_max if post_rope else before[i]) / GRID[fmt], rel=1e-6)
        assert float(scales.prob) == pytest.approx(p_max / GRID[fmt], rel=1e-6) and p_max == 1.0
    # the two places differ (RoPE rotates pairs of channels), so the check above tells them apart
    assert before[0] != pytest.approx(seen[id(model.model.layers[0].self_attn)][0], rel=1e-6)


@pytest.mark.parametrize("post_rope", [True, False])
def test_logits_match_an_eager_attention_quantizing_q_and_probabilities_by_hand(post_rope: bool) -> None:
    """The template's fp8 model with fp8 KV cache and fp8 attention: its logits are those of the same model whose
    attention is the eager formula written here, q (after RoPE, or on the q_proj output) and the probabilities
    quantized by hand with the model's scales; without the attention quantizers they differ."""
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")
    config.kv_cache_post_rope = post_rope
    quant = ModelQuantizer(config).quantize_model(tiny_llama(), token_batches(2))
    assert len(kv_scales(quant)) == 2 and len(attention_scales(quant)) == 2
    for layer in quant.model.layers:  # the query spec is executed once, by the attention's quantizer
        assert not layer.self_attn.q_proj.output_quant.is_quant_enabled
    tokens = token_batches(1, batch=2, length=16, seed=7)[0]
    ours = logits(quant, tokens)
    q_scale, p_scale = _scale_of(quant, "query"), _scale_of(quant, "prob")
    hooks = []
    with attention_quantization_disabled(quant):
        unquantized = logits(quant, tokens)
        if not post_rope:
            hooks = [layer.self_attn.q_proj.register_forward_hook(
                lambda m, a, out, s=float(scales.query): hand_quantize(out, s, "fp8_e4m3"))
                for layer, scales in zip(quant.model.layers, attention_scales(quant))]
        with routed(quant, lambda *a: eager(*a, q_scale=q_scale if post_rope else None, p_scale=p_scale)):
            reference = logits(quant, tokens)
    for hook in hooks:
        hook.remove()
    assert torch.allclose(ours, reference, atol=1e-5, rtol=0), float((ours - reference).abs().max())
    assert not torch.allclose(ours, unquantized, atol=1e-3)


def test_decoding_through_the_cache_matches_the_full_forward_and_generate_runs() -> None:
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme="fp8", attention_scheme="fp8")
    config.kv_cache_post_rope = True
    quant = ModelQuantizer(config).quantize_model(tiny_llama(layers=3), token_batches(2), blocks=True)
    assert [s.attention for s in attention_scales(quant)] == [f"model.layers.{i}.self_attn" for i in range(3)]
    tokens = token_batches(1, batch=2, length=12, seed=3)[0]
    with torch.no_grad():
        full = quant(tokens, use_cache=True).logits
    assert torch.allclose(incremental_logits(quant, tokens, 8), full, atol=1e-5)
    with kv_quantization_disabled(quant), attention_quantization_disabled(quant):
        assert not torch.allclose(logits(quant, tokens), full, atol=1e-3)
    generated = quant.generate(tokens[:, :6], attention_mask=torch.ones_like(tokens[:, :6]), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 10)


def test_cli_plan_shows_the_attention_quantizers(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from quark_brevitas.cli import main

    tiny_llama().save_pretrained(tmp_path / "model")
    assert main(["plan", "--model", str(tmp_path / "model"), "--template", "llama", "--scheme", "fp8",
                 "--kv-cache-scheme", "fp8", "--attention-scheme", "fp8"]) == 0
    shown = capsys.readouterr().out
    assert "Attention: 2 attention layers, probabilities (softmax output) fp8_e4m3 static per tensor" in shown
    assert "queries quantized on the q_proj outputs, before RoPE" in shown
    assert "  model.layers.1.self_attn: probabilities fp8_e4m3, query fp8_e4m3 static per tensor" in shown


def test_checkpoints_refuse_attention_quantization_they_would_drop(tmp_path) -> None:
    from quark_brevitas.checkpoint import CheckpointError, save_quantized

    quant = ModelQuantizer(attention_only()).quantize_model(tiny_llama(), token_batches(1))
    with pytest.raises(CheckpointError, match="softmax_quant_spec"):
        save_quantized(quant, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
