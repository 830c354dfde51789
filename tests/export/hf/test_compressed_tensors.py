"""export_safetensors(format="compressed-tensors"): folders that transformers loads without quark_brevitas.

Every written folder is loaded by ``AutoModelForCausalLM.from_pretrained`` in a fresh Python process started with
``-S`` (no site hooks, so the editable install of quark_brevitas is not on the path), whose working directory is a
temporary folder: the process asserts that ``import quark_brevitas`` fails and that nothing imported it. One process
loads every folder (startup costs seconds), the tests then compare its logits with ours.

Tolerances: weight-only and static-activation folders must match our logits to float32 rounding (``atol`` 1e-5 on
logits of magnitude ~2: the consumer computes ``(codes - zero_point) * scale`` and the same matmuls, possibly in
another order; a single flipped activation code would move a logit by ~1e-3). Dynamic per-token int8 cannot match
bit for bit: compressed-tensors' reference divides max|x| by 127.5, ours (and vLLM's int8 kernels) by 127, so those
logits agree within a few percent (relative norm < 5 %), i.e. a quantization step, not float noise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.consumer import run_consumer  # noqa: E402
from torch import nn  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig, QuantType  # noqa: E402
from quark_brevitas.export import ExportError, export_safetensors  # noqa: E402
from quark_brevitas.hf.export_streamed import export_safetensors_streamed  # noqa: E402
from quark_brevitas.outputs import OutputError  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

VOCAB = 128
SITE_PACKAGES = Path(transformers.__file__).resolve().parents[1]
FP8 = QTensorConfig(quant_type=QuantType.float_quant, bit_width=8, exponent_bit_width=4, mantissa_bit_width=3)


def _group(dtype: Dtype, size: int) -> QTensorConfig:
    return QTensorConfig(dtype=dtype, qscheme=QSchemeType.per_group, group_size=size)


PER_CHANNEL = QTensorConfig(qscheme=QSchemeType.per_channel)
#: name -> (model family, layer config, exact?)
CASES: dict[str, tuple[str, QLayerConfig, bool]] = {
    "llama_w4_g128_sym": ("llama", QLayerConfig(weight=_group(Dtype.int4, 128)), True),
    "llama_w4_g128_asym": ("llama", QLayerConfig(weight=_group(Dtype.uint4, 128)), True),
    "qwen2_w4_g32_sym": ("qwen2", QLayerConfig(weight=_group(Dtype.int4, 32)), True),
    "qwen2_w4_g32_asym": ("qwen2", QLayerConfig(weight=_group(Dtype.uint4, 32)), True),
    "llama_w4_channel_asym": ("llama", QLayerConfig(weight=QTensorConfig(dtype=Dtype.uint4,
                                                                         qscheme=QSchemeType.per_channel)), True),
    "qwen2_w8_channel_sym": ("qwen2", QLayerConfig(weight=PER_CHANNEL), True),
    "llama_w8a8_static": ("llama", QLayerConfig(weight=PER_CHANNEL, input_tensors=QTensorConfig()), True),
    "qwen2_w8a8_static_uint8": ("qwen2", QLayerConfig(weight=PER_CHANNEL, input_tensors=QTensorConfig(
        dtype=Dtype.uint8)), True),
    "qwen2_w8a8_dynamic_token": ("qwen2", QLayerConfig(weight=PER_CHANNEL, input_tensors=QTensorConfig(
        is_dynamic=True, qscheme=QSchemeType.per_channel)), False),
    "llama_fp8": ("llama", QLayerConfig(weight=FP8, input_tensors=FP8), True),
    "llama_fp8_weight_only": ("llama", QLayerConfig(weight=FP8), True),
}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()


def _tokens(seed: int, count: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(count)]


def _quantize(family: str, layer: QLayerConfig) -> nn.Module:
    config = Config(QLayerConfig(), layer_type_quant_config={nn.Linear: layer})
    return ModelQuantizer(config).quantize_model(_model(family), _tokens(1, 2))


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


_CONSUMER = """
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            result[folder] = model(tokens).logits.float()
"""


def _consumer_logits(folders: list[Path], tokens: torch.Tensor, work: Path) -> dict[str, torch.Tensor]:
    """Load every folder with transformers in a fresh process that cannot import quark_brevitas."""
    return run_consumer(_CONSUMER, folders, tokens, work, python=sys.executable, pythonpath=str(SITE_PACKAGES))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, tuple[torch.Tensor, torch.Tensor, Path]]:
    """name -> (our logits, the consumer's logits, folder), for every case of CASES."""
    work = tmp_path_factory.mktemp("ct")
    tokens = _tokens(7)[0]
    ours, folders = {}, {}
    for name, (family, layer, _) in CASES.items():
        model = _quantize(family, layer)
        ours[name] = _logits(model, tokens)
        folders[name] = export_safetensors(model, work / name)
    theirs = _consumer_logits(list(folders.values()), tokens, work)
    return {name: (ours[name], theirs[str(folders[name])], folders[name]) for name in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_transformers_loads_the_folder_without_quark_brevitas_and_computes_our_logits(loaded, name: str) -> None:
    ours, theirs, _ = loaded[name]
    if CASES[name][2]:
        torch.testing.assert_close(theirs, ours, rtol=0.0, atol=1e-5)
    else:
        assert float((theirs - ours).norm() / ours.norm()) < 0.05
        assert not torch.equal(theirs, ours)  # the consumer's own per-token scales (max|x| / 127.5)


@pytest.mark.slow
def test_quantization_config_is_what_compressed_tensors_defines(loaded) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    _, _, folder = loaded["llama_w4_g128_asym"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate({k: v for k, v in config.items()
                                                if k not in ("version", "sparsity_config", "transform_config")})
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.strategy, weights.group_size, weights.symmetric) == (4, "group", 128, False)
    assert config["quant_method"] == "compressed-tensors" and config["quantization_status"] == "compressed"
    _, _, folder = loaded["llama_w4_g128_sym"]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        packed = handle.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        scale = handle.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
        shape = handle.get_tensor("model.layers.0.mlp.down_proj.weight_shape")
    assert packed.dtype == torch.int32 and list(packed.shape) == [128, 256 * 4 // 32]
    assert list(scale.shape) == [128, 2] and shape.tolist() == [128, 256]


def test_packed_codes_are_ours_exactly(tmp_path: Path) -> None:
    """The packed int4 codes unpack (with compressed-tensors' own unpacker) to our layer's codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    model = _quantize("qwen2", CASES["qwen2_w4_g32_sym"][1])
    folder = export_safetensors(model, tmp_path / "out")
    tensors = load_file(str(folder / "model.safetensors"))
    layer = model.model.layers[1].self_attn.k_proj
    prefix = "model.layers.1.self_attn.k_proj."
    codes = unpack_from_int32(tensors[prefix + "weight_packed"], 4, tensors[prefix + "weight_shape"])
    rebuilt = codes.float() * tensors[prefix + "weight_scale"].repeat_interleave(32, dim=1)
    assert torch.equal(rebuilt, layer.quant_weight().value.detach())
    assert torch.equal(tensors["model.layers.1.self_attn.k_proj.bias"], layer.bias.detach())


# ===================================================================== refusals and the output folder
def test_output_quantizer_is_one_export_error_naming_the_layer(tmp_path: Path) -> None:
    model = _quantize("llama", QLayerConfig(weight=PER_CHANNEL, output_tensors=QTensorConfig()))
    with pytest.raises(ExportError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj': output quantizers.*"
                                          r"compressed-tensors holds Linear layers"):
        export_safetensors(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fp8_e5m2_weights_are_refused_naming_what_fits(tmp_path: Path) -> None:
    e5m2 = QTensorConfig(quant_type=QuantType.float_quant, bit_width=8, exponent_bit_width=5, mantissa_bit_width=2)
    model = _quantize("llama", QLayerConfig(weight=e5m2))
    with pytest.raises(ExportError, match=r"'model\.layers\.0\.self_attn\.q_proj'.*fp8_e5m2.*fp8 e4m3"):
        export_safetensors(model, tmp_path / "out")


def test_a_last_partial_group_is_refused(tmp_path: Path) -> None:
    """128 input channels in groups of 96 end with a partial group, which compressed-tensors cannot dequantize
    (transformers' from_pretrained failed with its ValueError): one ExportError naming the layer instead."""
    model = _quantize("llama", QLayerConfig(weight=dataclasses.replace(_group(Dtype.int4, 96), pad_groups=True)))
    with pytest.raises(ExportError, match=r"'model\.layers\.0\.self_attn\.q_proj'.*128 input channels.*groups of 96"):
        export_safetensors(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_format_and_a_float_model_are_refused(tmp_path: Path) -> None:
    model = _quantize("llama", QLayerConfig(weight=PER_CHANNEL))
    with pytest.raises(ExportError, match="format must be one of 'compressed-tensors', 'quark', got 'gguf'"):
        export_safetensors(model, tmp_path / "a", format="gguf")
    with pytest.raises(ExportError, match="no quantized Linear layer"):
        export_safetensors(_model("llama"), tmp_path / "b")


def test_a_folder_of_other_files_is_never_half_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    model = _quantize("llama", QLayerConfig(weight=PER_CHANNEL))
    with pytest.raises(OutputError, match="notes.txt"):
        export_safetensors(model, target)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    export_safetensors(model, target, overwrite=True)
    assert (target / "notes.txt").read_text() == "mine" and (target / "model.safetensors").is_file()


# ===================================================================== from a streamed checkpoint
@pytest.mark.slow
def test_streamed_checkpoint_is_written_block_by_block_without_the_float_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained

    float_dir = tmp_path / "float"
    _model("qwen2").save_pretrained(float_dir)
    config = Config(QLayerConfig(), layer_type_quant_config={nn.Linear: CASES["qwen2_w4_g32_asym"][1]},
                    pre_quant_opt_config=[], algo_config=[])
    batches = [{"input_ids": tokens} for tokens in _tokens(1, 2)]
    checkpoint = quantize_pretrained(float_dir, config, batches, tmp_path / "ckpt")
    shutil.rmtree(float_dir)  # the float weights are gone: nothing can load them
    streamed = export_safetensors_streamed(checkpoint, tmp_path / "streamed")
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00000.safetensors", "model-00001.safetensors",
                                                 "model-rest.safetensors"}
    model = load_pretrained_quantized(checkpoint)
    whole = export_safetensors(model, tmp_path / "whole")
    expected = load_file(str(whole / "model.safetensors"))
    written = {}
    for file in set(index["weight_map"].values()):
        written.update(load_file(str(streamed / file)))
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    tokens = _tokens(7)[0]
    theirs = _consumer_logits([streamed], tokens, tmp_path)[str(streamed)]
    torch.testing.assert_close(theirs, _logits(model, tokens), rtol=0.0, atol=1e-5)
