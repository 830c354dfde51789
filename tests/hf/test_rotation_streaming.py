"""RotationConfig on a model streamed from its folder (``quantize_pretrained``): the embedding, final norm and head
are rotated once, each block as the engine loads it; the checkpoint, its loaders, a resumed run and streamed
evaluation all give the model that in-memory quantization of the loaded model gives, bit for bit.

The reference is independent of the streaming path: ``ModelQuantizer.quantize_model`` on the float model loaded by
transformers (the whole model rotated at once).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from quark_brevitas.algorithms import apply_algorithm  # noqa: E402
from quark_brevitas.algorithms.rotation_sites import rotation_sites  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.brevitas_adapter import RotatedInput  # noqa: E402
from quark_brevitas.checkpoint import load_quantized, read_weights  # noqa: E402
from quark_brevitas.config import (  # noqa: E402
    Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationSpec,
    RotationConfig,
)
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.hf.streaming import (  # noqa: E402
    evaluate_pretrained,
    load_pretrained_quantized,
    load_skeleton,
    quantize_pretrained,
)
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

W4 = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)
A8_TOKEN = QuantizationSpec(is_dynamic=True, qscheme=QSchemeType.per_channel)
#: Folded R1 and R2, online R4, then GPTQ on each rotated block (the rotation runs before the block's algorithms).
FOLDED = Config(QuantizationConfig(weight=W4, input_tensors=A8_TOKEN), pre_quant_opt_config=[],
                algo_config=[RotationConfig(r1=True, r2=True, r4=True, random_r1=True), GPTQConfig()])
#: Online R1 and R4 only: wrappers in every block, nothing folded outside the blocks.
ONLINE = Config(QuantizationConfig(weight=W4, input_tensors=A8_TOKEN), pre_quant_opt_config=[],
                algo_config=[RotationConfig(r1=True, online_r1_rotation=True, r4=True)])


def _batches(count: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 64, (2, 16), generator=generator)} for _ in range(count)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A 3-block Llama with grouped KV heads and a head tied to the embedding (R1 must untie it)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # outlier channels in the norms, as trained models have (R1 merges them into the layers)
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                module.weight[:4] *= 8
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder


def _float(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def in_memory(llama_dir) -> torch.nn.Module:
    return ModelQuantizer(FOLDED).quantize_model(_float(llama_dir), _batches())


def _assert_same_weights(stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert stored.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(stored[k], expected[k])]
    assert not different, different


def test_a_skeleton_whose_blocks_are_not_loaded_has_the_same_rotation_sites(llama_dir) -> None:
    skeleton, _ = load_skeleton(llama_dir)  # every parameter on the meta device
    assert all(p.is_meta for p in skeleton.parameters())
    sites = rotation_sites(RotationConfig(r1=True, r2=True), skeleton)
    loaded = rotation_sites(RotationConfig(r1=True, r2=True), _float(llama_dir))
    assert sites.skipped == {} and sites.block_norms == loaded.block_norms and sites.final == loaded.final
    assert [g.norm for g in sites.block_norms] == ["input_layernorm", "post_attention_layernorm"]
    with pytest.raises(ConfigError, match=r"not loaded \(model\.embed_tokens\.weight is on the meta device\).*"
                                          "quantize_pretrained, which rotates each block as it loads"):
        apply_algorithm(RotationConfig(), skeleton)


@pytest.mark.slow
def test_streamed_rotation_equals_the_in_memory_rotated_model(llama_dir, in_memory, tmp_path) -> None:
    out = quantize_pretrained(llama_dir, FOLDED, _batches(), tmp_path / "out")
    _assert_same_weights(read_weights(out), in_memory.state_dict())  # weights, scales, the rotated norms
    ids = _batches(1)[0]["input_ids"]
    reference = _logits(in_memory, ids)
    loaded = load_pretrained_quantized(out)  # from the checkpoint alone
    assert isinstance(loaded.model.layers[2].mlp.down_proj, RotatedInput)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded, ids), reference)
    assert torch.equal(_logits(load_quantized(_float(llama_dir), out), ids), reference)  # with the float model
    streamed: list[torch.Tensor] = []
    evaluate_pretrained(out, [{"input_ids": ids}], lambda _, output: streamed.append(output.logits))
    assert torch.equal(streamed[0], reference)
    stored = read_weights(out)  # R1 merged every norm into its readers (set to 1): the rotation ran
    assert all(torch.equal(stored[f"model.layers.{i}.{n}.weight"], torch.ones(32)) for i in range(3)
               for n in ("input_layernorm", "post_attention_layernorm"))


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_a_resumed_rotated_stream_gives_the_same_model(llama_dir, in_memory, tmp_path) -> None:
    def stop_after_first(index: int, count: int) -> None:
        if index == 0:
            raise _Interrupted

    with pytest.raises(_Interrupted):
        quantize_pretrained(llama_dir, FOLDED, _batches(), tmp_path / "out", on_block=stop_after_first)
    finished: list[int] = []
    out = quantize_pretrained(llama_dir, FOLDED, _batches(), tmp_path / "out",
                              on_block=lambda index, count: finished.append(index))
    assert finished == [1, 2]  # block 0 was not rotated and quantized again
    _assert_same_weights(read_weights(out), in_memory.state_dict())
    ids = _batches(1)[0]["input_ids"]
    assert torch.equal(_logits(load_pretrained_quantized(out), ids), _logits(in_memory, ids))


@pytest.mark.slow
def test_online_rotations_stream_like_in_memory(llama_dir, tmp_path) -> None:
    out = quantize_pretrained(llama_dir, ONLINE, _batches(1), tmp_path / "out")
    expected = ModelQuantizer(ONLINE).quantize_model(_float(llama_dir), _batches(1))
    _assert_same_weights(read_weights(out), expected.state_dict())
    loaded = load_pretrained_quantized(out)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, RotatedInput)
    ids = _batches(1)[0]["input_ids"]
    assert torch.equal(_logits(loaded, ids), _logits(expected, ids))


# ===================================================================== deployment formats from a streamed checkpoint
@pytest.mark.slow
def test_a_streamed_rotated_checkpoint_exports_to_gguf_and_online_rotations_are_refused(llama_dir, tmp_path) -> None:
    import dataclasses

    pytest.importorskip("gguf")
    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.export import ExportError
    from quark_brevitas.hf.export_streamed import export_gguf_streamed, export_safetensors_streamed

    preset = get_preset("gguf_q4_0")
    folded = dataclasses.replace(preset, algo_config=[RotationConfig(r1=True, r2=True)])
    checkpoint = quantize_pretrained(llama_dir, folded, _batches(1), tmp_path / "folded")
    path = export_gguf_streamed(checkpoint, tmp_path / "gguf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ids = _batches(1)[0]["input_ids"]
    assert torch.allclose(_logits(loaded, ids), _logits(load_pretrained_quantized(checkpoint), ids), atol=1e-5, rtol=0)
    online = dataclasses.replace(preset, algo_config=[RotationConfig(r4=True)])
    checkpoint = quantize_pretrained(llama_dir, online, _batches(1), tmp_path / "online")
    with pytest.raises(ExportError, match=r"GGUF cannot hold online Hadamard rotations .*model\.layers\.0\.mlp"):
        export_gguf_streamed(checkpoint, tmp_path / "online-gguf")
    with pytest.raises(ExportError, match=r"compressed-tensors cannot hold online .*model\.layers\.0\.mlp\.down_proj"):
        export_safetensors_streamed(checkpoint, tmp_path / "online-ct")
    assert not (tmp_path / "online-ct").exists()
