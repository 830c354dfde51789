"""Quark 0.13's own config files load as quark_brevitas Configs (``Config.from_dict`` / ``--config``).

``tests/data/quark013/*.json`` are Quark's output, generated with amd-quark 0.13 by ``generate.py`` there:
``LLMTemplate.get("llama").get_config(...).to_dict()`` per scheme, and the ``config.json`` Quark's
``export_safetensors`` writes (its ``quantization_config`` with the ``export`` section). Quark's fields that only
choose its machinery are accepted where quark_brevitas does the same and otherwise refused with one ConfigError
naming the field; a file that loads quantizes a model exactly as our ``LLMTemplate`` recipe of the same scheme does.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.llm_models import logits, tiny_llama, token_batches  # noqa: E402

from quark_brevitas import LLMTemplate, ModelQuantizer  # noqa: E402
from quark_brevitas.config import AWQConfig, Config, GPTQConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.config.formats import MIN_MAX_OBSERVERS  # noqa: E402
from quark_brevitas.errors import ConfigError  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "quark013"


def _quark(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _exported() -> dict:
    return _quark("exported_config")["quantization_config"]


def _same_recipe(spec: QuantizationSpec | None, activation: bool = False) -> QuantizationSpec | None:
    """A spec as it quantizes: short forms spelled out, Quark's observer name dropped (its meaning is in the fields;
    a min-max observer of static activations calibrates on the maximum, which our template writes percentile=100)."""
    if spec is None:
        return None
    if activation and spec.observer_cls in MIN_MAX_OBSERVERS and spec.percentile is None and not spec.is_dynamic \
            and spec.qscheme is QSchemeType.per_tensor:
        spec = replace(spec, percentile=100.0)
    return replace(spec.resolved(), observer_cls=None, dtype=None, mx_element_dtype=None)


# ---------------------------------------------------------------- files that load
@pytest.mark.parametrize("scheme", ["int4_wo_128", "int8", "fp8", "ptpc_fp8", "int4_wa_64"])
def test_quarks_scheme_files_give_our_templates_specs(scheme: str) -> None:
    loaded = Config.from_dict(_quark(scheme))
    ours = LLMTemplate.get("llama").get_config(scheme=scheme)
    for role in ("weight", "input_tensors", "output_tensors", "bias"):
        activation = role.endswith("_tensors")
        assert _same_recipe(getattr(loaded.global_quant_config, role), activation) == \
            _same_recipe(getattr(ours.global_quant_config, role), activation), (scheme, role)
    assert loaded.exclude == ["lm_head"] and loaded.pre_quant_opt_config == [] and loaded.algo_config == []


def test_quarks_algorithm_files_keep_their_algorithms() -> None:
    awq = Config.from_dict(_quark("uint4_wo_128_awq"))
    gptq = Config.from_dict(_quark("int4_wo_64_gptq"))
    assert [type(a) for a in awq.algo_config] == [AWQConfig] and awq.algo_config[0].model_decoder_layers == \
        "model.layers"
    assert [type(a) for a in gptq.algo_config] == [GPTQConfig]
    assert (gptq.algo_config[0].block_size, gptq.algo_config[0].damp_percent) == (128, 0.01)


def _mx_floor(data: dict) -> dict:
    for role in ("weight", "input_tensors"):
        if data["global_quant_config"][role] is not None:
            data["global_quant_config"][role]["scale_calculation_mode"] = "floor"
    return data


@pytest.mark.parametrize("source", ["exported_config", "int8", "fp8", "ptpc_fp8", "int4_wa_64", "mxfp4"])
def test_a_quark_file_quantizes_as_our_template_does(source: str) -> None:
    """Bit for bit: the file Quark wrote and our template's recipe of the same scheme give the same model (MX: with
    the file asking for the OCP rule, ``scale_calculation_mode: "floor"``, which is what the template executes)."""
    data, scheme = (_exported(), "int4_wo_32") if source == "exported_config" else (_quark(source), source)
    if source == "mxfp4":
        data = _mx_floor(data)
    batches = token_batches(2)
    from_file = ModelQuantizer(Config.from_dict(data)).quantize_model(tiny_llama(), batches)
    from_template = ModelQuantizer(LLMTemplate.get("llama").get_config(scheme=scheme)).quantize_model(
        tiny_llama(), batches)
    tokens = token_batches(1, batch=2, length=12, seed=3)[0]
    assert torch.equal(logits(from_file, tokens), logits(from_template, tokens))
    assert float((logits(from_file, tokens) - logits(tiny_llama(), tokens)).abs().max()) > 1e-3


def test_the_whole_config_json_of_a_quark_folder_is_read_for_its_quantization_config() -> None:
    whole = Config.from_file(DATA / "exported_config.json")
    assert whole == Config.from_dict(_exported())


def test_mx_scales_load_when_the_file_asks_for_the_ocp_rule() -> None:
    config = Config.from_dict(_mx_floor(_quark("mxfp4")))
    assert _same_recipe(config.global_quant_config.weight) == _same_recipe(
        LLMTemplate.get("llama").get_config(scheme="mxfp4").global_quant_config.weight)


# ---------------------------------------------------------------- what cannot be honoured: one ConfigError naming it
@pytest.mark.parametrize(("source", "named"), [
    ("mxfp4", r"global_quant_config\.input_tensors\.scale_calculation_mode: 'even' is not supported: Quark rounds "
              r"the shared exponent .* allowed: 'floor'"),
    ("nvfp4", r"global_quant_config\.input_tensors: a list of specs \(Quark's two-stage quantization"),
    ("int4_fp8", r"global_quant_config\.weight: a list of specs"),
    ("amdfp4", r"global_quant_config\.input_tensors\.scale_format: 'e5m3' is not supported"),
])
def test_quark_schemes_without_a_brevitas_quantizer_are_refused_naming_the_field(source: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config.from_dict(_quark(source))


@pytest.mark.parametrize(("field", "value", "named"), [
    ("block_size", [1, 32], r"global_quant_config\.weight\.block_size: a list is not supported: 2-D block scales"),
    ("is_scale_quant", True, r"global_quant_config\.weight\.is_scale_quant: True is not supported: quantizing the "
                             r"scales"),
    ("scale_format", "e4m3", r"global_quant_config\.weight\.scale_format: 'e4m3' is not supported"),
    ("scale_format", "e8m0", r"global_quant_config\.weight\.scale_format: 'e8m0' .* needs an MX spec"),
    ("scale_calculation_mode", "even", r"global_quant_config\.weight\.scale_calculation_mode: 'even': only used with "
                                       r"scale_format 'e8m0'"),
    ("max_input_numel", 0, r"global_quant_config\.weight\.max_input_numel: 0 is the size bound"),
    ("symmetric", None, r"global_quant_config\.weight\.symmetric: null: an integer format must say"),
])
def test_quarks_spec_fields_are_refused_where_they_ask_for_something_else(field: str, value: object,
                                                                          named: str) -> None:
    data = _exported()
    data["global_quant_config"]["weight"][field] = value
    with pytest.raises(ConfigError, match=named):
        Config.from_dict(data)


def test_quarks_spec_fields_are_checked_at_every_level() -> None:
    data = _exported()
    layer = copy.deepcopy(data["global_quant_config"])
    layer["weight"]["block_size"] = [4, 4]
    data["layer_quant_config"] = {"model.layers.0.mlp.*": layer}
    with pytest.raises(ConfigError, match=r'layer_quant_config\["model\.layers\.0\.mlp\.\*"\]\.weight\.block_size'):
        Config.from_dict(data)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("weight_merge_groups", [["q_proj", "k_proj"]], r"export\.weight_merge_groups: a list is not supported: weight "
                                                    r"scales shared"),
    ("kv_cache_group", "k_proj", r"export\.kv_cache_group: 'k_proj' is the file's copy of the config's "
                                 r"kv_cache_group .* allowed: a list or null"),
    ("weight_format", "packed", r"export\.weight_format: 'packed' is how the file's weights were stored .* allowed: "
                                r"'real_quantized' or 'fake_quantized'"),
    ("packing", "reorder", r"export\.packing: unknown key"),
])
def test_the_export_section_is_checked(field: str, value: object, named: str) -> None:
    data = _exported()
    data["export"][field] = value
    with pytest.raises(ConfigError, match=named):
        Config.from_dict(data)


def test_quarks_machinery_fields_at_their_values_are_accepted() -> None:
    """enable_buffer_reuse / max_input_numel choose how Quark's MX observer uses memory (same scales), and the
    export section's storage fields describe the file: any value Quark writes loads."""
    data = _exported()
    data["global_quant_config"]["weight"].update(enable_buffer_reuse=True, max_input_numel=1024)
    data["export"].update(weight_format="fake_quantized", pack_method="order")
    assert Config.from_dict(data) == Config.from_dict(_exported())


# ---------------------------------------------------------------- the command line: --config FILE
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama folder with a word-level tokenizer (64 wide: groups of 32 fit its layers)."""
    tokenizers = pytest.importorskip("tokenizers")
    import transformers

    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "cats",
             "sleep", "near", "warm", "red", "house"]
    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", *words])}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64, pad_token_id=0)
    folder = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=generator).tolist())
             for _ in range(40)]
    (folder.parent / "calib.txt").write_text("\n".join(lines) + "\n")
    return folder


def _quantize(folder: Path, config: Path, output: Path) -> None:
    from quark_brevitas.cli import main

    assert main(["quantize", "--model", str(folder), "--calib-text", str(folder.parent / "calib.txt"), "--config",
                 str(config), "--output", str(output), "--export", "quark", "--seq-len", "16", "--batch-size", "2",
                 "--calib-sequences", "4", "--eval-sequences", "2"]) == 0


@pytest.mark.slow
def test_quantize_takes_quarks_config_and_our_quark_export_round_trips_as_config(llama_folder: Path,
                                                                                tmp_path: Path) -> None:
    """``quantize --config`` with the config.json Quark's export wrote; then the ``quantization_config`` our own
    ``--export quark`` wrote is a ``--config`` again, describing the same recipe."""
    first = tmp_path / "first"
    _quantize(llama_folder, DATA / "exported_config.json", first)
    written = next(p for p in first.rglob("config.json") if "quantization_config" in p.read_text())
    ours = json.loads(written.read_text())["quantization_config"]
    assert ours["quant_method"] == "quark" and "export" in ours
    assert Config.from_dict(ours).global_quant_config == Config.from_dict(_exported()).global_quant_config
    again = tmp_path / "again"
    _quantize(llama_folder, written, again)
    rewritten = next(p for p in again.rglob("config.json") if "quantization_config" in p.read_text())
    assert json.loads(rewritten.read_text())["quantization_config"] == ours
