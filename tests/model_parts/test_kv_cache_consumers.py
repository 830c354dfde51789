"""KV-cache folders loaded by their consumers in a fresh process without quark_brevitas (issue 30): transformers with
compressed-tensors, and amd-quark's importer.

Where a consumer cannot apply the cache scales, the test says which line of the consumer stops it and checks the
best thing that still holds: the consumer reads the scales under the names we write them, and its own quantization
code, applied where it would apply it, computes our logits.

- compressed-tensors 0.20 (the newest release) attaches its KV-cache hook only to attention modules whose ``forward``
  takes ``past_key_values`` (``compressed_tensors/quantization/lifecycle/initialize.py``,
  ``is_cached_attention_module``: ``return "past_key_value" in parameters or "past_key_values" in parameters``).
  transformers 5.23's attention takes ``past_key_values``: the cache is quantized, our logits exactly. transformers
  5.24 renamed it ``cache``: the scales load as unused keys and the cache runs in float. There the test loads the
  folder a second time with compressed-tensors' hook taught the new keyword (its own ``QuantizedKVCache`` and
  ``forward_quantize``, fed the file's ``k_scale`` / ``v_scale``): our logits exactly.
  ``QB_CONSUMER_TRANSFORMERS`` names a directory holding another transformers release
  (``pip install --no-deps --target DIR transformers==5.23.0``), put first on the consumer's path; without it,
  ``.consumers/transformers`` in the repository, where ``.ci/run`` installs 5.23.
- amd-quark 0.13 writes a post-RoPE cache's scales as a pre-RoPE one's (``<k_proj>.output_scale``) with
  ``kv_cache_post_rope: true``, as we do; its loaders apply them to the projections' outputs, before RoPE (see
  :func:`test_amd_quark_reads_post_rope_scales_and_applies_them_before_rope`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.consumer import quark_interpreter, run_consumer  # noqa: E402
from helpers.llm_models import logits, tiny_llama, token_batches  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import QTensorConfig  # noqa: E402
from quark_brevitas.config.template import LLMTemplate  # noqa: E402
from quark_brevitas.export import ExportError, export_safetensors  # noqa: E402
from quark_brevitas.model_parts.kv_cache import fake_quantize, kv_quantization_disabled, kv_scales  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

SITE_PACKAGES = str(Path(transformers.__file__).resolve().parents[1])
#: CI installs transformers 5.23 there (``.ci/run``); ``QB_CONSUMER_TRANSFORMERS`` names another directory.
CI_ALTERNATE = Path(__file__).resolve().parents[2] / ".consumers" / "transformers"
ALTERNATE = os.environ.get("QB_CONSUMER_TRANSFORMERS") or (str(CI_ALTERNATE) if CI_ALTERNATE.is_dir() else None)

#: What the consumer reports: its transformers release, whether compressed-tensors hooked the cache, the logits.
_CT_LOAD = """
    import transformers
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        attention = model.model.layers[0].self_attn
        result["version"] = transformers.__version__
        result["hooked"] = hasattr(attention, "kv_cache") and hasattr(attention, "k_scale")
        with torch.no_grad():
            result["logits"] = model(tokens).logits.float()
"""

#: compressed-tensors' KV-cache hook taught transformers 5.24's ``cache`` keyword, nothing else changed.
_CT_TAUGHT_CACHE = """
    import inspect
    from compressed_tensors.modeling import kvcache
    from compressed_tensors.quantization.lifecycle import apply as ct_apply, initialize as ct_initialize

    original = ct_initialize.is_cached_attention_module

    def is_cached_attention_module(module):
        if original(module):
            return True
        if not any(hasattr(module, name) for name in ct_initialize._KV_CACHE_PROJECTION_NAMES):
            return False
        return "cache" in inspect.signature(module.forward).parameters

    def hook(module, args, kwargs):
        cache = getattr(module, kvcache.KV_CACHE_ATTR)
        cache.add_past_key_values(kwargs.get("cache"))
        kwargs["cache"] = cache
        return args, kwargs

    ct_initialize.is_cached_attention_module = ct_apply.is_cached_attention_module = is_cached_attention_module
    kvcache._kv_cache_attention_hook = hook
""" + _CT_LOAD


def _post_rope_quantized(kv: str, per_head: bool = False) -> torch.nn.Module:
    """The template's FP8 model with a post-RoPE cache; ``per_head``: one scale per key/value head (Quark's
    per-channel spec on the head axis, llm-compressor's ``attn_head`` strategy)."""
    config = LLMTemplate.get("llama").get_config(scheme="fp8", kv_cache_scheme=kv)
    config.kv_cache_post_rope = True
    if per_head:
        for entry in config.kv_cache_quant_config.values():
            entry.output_tensors = QTensorConfig(dtype=entry.output_tensors.dtype, is_dynamic=False,
                                                 qscheme=QSchemeType.per_channel, ch_axis=1)
    return ModelQuantizer(config).quantize_model(tiny_llama(kv_heads=2), token_batches(2))


def _tokens() -> torch.Tensor:
    return token_batches(1, batch=2, length=16, seed=7)[0]


@pytest.mark.slow
@pytest.mark.parametrize("transformers_path", [
    pytest.param(None, id="installed"),
    pytest.param(ALTERNATE, id="alternate", marks=pytest.mark.skipif(
        not ALTERNATE, reason="QB_CONSUMER_TRANSFORMERS names no directory with another transformers release")),
])
@pytest.mark.parametrize("kv, per_head", [("fp8", False), ("int8", False), ("fp8", True), ("int8", True)])
def test_transformers_applies_the_compressed_tensors_cache_scales(tmp_path: Path, kv: str, per_head: bool,
                                                                  transformers_path: str | None) -> None:
    quant = _post_rope_quantized(kv, per_head)
    folder = export_safetensors(quant, tmp_path / "ct")
    tensors = load_file(folder / "model.safetensors")
    scheme = json.loads((folder / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["strategy"] == ("attn_head" if per_head else "tensor")
    shape = (2, 1, 1) if per_head else (1,)  # tiny_llama(kv_heads=2)
    for scales in kv_scales(quant):  # the names vLLM and compressed-tensors read
        assert torch.equal(tensors[f"{scales.attention}.k_scale"], scales.key.reshape(shape))
        assert torch.equal(tensors[f"{scales.attention}.v_scale"], scales.value.reshape(shape))
        assert not per_head or scales.key.unique().numel() == 2  # one scale per head, not a copied scalar
    tokens = _tokens()
    path = os.pathsep.join(p for p in (transformers_path, SITE_PACKAGES) if p)
    theirs = run_consumer(_CT_LOAD, [folder], tokens, tmp_path, python=sys.executable, pythonpath=path)
    ours = logits(quant, tokens)
    with kv_quantization_disabled(quant):
        float_cache = logits(quant, tokens)
    assert not torch.allclose(ours, float_cache, atol=1e-3)  # the cache's quantization is felt
    if theirs["hooked"]:
        assert torch.equal(theirs["logits"], ours), theirs["version"]
        return
    # the alternate release is there to be one whose attention compressed-tensors hooks (5.23)
    assert transformers_path is None, f"transformers {theirs['version']} from {transformers_path}: cache unhooked"
    # transformers >= 5.24: compressed-tensors 0.20 leaves attention forwards taking `cache` unhooked
    assert torch.allclose(theirs["logits"], float_cache, atol=1e-5), theirs["version"]
    taught = run_consumer(_CT_TAUGHT_CACHE, [folder], tokens, tmp_path, python=sys.executable, pythonpath=path)
    assert taught["hooked"] and torch.equal(taught["logits"], ours), taught["version"]


@contextlib.contextmanager
def _scales_before_rope(model: torch.nn.Module) -> Iterator[None]:
    """``model`` (a post-RoPE KV model) with its cache scales applied to the k_proj / v_proj outputs instead."""
    hooks = []
    for scales in kv_scales(model):
        for target, scale in ((scales.key_target, scales.key), (scales.value_target, scales.value)):
            def quantize(module, args, output, scale=scale, fmt=scales.fmt):
                return fake_quantize(output, scale, fmt)
            hooks.append(model.get_submodule(target).register_forward_hook(quantize))
    try:
        with kv_quantization_disabled(model):
            yield
    finally:
        for hook in hooks:
            hook.remove()


_QUARK_LOAD = """
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            result["logits"] = model(tokens).logits.float()
"""


@pytest.mark.slow
def test_amd_quark_reads_post_rope_scales_and_applies_them_before_rope(tmp_path: Path) -> None:
    """A post-RoPE Quark folder as Quark 0.13 writes one (``<k_proj>.output_scale``, ``kv_cache_post_rope: true``).
    amd-quark's transformers loader applies every ``output_scale`` to the projection's output, before RoPE: its
    logits are ours with our scales moved there. (Quark's own ``import_model_from_safetensors`` moves the scales to
    its post-RoPE cache but leaves the projections' ``output_quantizer`` in place, so the keys are quantized
    twice, and with transformers 5.24 its cache's ``update`` rejects the ``kwargs=`` keyword; see
    docs/how-to/llm-serving.md.)"""
    found = quark_interpreter()
    if found is None:
        pytest.skip("amd-quark is not importable (set QUARK_PYTHON to an interpreter with amd-quark==0.13)")
    quant = _post_rope_quantized("fp8")
    folder = export_safetensors(quant, tmp_path / "quark", format="quark")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["kv_cache_post_rope"] is True
    tensors = load_file(folder / "model.safetensors")
    for scales in kv_scales(quant):
        assert torch.equal(tensors[f"{scales.key_target}.output_scale"], scales.key.reshape(()))
    tokens = _tokens()
    theirs = run_consumer(_QUARK_LOAD, [folder], tokens, tmp_path, python=found[0], pythonpath=found[1],
                          timeout=1200)["logits"]
    with _scales_before_rope(quant):
        moved = logits(quant, tokens)
    assert torch.allclose(theirs, moved, atol=1e-5)
    assert not torch.allclose(theirs, logits(quant, tokens), atol=1e-3)


def test_quark_format_refuses_per_head_cache_scales(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="per-head.*compressed-tensors"):
        export_safetensors(_post_rope_quantized("fp8", per_head=True), tmp_path / "quark", format="quark")
    assert not (tmp_path / "quark").exists()
