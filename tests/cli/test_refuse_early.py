"""A run that must fail fails first (issue 27): ``--export gguf`` with a config GGUF cannot hold is refused before
any calibration, by the exporter's own checks; the tokenizer a user gives is kept as given (Qwen2's, which
transformers would re-save with a new ``<|endoftext|>`` id), and the GGUF check names the ids that do not fit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")
pytest.importorskip("gguf")

from quark_brevitas.cli import main  # noqa: E402
from quark_brevitas.export import ExportError  # noqa: E402

VOCAB = 512


def _qwen2_tokenizer(folder: Path) -> None:
    """A byte-level BPE of exactly ``VOCAB`` ids without ``<|endoftext|>``, declared a Qwen2 tokenizer: as a user's
    own tokenizer folder holds it (files written by ``tokenizers``, not by transformers)."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 6))) for _ in range(2000)]
    tokenizer.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, len(words), 20)], trainer)
    assert tokenizer.get_vocab_size() == VOCAB
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """One block: the streamed GGUF export's spill files of two blocks collide (issue 27, failure 1, fixed
    separately), which this test is not about."""
    folder = tmp_path_factory.mktemp("qwen2")
    _qwen2_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture
def calib(tmp_path: Path) -> Path:
    rng = random.Random(1)
    path = tmp_path / "calib.txt"
    path.write_text("\n".join(" ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(4)) for _ in range(12))
                              for _ in range(40)) + "\n")
    return path


def _args(model: Path, calib: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", "--model", str(model), "--calib-text", str(calib), "--output", str(out), "--seq-len", "16",
            "--batch-size", "2", "--calib-sequences", "4", "--eval-sequences", "2", *extra]


def test_gguf_export_of_a_config_gguf_cannot_hold_is_refused_before_quantizing(qwen2_dir, calib, tmp_path,
                                                                               capsys, monkeypatch) -> None:
    import quark_brevitas.hf.streaming as streaming

    def never(*args, **kwargs):
        pytest.fail("calibration started for an export that must be refused")

    monkeypatch.setattr(streaming, "evaluate_pretrained", never)
    monkeypatch.setattr(streaming, "quantize_pretrained", never)
    out = tmp_path / "out"
    assert main(_args(qwen2_dir, calib, out, "--export", "gguf")) == 2  # the default: int4 per group of 128
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --export gguf: layer 'model.layers.0.self_attn.q_proj'"), err
    assert "per group of 128, which no GGUF type holds" in err[0] and "before quantizing" in err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]
    w8a8 = tmp_path / "w8a8.json"
    w8a8.write_text(json.dumps({"global_quant_config": {"weight": {"dtype": "int8", "qscheme": "per_group",
                                                                  "group_size": 32, "scale_type": "float16"},
                                                       "input_tensors": {"dtype": "int8"}},
                                "exclude": ["lm_head"]}))
    assert main(_args(qwen2_dir, calib, out, "--config", str(w8a8), "--export", "gguf")) == 2
    assert "quantizes its input_tensors; GGUF holds weight-only models" in capsys.readouterr().err


@pytest.mark.slow
def test_the_users_qwen2_tokenizer_is_kept_as_given_and_gguf_export_takes_it(qwen2_dir, calib, tmp_path,
                                                                              capsys) -> None:
    out = tmp_path / "out"
    assert main(_args(qwen2_dir, calib, out, "--preset", "gguf_q8_0", "--export", "gguf")) == 0, \
        capsys.readouterr().err
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "float_model" / name).read_bytes() == (qwen2_dir / name).read_bytes()
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(str(out / "gguf" / "model.gguf")).fields
    assert len(fields["tokenizer.ggml.tokens"].data) == VOCAB


def test_gguf_tokenizer_check_names_the_ids_that_do_not_fit_and_where_they_came_from(qwen2_dir, tmp_path) -> None:
    from quark_brevitas.export.gguf.writer import check_tokenizer_fits

    assert check_tokenizer_fits(qwen2_dir, VOCAB) == VOCAB
    resaved = tmp_path / "resaved"
    transformers.AutoTokenizer.from_pretrained(qwen2_dir).save_pretrained(resaved)  # what the old code saved
    with pytest.raises(ExportError) as caught:
        check_tokenizer_fits(resaved, VOCAB)
    message = str(caught.value)
    assert f"1 token id(s) that the model's embedding ({VOCAB} rows" in message
    assert f"{VOCAB} '<|endoftext|>' (added_tokens)" in message and "save_pretrained" in message


#: A config each format cannot hold, and what its refusal says (each format's own per-layer check, run on a
#: stand-in layer of the plan before calibration).
UNFIT = {
    "onnx": ({"weight": {"dtype": "int4", "qscheme": "per_group", "group_size": 32},
              "input_tensors": {"dtype": "fp4"}}, "cannot be exported to ONNX QCDQ"),
    "compressed-tensors": ({"weight": {"dtype": "fp8_e5m2"}}, "fp8_e5m2 weights (only fp8 e4m3 OCP"),
    "quark": ({"weight": {"dtype": "int8"}, "output_tensors": {"dtype": "int8"}}, "output quantizers are not written"),
}


@pytest.mark.parametrize("fmt", list(UNFIT))
def test_every_export_format_refuses_a_config_it_cannot_hold_before_quantizing(fmt: str, qwen2_dir, calib, tmp_path,
                                                                               capsys, monkeypatch) -> None:
    """Not only GGUF (issue 27): each format's row of the format table names its check, and the command line runs
    it before calibration; a patched calibration that fails the test if called proves the order."""
    import quark_brevitas.hf.streaming as streaming

    def never(*args, **kwargs):
        pytest.fail("calibration started for an export that must be refused")

    monkeypatch.setattr(streaming, "evaluate_pretrained", never)
    monkeypatch.setattr(streaming, "quantize_pretrained", never)
    layer, says = UNFIT[fmt]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"global_quant_config": layer, "exclude": ["lm_head"], "pre_quant_opt_config": []}))
    out = tmp_path / "out"
    assert main(_args(qwen2_dir, calib, out, "--config", str(config), "--export", fmt)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --export {fmt}: "), err
    assert "'model.layers.0.self_attn.q_proj'" in err[0] and says in err[0], err[0]
    assert "refused before quantizing; nothing was written" in err[0]
    assert not out.exists()


def test_the_format_table_names_a_check_for_every_format_quantize_can_write() -> None:
    from quark_brevitas.export.registry import FORMATS, format_names

    assert all(FORMATS[name].plan_check is not None for name in format_names(hf_lm=True))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "quark", "gguf"])
def test_a_config_the_format_holds_passes_its_check(fmt: str, qwen2_dir) -> None:
    """The stand-ins keep each layer's output count's divisibility: Quark packs int4 codes eight to an int32 along
    the output channels, which a two-row stand-in refused although the real layers (64, 128 rows) fit."""
    from quark_brevitas import ModelQuantizer
    from quark_brevitas.config.presets import get_preset
    from quark_brevitas.export.registry import get_format
    from quark_brevitas.hf.streaming import load_skeleton

    skeleton, hf_config = load_skeleton(qwen2_dir)
    config = get_preset("gguf_q4_0")  # int4 symmetric per group of 32, float16 scales
    get_format(fmt).check_plan(ModelQuantizer(config).plan(skeleton), skeleton, hf_config, qwen2_dir)
