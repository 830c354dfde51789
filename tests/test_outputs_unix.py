"""Outputs behave like a Unix tool's (issue 27): modes from the umask, the destination claimed before any work
(a lock refusing a second run, naming its process; a probe write failing an unwritable or full destination in
the first second, with nothing left behind), and SIGINT / SIGTERM ending a command in one line, exit 130."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import quark_brevitas.outputs as outputs
from quark_brevitas.cli import main
from quark_brevitas.outputs import add_folder, output_dir, write_file

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def umask():
    """Run the test under a chosen umask and restore the previous one."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize(("mask", "file_mode", "folder_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_files_and_folders_get_the_umask_mode(tmp_path: Path, umask, mask: int, file_mode: int,
                                              folder_mode: int) -> None:
    umask(mask)
    single = write_file(tmp_path / "model.onnx", lambda p: p.write_bytes(b"onnx"))
    with output_dir(tmp_path / "out") as work:
        (work / "model.safetensors").write_bytes(b"weights")
    add_folder(tmp_path / "out", "float_model", lambda p: (p / "tokenizer.json").write_text("{}"))
    assert _mode(single) == file_mode
    assert _mode(tmp_path / "out") == folder_mode
    assert _mode(tmp_path / "out" / "model.safetensors") == file_mode
    assert _mode(tmp_path / "out" / "float_model") == folder_mode
    assert _mode(tmp_path / "out" / "float_model" / "tokenizer.json") == file_mode


def test_an_unwritable_output_fails_before_training_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """A file where the output's folder should be (root ignores permission bits, so this is how a test makes a
    place nobody can write to): one ``error:`` line naming --output as given, exit 2, before any training."""
    import quark_brevitas.cli.digits as digits

    monkeypatch.setattr(digits, "train_digits_cnn", lambda *a, **k: pytest.fail("trained before checking --output"))
    (tmp_path / "afile").write_text("not a folder")
    given = str(tmp_path / "afile" / "out")
    assert main(["quantize", "--output", given, "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --output: ") and repr(given) in err[0], err
    assert "is a file, not a folder" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_full_disk_fails_before_any_work_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """The probe write reaches the disk (fsync), where a full file system says ENOSPC; the Python API raises an
    OSError subclass naming the output before the model folder is even read."""
    import quark_brevitas.hf.streaming as streaming

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.setattr(streaming, "load_skeleton", lambda *a: pytest.fail("read the model before the probe"))
    out = tmp_path / "deep" / "er" / "out"
    with pytest.raises(outputs.OutputNotWritableError, match="No space left on device") as caught:
        streaming.quantize_pretrained(tmp_path / "model", None, None, out)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert str(out) in str(caught.value) and caught.value.filename == str(out)
    assert list(tmp_path.iterdir()) == []  # no lock, no .partial, not even the folders it made for the output


_HOLDER = textwrap.dedent("""
    import sys, time
    from quark_brevitas.outputs import reserve
    with reserve(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


def test_a_second_run_on_the_same_output_is_refused_at_once_naming_the_first(tmp_path: Path, capsys,
                                                                           monkeypatch) -> None:
    import quark_brevitas.cli.digits as digits

    monkeypatch.setattr(digits, "train_digits_cnn", lambda *a, **k: pytest.fail("trained on a busy output"))
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env=_env())
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        assert main(["quantize", "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --output: ") and f"process {first.pid}" in err[0], err
        import quark_brevitas.hf.streaming as streaming

        with pytest.raises(outputs.OutputBusyError) as caught:  # the Python API too (a streamed run's .partial)
            streaming.quantize_pretrained(tmp_path / "model", None, None, out)
        assert caught.value.pid == first.pid
    finally:
        first.kill()
        first.wait()
    # the killed holder left its lock file behind: a stale lock, taken over by the next run
    assert outputs.lock_path(out).is_file()
    with outputs.reserve(out), outputs.reserve(out):  # and the same process may claim it twice (nested entry points)
        assert outputs.lock_path(out).is_file()
    assert not outputs.lock_path(out).exists()


_INTERRUPTED = textwrap.dedent("""
    import os, signal, sys, time
    import quark_brevitas.cli.digits as digits

    def train(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(30)

    digits.train_digits_cnn = train
    from quark_brevitas.cli import main
    sys.exit(main(["quantize", "--output", sys.argv[2], "--epochs", "1"]))
""")


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_an_interrupted_command_says_how_to_resume_in_one_line(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED, name, str(out)], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert done.returncode == 130, done.stderr
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert lines == [f"interrupted: {str(out)!r} is as it was before this run; rerun the same command to start "
                     "again"], done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # the lock went with the run


def test_sigterm_restores_the_previous_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert main(["presets"]) == 0
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow
def test_an_interrupted_streamed_run_keeps_its_blocks_and_the_same_command_resumes(tmp_path: Path, capsys,
                                                                                   monkeypatch) -> None:
    """Ctrl-C after the first block of a block-by-block run: one line saying the work is kept in OUT.partial and
    that rerunning resumes, exit 130, the lock gone; the rerun resumes and finishes."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("accelerate")
    import torch


    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", *words])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model_dir = tmp_path / "llama"
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]",
                                         unk_token="[UNK]").save_pretrained(model_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(model_dir)
    calib = tmp_path / "calib.txt"
    generator = torch.Generator().manual_seed(1)
    calib.write_text("\n".join(" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=generator))
                               for _ in range(40)) + "\n")
    out = tmp_path / "out"
    args = ["quantize", "--model", str(model_dir), "--calib-text", str(calib), "--output", str(out), "--seq-len", "16",
            "--batch-size", "2", "--calib-sequences", "4", "--eval-sequences", "2"]
    from quark_brevitas.checkpoint.writer import BlockCheckpoint

    original = BlockCheckpoint.finish

    def interrupted(self, index, block):
        original(self, index, block)
        raise KeyboardInterrupt

    monkeypatch.setattr(BlockCheckpoint, "finish", interrupted)
    assert main(args) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("interrupted")]
    assert err == [f"interrupted: the finished work is kept in {str(out) + '.partial'!r}; rerun the same command "
                   "to resume (--no-resume starts over)"]
    assert not out.exists() and (tmp_path / "out.partial").is_dir() and not outputs.lock_path(out).exists()
    monkeypatch.setattr(BlockCheckpoint, "finish", original)
    assert main(args) == 0
    assert "resum" in capsys.readouterr().err.lower()
    assert (out / "float_model" / "tokenizer.json").is_file() and not (tmp_path / "out.partial").exists()
