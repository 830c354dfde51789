"""Bounded memory: a Hugging Face folder quantized one block at a time, its block-by-block checkpoint, resume,
and a run under a memory limit smaller than the float model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.llm_folders import saved_llama  # noqa: E402

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos  # noqa: E402
from quark_brevitas.checkpoint import CheckpointError, load_quantized, read_weights  # noqa: E402
from quark_brevitas.hf.streaming import (  # noqa: E402
    evaluate_pretrained,
    load_pretrained_quantized,
    quantize_pretrained,
)
from quark_brevitas.types import QSchemeType  # noqa: E402

W4A8_SMOOTH_GPTQ = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
                                       input_tensors=QTensorConfig()),
                          pre_quant_opt_config=[algos.ActivationEqualization()], algo_config=[algos.GPTQ()])
GPTQ_W4 = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)),
                 pre_quant_opt_config=[], algo_config=[algos.GPTQ()])


def _batches(count: int = 3, vocab: int = 64) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, vocab, (2, 12), generator=generator)} for _ in range(count)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("llama"), vocab=64, hidden=32, heads=4, positions=64)


def _float(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def test_streamed_checkpoint_equals_in_memory_quantization(llama_dir, tmp_path) -> None:
    out = quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "out")
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == [
        "model-block-00000.safetensors", "model-block-00001.safetensors", "model-block-00002.safetensors",
        "model-rest.safetensors"]
    assert not (out / ".progress").exists()
    float_model = _float(llama_dir)
    in_memory = ModelQuantizer(W4A8_SMOOTH_GPTQ).quantize_model(float_model, _batches())
    expected = in_memory.state_dict()
    stored = read_weights(out)
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[k], expected[k]) for k in expected)
    ids = _batches(1)[0]["input_ids"]
    with torch.no_grad():
        reference = in_memory(ids).logits
        assert torch.equal(load_quantized(float_model, out)(ids).logits, reference)  # with the float model
        loaded = load_pretrained_quantized(out)  # from the checkpoint alone
        assert torch.equal(loaded(ids).logits, reference)
    generated = loaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    with torch.no_grad():  # greedy generation: each new token is the argmax of the model's logits
        logits = loaded(generated[:, :-1]).logits
    assert torch.equal(logits[0, 3:].argmax(-1), generated[0, 4:])
    # Streamed evaluation, one block in memory at a time: the quantized and the float model's outputs.
    quantized, floating = [], []
    evaluate_pretrained(out, [{"input_ids": ids}], lambda i, o: quantized.append(o.logits))
    evaluate_pretrained(llama_dir, [{"input_ids": ids}], lambda i, o: floating.append(o.logits))
    with torch.no_grad():
        assert torch.equal(quantized[0], reference)
        assert torch.equal(floating[0], float_model(ids).logits)


def test_encoder_folder(tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    bert = transformers.BertModel(config).eval()
    bert.save_pretrained(tmp_path / "bert")
    batches = [{"input_ids": torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(i)),
                "attention_mask": torch.ones(2, 8, dtype=torch.long)} for i in range(2)]
    out = quantize_pretrained(tmp_path / "bert", W4A8_SMOOTH_GPTQ, batches, tmp_path / "out")
    expected = ModelQuantizer(W4A8_SMOOTH_GPTQ).quantize_model(bert, batches)
    with torch.no_grad():
        assert torch.equal(load_pretrained_quantized(out)(**batches[0]).last_hidden_state,
                           expected(**batches[0]).last_hidden_state)


class _Interrupted(Exception):
    pass


def test_resume_after_interruption_writes_the_same_checkpoint(llama_dir, tmp_path) -> None:
    complete = quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "complete")

    def stop_after_first(index: int, count: int) -> None:
        if index == 0:
            raise _Interrupted

    with pytest.raises(_Interrupted):
        quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "resumed", on_block=stop_after_first)
    assert (tmp_path / "resumed.partial" / "model-block-00000.safetensors").is_file()  # the unfinished run
    assert not (tmp_path / "resumed").exists()  # the output appears only once complete
    finished = []
    quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "resumed",
                        on_block=lambda index, count: finished.append(index))
    assert finished == [1, 2]  # block 0 was not quantized again
    resumed = tmp_path / "resumed"
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in complete.iterdir())
    a, b = read_weights(complete), read_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("manifest.json", "config.json", "model.safetensors.index.json"):
        assert json.loads((complete / name).read_text()) == json.loads((resumed / name).read_text())


def test_resume_refuses_another_run(llama_dir, tmp_path) -> None:
    def stop(index: int, count: int) -> None:
        raise _Interrupted

    with pytest.raises(_Interrupted):
        quantize_pretrained(llama_dir, GPTQ_W4, _batches(), tmp_path / "out", on_block=stop)
    with pytest.raises(CheckpointError, match="unfinished run of another model, config or calibration data"):
        quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "out")
    with pytest.raises(CheckpointError, match="calibration data differ"):
        quantize_pretrained(llama_dir, GPTQ_W4, _batches(4)[1:], tmp_path / "out")
    quantize_pretrained(llama_dir, W4A8_SMOOTH_GPTQ, _batches(), tmp_path / "out", resume=False)
    assert (tmp_path / "out" / "manifest.json").is_file()


# A child process: the imports and a small warm-up run first (libraries allocate on first use), then a limit
# on the data segment (heap and private memory, what tensors live in) of the warm process plus BUDGET bytes.
# Large allocations are forced into their own mappings (MALLOC_MMAP_THRESHOLD_), so freed tensors return to
# the system and the limit measures what the run holds.
_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    import transformers
    from quark_brevitas import Config, QLayerConfig, QTensorConfig
    from quark_brevitas.hf.streaming import quantize_pretrained
    from quark_brevitas.types import QSchemeType

    def data_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

    folder, warm, out, budget = sys.argv[1:5]
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
                                 input_tensors=QTensorConfig()), pre_quant_opt_config=[])
    batches = [{"input_ids": torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    quantize_pretrained(warm, config, batches, out + "-warm")
    limit = data_bytes() + int(budget)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    results = {}
    for mode in ("load", "stream"):  # loading the float model first shows that the limit bites
        try:
            if mode == "stream":
                quantize_pretrained(folder, config, batches, out)
            else:
                transformers.AutoModelForCausalLM.from_pretrained(folder)
            results[mode] = "ok"
        except (MemoryError, RuntimeError) as exc:
            results[mode] = f"out of memory: {type(exc).__name__}"
    print(json.dumps(results))
""")


def _llama_folder(folder: Path, layers: int, width: int) -> int:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=width, intermediate_size=2 * width,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
def test_quantizes_a_model_three_times_the_memory_limit(tmp_path) -> None:
    float_bytes = _llama_folder(tmp_path / "big", layers=24, width=256)
    _llama_folder(tmp_path / "warm", layers=2, width=32)
    budget = float_bytes // 3

    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "big"), str(tmp_path / "warm"),
                                str(tmp_path / "out"), str(budget)],
                               capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    assert float_bytes > 55 * 2**20
    assert results["load"].startswith("out of memory")  # the limit bites: the float model alone does not fit
    assert results["stream"] == "ok"
    loaded = load_pretrained_quantized(tmp_path / "out")
    assert sum(type(m).__name__ == "QuantLinear" for m in loaded.modules()) == 24 * 7 + 1
