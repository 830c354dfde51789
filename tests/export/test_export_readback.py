"""What an export writes is proven on disk: streamed exports equal the in-memory export byte for byte, spill files
cannot collide, and a file changed after its proof is caught by the read-back before anything is moved into place.

Issue 27, item 1. The regression: a streamed GGUF export numbered the spill files of one block from
``len(tensors)`` while ``list.extend`` was still appending, so block 1 of Qwen2 (12 tensors a block) and GPT-2
overwrote files block 0 still memory-mapped (``OSError: 34816 requested and 3968 written``, or, where the sizes
coincided, another layer's weights in the file). Llama (9 tensors a block) escaped by parity.

Byte for byte: a GGUF file is one file in both exports and is compared whole. A streamed safetensors folder holds one
shard per block, one for the rest and an index, where the in-memory export writes one ``model.safetensors``; each
shard is compared with the safetensors file that serialises the in-memory export's tensors of the same names (the
serialisation is deterministic), and ``config.json`` is compared whole (nothing normalised).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from helpers.streamed_checkpoints import FOLDERS  # noqa: E402
from helpers.streamed_checkpoints import SIZES as _SIZES  # noqa: E402
from helpers.streamed_checkpoints import streamed_checkpoint as _checkpoint  # noqa: E402
from safetensors.torch import load_file, save  # noqa: E402

from quark_brevitas import Config, QLayerConfig  # noqa: E402
from quark_brevitas.export import export_gguf, export_safetensors, readback  # noqa: E402
from quark_brevitas.export.gguf import writer as gguf_export  # noqa: E402
from quark_brevitas.export.readback import ReadBackError  # noqa: E402
from quark_brevitas.hf import export_streamed  # noqa: E402
from quark_brevitas.hf.export_streamed import export_gguf_streamed, export_safetensors_streamed  # noqa: E402
from quark_brevitas.hf.streaming import load_pretrained_quantized  # noqa: E402

#: Tensors per block in the GGUF file: Llama/Mistral 9, Qwen2 12 (q/k/v biases), GPT-2 12 (biases, two norms).
BLOCK_TENSORS = {"llama": 9, "mistral": 9, "qwen2": 12, "qwen2-narrow": 12, "gpt2": 12}


def _same_folder(streamed: Path, whole: Path) -> None:
    """Each shard is the in-memory export's tensors of the same names, serialised: the same bytes."""
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    expected = load_file(str(whole / "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and not (streamed / "model.safetensors").exists()  # two blocks and the rest
    for shard in shards:
        names = [name for name, file in index["weight_map"].items() if file == shard]
        assert (streamed / shard).read_bytes() == save({n: expected[n] for n in names}, metadata={"format": "pt"})
    assert (streamed / "config.json").read_bytes() == (whole / "config.json").read_bytes()


def _check_family(family: str, preset: str, root: Path) -> None:
    """Every streamed format of one checkpoint equals the in-memory export of the same model, byte for byte."""
    checkpoint = _checkpoint(family, preset, root)
    model = load_pretrained_quantized(checkpoint)
    streamed = export_gguf_streamed(checkpoint, root / "gguf-streamed")
    whole = export_gguf(model, root / "gguf-whole")
    assert streamed.read_bytes() == whole.read_bytes()
    tensors = gguf.GGUFReader(str(streamed)).tensors
    assert len(tensors) == 2 * BLOCK_TENSORS[family] + (5 if family == "gpt2" else 3)  # wte, wpe, ln_f x2, output
    qtype = {"gguf_q8_0": "Q8_0", "gguf_q4_0": "Q4_0", "gguf_q4_1": "Q4_1"}[preset]
    assert sum(t.tensor_type.name == qtype for t in tensors) == (2 * 4 + 1 if family == "gpt2" else 2 * 7 + 1)
    assert not list(root.glob(".gguf-streamed.blocks-*"))  # the spill folder is gone
    for fmt in FOLDERS:
        folder = export_safetensors_streamed(checkpoint, root / f"{fmt}-streamed", format=fmt)
        _same_folder(folder, export_safetensors(model, root / f"{fmt}-whole", format=fmt))


# ===================================================================== the regression
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_streamed_gguf_of_qwen2_and_gpt2_is_the_in_memory_file(family: str, tmp_path: Path) -> None:
    """Failed on the old code: OSError from the spill file block 1 rewrote under block 0's memory map."""
    checkpoint = _checkpoint(family, "gguf_q8_0", tmp_path)
    streamed = export_gguf_streamed(checkpoint, tmp_path / "streamed")
    whole = export_gguf(load_pretrained_quantized(checkpoint), tmp_path / "whole")
    assert streamed.read_bytes() == whole.read_bytes()


def test_streamed_gguf_holds_the_proven_weights_where_spill_sizes_coincide(tmp_path: Path) -> None:
    """Failed on the old code without an error: 9 of Qwen2's 27 tensors (hidden 32) held another layer's weights,
    although each block had been proven, before its spill, to dequantize exactly."""
    checkpoint = _checkpoint("qwen2-narrow", "gguf_q8_0", tmp_path)
    def tensors(path: Path) -> dict[str, np.ndarray]:
        return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}

    streamed = tensors(export_gguf_streamed(checkpoint, tmp_path / "s"))
    whole = tensors(export_gguf(load_pretrained_quantized(checkpoint), tmp_path / "w"))
    assert streamed.keys() == whole.keys() and len(whole) == 2 * 12 + 3
    assert [name for name in whole if not np.array_equal(streamed[name], whole[name])] == []


# ===================================================================== every family, format and recipe
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gguf_q8_0", "gguf_q4_0", "gguf_q4_1"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2"])
def test_every_streamed_format_equals_the_in_memory_export_byte_for_byte(family: str, preset: str,
                                                                        tmp_path: Path) -> None:
    _check_family(family, preset, tmp_path)


# ===================================================================== the read-back catches what changed on disk
@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory) -> Path:
    return _checkpoint("qwen2", "gguf_q8_0", tmp_path_factory.mktemp("qwen2"))


def test_spill_names_never_repeat_and_a_reused_name_is_refused(tmp_path: Path) -> None:
    spill = export_streamed._Spill(tmp_path)
    tensors = [gguf_export.GGUFTensor(f"t{i}", np.full((2, 3), i, np.float32), "F32") for i in range(5)]
    spilled = [spill(t) for t in tensors]
    assert len({p.name for p in tmp_path.iterdir()}) == 5
    assert all(np.array_equal(s.data, t.data) and s.digest == readback.array_digest(t.data)
               for s, t in zip(spilled, tensors))
    spill._numbers = iter([0])  # a name used twice is an error, never a file rewritten under a memory map
    with pytest.raises(FileExistsError):
        spill(tensors[0])
    assert np.array_equal(spilled[0].data, tensors[0].data)


def _spill_file(file) -> Path | None:
    """The ``.npy`` spill file ``np.save`` just wrote to ``file`` (a path or an open handle), else ``None``."""
    if hasattr(file, "flush"):
        file.flush()
    path = Path(getattr(file, "name", file))
    return path if path.suffix == ".npy" and path.parent.name.startswith(".out.blocks-") else None


def test_a_spill_collision_is_caught_by_the_read_back(qwen2_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """The old bug where sizes coincide: a later tensor's spill rewrites an earlier one's file of the same size (in
    place: the earlier memory map sees the new bytes). The file is then written from the changed map; the read-back
    (bytes against the digest taken at proof time) names the tensor and file, and nothing is moved into place."""
    real_save = np.save
    sizes: dict[int, Path] = {}
    victims: list[str] = []

    def colliding_save(file, array, *args, **kwargs):
        real_save(file, array, *args, **kwargs)
        path = _spill_file(file)
        if path is None:
            return
        size = path.stat().st_size
        if size in sizes and not victims and path.read_bytes() != sizes[size].read_bytes():
            with open(sizes[size], "r+b") as handle:
                handle.write(path.read_bytes())
            victims.append(sizes[size].name)
        sizes.setdefault(size, path)

    monkeypatch.setattr(np, "save", colliding_save)
    with pytest.raises(ReadBackError, match=r"tensor '[^']+' of '.*out/model\.gguf', read back from disk.*other "
                                            r"bytes than the ones proven.*not moved into place"):
        export_gguf_streamed(qwen2_checkpoint, tmp_path / "out")
    assert victims and not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no partial folder, no spill folder


def _flip_byte(path: Path, offset_from_end: int = 7) -> None:
    """Change one byte near the end of ``path`` (the last tensor's data): the file changed on disk."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_gguf_file_changed_on_disk_is_caught_before_it_is_moved(qwen2_checkpoint: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    real_close = gguf.GGUFWriter.close

    def close_then_corrupt(self) -> None:
        real_close(self)
        _flip_byte(Path(self.path))

    monkeypatch.setattr(gguf.GGUFWriter, "close", close_then_corrupt)
    with pytest.raises(ReadBackError, match=r"tensor 'output\.weight' of '.*streamed/model\.gguf'.*SHA-256"):
        export_gguf_streamed(qwen2_checkpoint, tmp_path / "streamed")
    model = load_pretrained_quantized(qwen2_checkpoint)
    with pytest.raises(ReadBackError, match=r"tensor 'output\.weight' of '.*whole/model\.gguf'.*SHA-256"):
        export_gguf(model, tmp_path / "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", FOLDERS)
def test_a_safetensors_file_changed_on_disk_is_caught_before_it_is_moved(fmt: str, qwen2_checkpoint: Path,
                                                                         tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def save_then_corrupt(tensors, filename, *args, **kwargs) -> None:
        real_save_file(tensors, filename, *args, **kwargs)
        _flip_byte(Path(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_corrupt)
    with pytest.raises(ReadBackError, match=r"tensor '[^']+' of '.*streamed/model-00000\.safetensors'.*SHA-256"):
        export_safetensors_streamed(qwen2_checkpoint, tmp_path / "streamed", format=fmt)
    model = load_pretrained_quantized(qwen2_checkpoint)
    with pytest.raises(ReadBackError, match=r"tensor '[^']+' of '.*whole/model\.safetensors'.*SHA-256"):
        export_safetensors(model, tmp_path / "whole", format=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_existing_output_is_kept_when_the_read_back_fails(qwen2_checkpoint: Path, tmp_path: Path,
                                                             monkeypatch) -> None:
    first = export_gguf_streamed(qwen2_checkpoint, tmp_path / "out")
    before = first.read_bytes()
    real_close = gguf.GGUFWriter.close
    monkeypatch.setattr(gguf.GGUFWriter, "close", lambda self: (real_close(self), _flip_byte(Path(self.path))))
    with pytest.raises(ReadBackError):
        export_gguf_streamed(qwen2_checkpoint, tmp_path / "out", overwrite=True)
    assert first.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_truncated_file_is_not_readable_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    path.write_bytes(save(tensors)[:-3])
    with pytest.raises(ReadBackError, match=r"'.*shown\.safetensors'.*not a readable safetensors file"):
        readback.verify_safetensors_file(path, tmp_path / "shown.safetensors", readback.records_of(tensors))


# ===================================================================== the command line, as the issue ran it
@pytest.mark.slow
def test_quantize_qwen2_with_export_gguf_writes_the_in_memory_file(tmp_path: Path) -> None:
    """``quark-brevitas quantize --model QWEN2 --preset gguf_q8_0 --export gguf`` died with ``OSError: ... requested
    and ... written``; now it writes the file ``export_gguf`` writes for the loaded checkpoint, byte for byte."""
    from helpers.llm_folders import FAST
    from helpers.llm_folders import bpe_tokenizer as _bpe_tokenizer
    from helpers.llm_folders import text as _text

    from quark_brevitas.cli import main

    folder = tmp_path / "qwen2"
    tokenizer = _bpe_tokenizer(folder)
    torch.manual_seed(0)
    # the embedding padded beyond the tokenizer, as Qwen2's is (the copy saved beside the checkpoint may gain a token)
    config = transformers.Qwen2Config(**{**_SIZES, "hidden_size": 32, "intermediate_size": 64,
                                         "vocab_size": len(tokenizer) + 8})
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    (tmp_path / "calib.txt").write_text(_text(40, seed=1))
    assert main(["-q", "quantize", "--model", str(folder), "--calib-text", str(tmp_path / "calib.txt"), "--output",
                 str(tmp_path / "ckpt"), "--preset", "gguf_q8_0", "--export", "gguf", *FAST]) == 0
    written = tmp_path / "ckpt" / "gguf" / "model.gguf"
    whole = export_gguf(load_pretrained_quantized(tmp_path / "ckpt"), tmp_path / "whole",
                        tokenizer_path=tmp_path / "ckpt" / "float_model")  # the tokenizer the streamed export used
    assert written.read_bytes() == whole.read_bytes()
    assert len(gguf.GGUFReader(str(written)).fields["tokenizer.ggml.tokens"].data) == len(tokenizer) + 8


# ===================================================================== ONNX: verified from disk before it is renamed
@pytest.fixture(scope="module")
def small_w8a8() -> tuple[torch.nn.Module, torch.Tensor]:
    from quark_brevitas import ModelQuantizer, QTensorConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()))
    x = torch.randn(4, 2, 6, 6)
    return ModelQuantizer(config).quantize_model(model, [x]), x


def _negate_first_weight(path: Path) -> None:
    """Change the saved ONNX file on disk: the first float initializer with several values, negated."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    for index, tensor in enumerate(proto.graph.initializer):
        values = numpy_helper.to_array(tensor)
        if values.dtype == np.float32 and values.size > 1:
            proto.graph.initializer[index].CopyFrom(numpy_helper.from_array(-values, tensor.name))
            break
    onnx.save_model(proto, str(path))


def test_an_onnx_file_changed_on_disk_is_rejected_and_not_moved(small_w8a8, tmp_path: Path, monkeypatch) -> None:
    """The file is run from disk (onnxruntime) under a temporary name and renamed only once verified; the pinned
    check, when the outputs differ, reads the file too (it ran the graph in memory before, which could accept a
    file whose bytes differ from it). A file that fails is kept as ``m.rejected.onnx``; an earlier ``m.onnx``
    stays."""
    from quark_brevitas.export import ExportMismatchError, export_onnx_qcdq
    from quark_brevitas.export.onnx import orchestrate

    model, x = small_w8a8
    good = export_onnx_qcdq(model, x, tmp_path / "m.onnx").path
    before = good.read_bytes()
    real_write_file = orchestrate.write_file

    def write_then_change(target, write):
        result = real_write_file(target, write)
        _negate_first_weight(Path(target))
        return result

    monkeypatch.setattr(orchestrate, "write_file", write_then_change)
    with pytest.raises(ExportMismatchError, match=r"m\.rejected\.onnx disagrees with PyTorch"):
        export_onnx_qcdq(model, x, tmp_path / "m.onnx")
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.rejected.onnx"]
    with pytest.raises(ExportMismatchError):
        export_onnx_qcdq(model, x, tmp_path / "new.onnx")
    assert not (tmp_path / "new.onnx").exists() and (tmp_path / "new.rejected.onnx").is_file()


# ===================================================================== integer weights (save_integer_weights)
@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_integer_weights_changed_on_disk_are_caught_before_the_rename(fmt: str, small_w8a8, tmp_path: Path,
                                                                       monkeypatch) -> None:
    import safetensors.torch

    from quark_brevitas.export.intweights import integer_weights, save_integer_weights

    weights = integer_weights(small_w8a8[0])
    good = save_integer_weights(weights, tmp_path / f"w.{fmt}", format=fmt)
    before = good.read_bytes()
    if fmt == "safetensors":
        real = safetensors.torch.save_file
        monkeypatch.setattr(safetensors.torch, "save_file",
                            lambda tensors, filename, **kw: (real(tensors, filename, **kw), _flip_byte(Path(filename))))
    else:
        real_savez = np.savez

        def savez_then_change(handle, **arrays):
            arrays = dict(arrays)
            name = next(k for k in arrays if k.endswith(".int_weight"))
            arrays[name] = arrays[name].copy()
            arrays[name].flat[0] += 1  # what lands on disk is not what was meant
            real_savez(handle, **arrays)

        monkeypatch.setattr(np, "savez", savez_then_change)
    with pytest.raises(ReadBackError, match=rf"w\.{fmt}'?, read back from disk"):
        save_integer_weights(weights, tmp_path / f"w.{fmt}", format=fmt)
    assert good.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [f"w.{fmt}"]
