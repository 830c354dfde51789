"""Tokenizer files beside a compressed-tensors or Quark folder are the user's files, copied byte for byte (not
re-serialised by transformers), and read back against their source before the folder is moved into place
(issue 27: a copy that differs from the source would give other token ids, silently)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

from helpers.llm_models import bpe_tokenizer  # noqa: E402
from helpers.streamed_checkpoints import FOLDERS, streamed_checkpoint  # noqa: E402

from quark_brevitas.export import export_safetensors  # noqa: E402
from quark_brevitas.export.hf import folder as hf_folder  # noqa: E402
from quark_brevitas.export.readback import ReadBackError  # noqa: E402
from quark_brevitas.hf.export_streamed import export_safetensors_streamed  # noqa: E402
from quark_brevitas.hf.streaming import load_pretrained_quantized  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint_and_tokenizer(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    bpe_tokenizer(root / "tokenizer")
    return streamed_checkpoint("llama", "gguf_q8_0", root), root / "tokenizer"


@pytest.mark.parametrize("fmt", FOLDERS)
def test_tokenizer_files_are_the_source_files_byte_for_byte(fmt: str, checkpoint_and_tokenizer, tmp_path: Path) -> None:
    checkpoint, tokenizer = checkpoint_and_tokenizer
    written = export_safetensors_streamed(checkpoint, tmp_path / "out", format=fmt, tokenizer=tokenizer)
    sources = sorted(p.name for p in tokenizer.iterdir())
    assert "tokenizer.json" in sources
    for name in sources:
        assert (written / name).read_bytes() == (tokenizer / name).read_bytes(), name


@pytest.mark.parametrize("fmt", FOLDERS)
def test_a_corrupted_tokenizer_copy_is_caught_before_the_folder_is_moved(fmt: str, checkpoint_and_tokenizer,
                                                                         tmp_path: Path, monkeypatch) -> None:
    checkpoint, tokenizer = checkpoint_and_tokenizer
    real_copy = shutil.copyfile

    def copy_then_corrupt(source, target, *args, **kwargs):
        real_copy(source, target, *args, **kwargs)
        if Path(target).name == "tokenizer.json":
            data = bytearray(Path(target).read_bytes())
            data[len(data) // 2] ^= 0x01
            Path(target).write_bytes(bytes(data))
        return target

    monkeypatch.setattr(hf_folder.shutil, "copyfile", copy_then_corrupt)
    with pytest.raises(ReadBackError, match=r"'.*streamed/tokenizer\.json'.*differs from '.*tokenizer\.json', the "
                                            r"file it copies"):
        export_safetensors_streamed(checkpoint, tmp_path / "streamed", format=fmt, tokenizer=tokenizer)
    model = load_pretrained_quantized(checkpoint)
    with pytest.raises(ReadBackError, match=r"'.*whole/tokenizer\.json'.*differs"):
        export_safetensors(model, tmp_path / "whole", format=fmt, tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
