"""Streamed checkpoints prove their integrity: every weight file's SHA-256 in the manifest, checked on load
and on resume; damage is a CheckpointError naming the file; a pickled quantized model says what to use."""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.llm_folders import saved_llama  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig  # noqa: E402
from quark_brevitas.checkpoint import CheckpointError, read_weights  # noqa: E402
from quark_brevitas.errors import NotPicklableError  # noqa: E402
from quark_brevitas.hf.streaming import load_pretrained_quantized, quantize_pretrained  # noqa: E402
from quark_brevitas.outputs import OutputError  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

W4 = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)),
            pre_quant_opt_config=[], algo_config=[])
BLOCK1 = "model-block-00001.safetensors"


def _batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(3))}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("llama"), vocab=32, hidden=16, heads=2, positions=16)


@pytest.fixture(scope="module")
def streamed(llama_dir, tmp_path_factory) -> Path:
    return quantize_pretrained(llama_dir, W4, _batches(), tmp_path_factory.mktemp("streamed") / "out")


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.rglob("*"):
        if file.is_file():
            (target / file.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (target / file.relative_to(source)).write_bytes(file.read_bytes())
    return target


def test_manifest_records_every_weight_file_checksum(streamed: Path) -> None:
    manifest = json.loads((streamed / "manifest.json").read_text())
    weight_files = sorted(p.name for p in streamed.glob("model-*.safetensors"))
    assert sorted(manifest["checksums"]) == weight_files and len(weight_files) == 4
    assert all(len(digest) == 64 for digest in manifest["checksums"].values())


def test_truncated_block_names_the_file(streamed: Path, tmp_path: Path) -> None:
    copy = _copy(streamed, tmp_path / "copy")
    data = (copy / BLOCK1).read_bytes()
    (copy / BLOCK1).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{BLOCK1} has changed since it was written.*write the checkpoint"):
        load_pretrained_quantized(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["checksums"]  # as written before checksums: still a CheckpointError naming the file
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"{BLOCK1} is not a readable safetensors file .*truncated"):
        load_pretrained_quantized(copy)


def test_overwritten_bytes_do_not_load(streamed: Path, tmp_path: Path) -> None:
    copy = _copy(streamed, tmp_path / "copy")
    data = bytearray((copy / BLOCK1).read_bytes())
    data[-4:] = bytes(4)  # a valid file with other values: only the checksum can tell
    (copy / BLOCK1).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{BLOCK1} has changed since it was written"):
        read_weights(copy)
    with pytest.raises(CheckpointError, match=rf"{BLOCK1} has changed since it was written"):
        load_pretrained_quantized(copy)


def test_checkpoint_without_checksums_still_loads(streamed: Path, tmp_path: Path) -> None:
    copy = _copy(streamed, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["checksums"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(load_pretrained_quantized(copy)(ids).logits, load_pretrained_quantized(streamed)(ids).logits)


class _Interrupted(Exception):
    pass


def _interrupt_after(last: int):
    def on_block(index: int, count: int) -> None:
        if index == last:
            raise _Interrupted

    return on_block


def test_resume_redoes_a_damaged_finished_block(llama_dir, streamed: Path, tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    with pytest.raises(_Interrupted):
        quantize_pretrained(llama_dir, W4, _batches(), out, on_block=_interrupt_after(1))
    partial = tmp_path / "out.partial"
    (partial / BLOCK1).write_bytes((partial / BLOCK1).read_bytes()[:100])  # damaged after it was finished
    finished: list[int] = []
    with caplog.at_level(logging.WARNING, logger="quark_brevitas.hf.streaming"):
        quantize_pretrained(llama_dir, W4, _batches(), out, on_block=lambda i, n: finished.append(i))
    assert finished == [0, 1, 2]  # never silently reused: redone (with the blocks before it, whose inputs are gone)
    assert any(BLOCK1 in record.getMessage() and "changed since it was written" in record.getMessage()
               for record in caplog.records)
    a, b = read_weights(streamed), read_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not partial.exists()


def test_resume_refusal_names_the_cli_flag(llama_dir, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(_Interrupted):
        quantize_pretrained(llama_dir, W4, _batches(), out, on_block=_interrupt_after(0))
    other = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=8)),
                   pre_quant_opt_config=[], algo_config=[])
    with pytest.raises(CheckpointError, match=r"pass resume=False \(--no-resume on the command line\)"):
        quantize_pretrained(llama_dir, other, _batches(), out)


def test_streamed_output_is_never_the_model_folder(llama_dir) -> None:
    before = {p.name: p.read_bytes() for p in llama_dir.iterdir() if p.is_file()}
    with pytest.raises(OutputError, match="is the input model folder"):
        quantize_pretrained(llama_dir, W4, _batches(), llama_dir, overwrite=True)
    assert {p.name: p.read_bytes() for p in llama_dir.iterdir() if p.is_file()} == before


def test_streamed_run_into_a_model_folder_keeps_its_files(llama_dir, tmp_path: Path) -> None:
    """Another model's folder as output: refused; with overwrite, our entries replace theirs and the float
    ``model.safetensors`` stays (the index of the streamed checkpoint takes precedence when loading)."""
    other = _copy(llama_dir, tmp_path / "other")
    with pytest.raises(OutputError, match=r"other.*model\.safetensors.*overwrite=True"):
        quantize_pretrained(llama_dir, W4, _batches(), other)
    assert not (tmp_path / "other.partial").exists()
    quantize_pretrained(llama_dir, W4, _batches(), other, overwrite=True)
    assert (other / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()
    assert load_pretrained_quantized(other) is not None


def test_torch_save_of_a_quantized_model_says_what_to_use() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    config = Config(QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()))
    quantized = ModelQuantizer(config).quantize_model(model, [torch.randn(2, 6)])
    with pytest.raises(NotPicklableError, match=r"save_quantized.*load_quantized") as raised:
        torch.save(quantized, io.BytesIO())
    assert isinstance(raised.value, TypeError)
    from brevitas.quant import Int8WeightPerTensorFloat

    assert pickle.loads(pickle.dumps(Int8WeightPerTensorFloat)) is Int8WeightPerTensorFloat  # importable: as before
    torch.save(quantized.state_dict(), io.BytesIO())  # the state dict is plain tensors
