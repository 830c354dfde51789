"""GGUF files of mixture-of-experts decoders (issue 30): llama.cpp's stacked expert tensors (``ffn_*_exps``), the
router, Qwen2-MoE's shared expert and the expert metadata, from the unfused experts' own integer codes. The
``gguf`` package dequantizes every expert of a stack to that expert's quantized weight; llama.cpp (where
llama-cpp-python is installed) computes the quantized model's logits; transformers' GGUF loader reloads the Qwen
MoEs (it has no Mixtral: it reads a ``llama`` file as a dense Llama and leaves the experts out)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers.families import MOE_FAMILIES, build_moe  # noqa: E402
from helpers.llm_models import bpe_tokenizer, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import ExportError, export_gguf  # noqa: E402
from quark_brevitas.hf.plan_checks import check_gguf_plan  # noqa: E402
from quark_brevitas.model_parts.moe import unfuse_experts  # noqa: E402

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
#: llama.cpp's graph renormalises the top-k weights for qwen3moe (transformers' Qwen3MoeConfig default is False).
_LLAMA_CPP_ROUTING = {"qwen3_moe": {"norm_topk_prob": True}}


def _quantize(family: str, preset: str = "gguf_q4_0", **overrides: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(float unfused model, its quantized copy) with the preset; head and Qwen2-MoE's shared-expert gate float."""
    model = build_moe(family, **(_LLAMA_CPP_ROUTING.get(family, {}) | overrides))
    unfuse_experts(model)
    config = get_preset(preset)
    config.exclude = ["lm_head", "*shared_expert_gate"] if family == "qwen2_moe" else ["lm_head"]
    return model, ModelQuantizer(config).quantize_model(model, inplace=False)


def _read(path: Path) -> tuple[dict[str, object], dict[str, object]]:
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    return fields, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize(("family", "preset", "types"), [("mixtral", "gguf_q4_0", ("Q4_0", "Q4_0")),
                                                         ("qwen2_moe", "gguf_q8_0", ("Q8_0", "Q8_0")),
                                                         ("qwen3_moe", "gguf_q6_k", ("Q8_0", "Q6_K"))])
def test_experts_are_stacked_and_dequantize_to_each_experts_weight(family: str, preset: str,
                                                                    types: tuple[str, str], tmp_path: Path) -> None:
    """Each block's experts as llama.cpp's three 3-D tensors of one type, expert ``e`` at index ``e``, each slice
    dequantizing (gguf's own code) exactly to that expert's quantized weight; the router (and Qwen2-MoE's shared
    expert gate, squeezed to a vector) in F32; the expert metadata as llama.cpp's converter writes it. ``types``:
    of gate/up and of down. (Qwen3-MoE: experts 256 wide, so down_proj's rows are whole Q6_K super-blocks, while
    gate/up_proj's 64 input channels take K-quants' 32-channel fallback type, Q8_0.)"""
    width = 256 if family == "qwen3_moe" else 32
    _, quant = _quantize(family, preset, **({} if family == "mixtral" else {"moe_intermediate_size": width}))
    path = export_gguf(quant, tmp_path / "out")
    fields, tensors = _read(path)
    arch, config = ARCH[family], quant.config
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    if family != "mixtral":
        assert fields[f"{arch}.expert_feed_forward_length"] == width
    if family == "qwen2_moe":
        assert fields["qwen2moe.expert_shared_feed_forward_length"] == 64
    width = config.intermediate_size if family == "mixtral" else width
    for index, block in enumerate(quant.model.layers):
        for proj, shape, qtype in (("gate", (4, width, 64), types[0]), ("up", (4, width, 64), types[0]),
                                   ("down", (4, 64, width), types[1])):
            stored = tensors[f"blk.{index}.ffn_{proj}_exps.weight"]
            assert stored.tensor_type.name == qtype and tuple(int(d) for d in reversed(stored.shape)) == shape
            decoded = gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type)
            for expert_index, expert in enumerate(block.mlp.experts):
                ours = getattr(expert, f"{proj}_proj").quant_weight().value.detach().numpy()
                assert np.array_equal(decoded[expert_index], ours), (index, proj, expert_index)
        router = tensors[f"blk.{index}.ffn_gate_inp.weight"]
        assert router.tensor_type.name == "F32"
        assert np.array_equal(np.asarray(router.data), block.mlp.gate.weight.detach().numpy())
        if family == "qwen2_moe":
            gate = tensors[f"blk.{index}.ffn_gate_inp_shexp.weight"]
            assert np.asarray(gate.data).shape == (64,)
            assert np.array_equal(np.asarray(gate.data), block.mlp.shared_expert_gate.weight.detach().numpy()[0])
            shared = tensors[f"blk.{index}.ffn_down_shexp.weight"]
            decoded = gguf.quants.dequantize(np.asarray(shared.data), shared.tensor_type)
            assert np.array_equal(decoded, block.mlp.shared_expert.down_proj.quant_weight().value.detach().numpy())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_transformers_loads_the_qwen_moes_with_the_quantized_models_logits(family: str, tmp_path: Path) -> None:
    """transformers' GGUF loader rebuilds the fused experts from the stacks with our logits. It reads no expert
    width (moe_intermediate_size, Qwen2-MoE's shared_expert_intermediate_size) from the file and takes the config
    defaults, so the models here have them (Qwen2-MoE 1408 / 5632, Qwen3-MoE 768)."""
    sizes = {"qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
             "qwen3_moe": dict(moe_intermediate_size=768)}[family]
    _, quant = _quantize(family, **sizes)
    bpe_tokenizer(tmp_path / "tok", pad=True)
    export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    assert loaded.config.model_type == family
    assert type(loaded.model.layers[0].mlp.experts).__name__.endswith("Experts")
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        theirs, ours = loaded(tokens).logits, quant(tokens).logits
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=0), float((theirs - ours).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llama_cpp_computes_the_quantized_moe(family: str, tmp_path: Path) -> None:
    """llama.cpp (llama-cpp-python, optional) routes and computes the stacked experts with the quantized model's
    logits (the dense families' tolerance: its 8-bit activations in quantized products), and is much closer to them
    than to the float model's."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the extra [llamacpp])")
    model, quant = _quantize(family)
    bpe_tokenizer(tmp_path / "tok", pad=True)
    path = export_gguf(quant, tmp_path / "out", tokenizer_path=tmp_path / "tok")
    tokens = token_batches(1, batch=1, length=64, seed=3)[0][0]
    runner = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    runner.eval(tokens.tolist())
    theirs = torch.tensor(np.asarray(runner.scores[:len(tokens)]), dtype=torch.float32)
    with torch.no_grad():
        ours, floats = quant(tokens[None]).logits[0], model(tokens[None]).logits[0]
    error = float((theirs - ours).norm() / ours.norm())
    assert error < 0.05, (family, error)
    assert error < 0.3 * float((theirs - floats).norm() / floats.norm()), family


@pytest.mark.parametrize(("family", "overrides", "match"), [
    ("qwen2_moe", {"norm_topk_prob": True}, "norm_topk_prob=True.*does not renormalise"),
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=False.*renormalises"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "dense MLP blocks"),
])
def test_routing_llama_cpp_does_not_compute_is_refused_before_calibration(family: str, overrides: dict,
                                                                           match: str, tmp_path: Path) -> None:
    """llama.cpp's graphs fix the routing per architecture: a config asking for another is refused by the plan
    check (before calibration) and by the writer, which writes nothing."""
    model = build_moe(family, **overrides)
    unfuse_experts(model)
    config = get_preset("gguf_q4_0")
    config.exclude = ["lm_head", "*shared_expert_gate"] if family == "qwen2_moe" else ["lm_head"]
    with pytest.raises(ExportError, match=match):
        check_gguf_plan(ModelQuantizer(config).plan(model), model, model.config, None)
    with pytest.raises(ExportError, match=match):
        export_gguf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_experts_of_one_projection_quantized_to_two_types_are_refused(tmp_path: Path) -> None:
    """One stacked tensor has one GGUF type: expert 1's down_proj in Q8_0 among Q4_0 experts is named."""
    model = build_moe("mixtral")
    unfuse_experts(model)
    config = get_preset("gguf_q4_0")
    config.exclude = ["lm_head"]
    config.layer_quant_config = {"*experts.1.down_proj": get_preset("gguf_q8_0").layer_type_quant_config["Linear"]}
    quant = ModelQuantizer(config).quantize_model(model)
    with pytest.raises(ExportError, match=r"experts of 'model.layers.0.mlp.experts.down_proj'.*"
                                          r"model.layers.0.mlp.experts.1.down_proj: Q8_0"):
        export_gguf(quant, tmp_path / "out")


def test_a_quantized_router_is_refused(tmp_path: Path) -> None:
    """The gguf_* presets quantize every Linear layer, Qwen2-MoE's shared-expert gate too; llama.cpp's router
    tensors are float, so the layer is named with the exclude that keeps it float, by the plan check before
    calibration and by the writer."""
    model = build_moe("qwen2_moe")
    unfuse_experts(model)
    config = get_preset("gguf_q8_0")
    config.exclude = ["lm_head"]
    refusal = r"model.layers.0.mlp.shared_expert_gate' is quantized.*ffn_gate_inp_shexp"
    with pytest.raises(ExportError, match=refusal):  # before calibration, as quantize --export gguf checks it
        check_gguf_plan(ModelQuantizer(config).plan(model), model, model.config, None)
    quant = ModelQuantizer(config).quantize_model(model)
    with pytest.raises(ExportError, match=refusal):
        export_gguf(quant, tmp_path / "out")


def test_fused_float_experts_are_written_as_float_stacks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model whose experts were not unfused (transformers' fused 3-D parameters, float): its F16 file holds the
    stacks in F16 (gate_up_proj split into gate and up) with a warning that they are not quantized, and
    transformers reloads it with the float model's logits (up to F16)."""
    model = build_moe("qwen3_moe", norm_topk_prob=True, moe_intermediate_size=768)
    with caplog.at_level("WARNING", logger="quark_brevitas.export.gguf.experts"):
        path = export_gguf(model, tmp_path / "out", float_type="F16")
    assert any("fused experts parameter, written in float" in r.getMessage() for r in caplog.records)
    _, tensors = _read(path)
    fused = model.model.layers[0].mlp.experts
    gate = np.asarray(tensors["blk.0.ffn_gate_exps.weight"].data)
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "F16" and gate.shape == (4, 768, 64)
    assert np.array_equal(gate, fused.gate_up_proj.detach()[:, :768].numpy().astype(np.float16))
    up = np.asarray(tensors["blk.0.ffn_up_exps.weight"].data)
    assert np.array_equal(up, fused.gate_up_proj.detach()[:, 768:].numpy().astype(np.float16))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    tokens = token_batches(1, seed=3)[0]
    with torch.no_grad():
        theirs, ours = loaded(tokens).logits, model(tokens).logits
    assert float((theirs - ours).norm() / ours.norm()) < 1e-2
