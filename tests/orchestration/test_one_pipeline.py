"""One pipeline (issue 28): a model in memory and a Hugging Face folder quantized block by block go through the same
orchestrator (:func:`quark_brevitas.orchestration.block_runs.run_blocks`, which builds the engine), the same
checkpoint writer (:class:`quark_brevitas.checkpoint.writer.CheckpointWriter`) and the same export entry
(:meth:`quark_brevitas.export.registry.ExportFormat.export`); only the block source and sink differ. A run without
calibration data takes the same orchestrator, and a model without a block stack goes through it as its one block.
The results are compared bit for bit with the recorded snapshot in ``test_one_pipeline_snapshot.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import helpers.reference as ref  # noqa: E402
from helpers.llm_models import INT4_G32, tiny_llama, token_batches, weight_only_config  # noqa: E402

import quark_brevitas.orchestration.block_runs as block_runs  # noqa: E402
from quark_brevitas.api import ModelExporter, ModelQuantizer  # noqa: E402
from quark_brevitas.blocks.disk import FolderBlocks  # noqa: E402
from quark_brevitas.blocks.sources import BlockSink, CopiedBlocks  # noqa: E402
from quark_brevitas.checkpoint import read_weights, save_quantized  # noqa: E402
from quark_brevitas.checkpoint.writer import BlockCheckpoint, CheckpointWriter  # noqa: E402
from quark_brevitas.config import Config, GPTQConfig, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.config.enums import Dtype, QSchemeType  # noqa: E402
from quark_brevitas.export.registry import ExportFormat  # noqa: E402
from quark_brevitas.hf import streaming  # noqa: E402
from quark_brevitas.hf.streaming import quantize_pretrained  # noqa: E402


def _config() -> Config:
    weight = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)
    return Config(QuantizationConfig(weight=weight), pre_quant_opt_config=[],
                  algo_config=[GPTQConfig(sym=True, group_size=32)], exclude=["lm_head"])


@pytest.fixture
def spies(monkeypatch) -> dict[str, list]:
    """Every engine the orchestrator builds (its source and sink), every part the checkpoint writer writes and
    every call of a format's one export entry."""
    seen: dict[str, list] = {"engines": [], "parts": [], "exports": []}

    class Engine(block_runs.BlockwiseEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen["engines"].append((type(self.source), type(self.sink)))

    write_part, export = CheckpointWriter.write_part, ExportFormat.export

    def spy_part(self, file_name, *args, **kwargs):
        seen["parts"].append(file_name)
        return write_part(self, file_name, *args, **kwargs)

    def spy_export(self, source, *args, **kwargs):
        seen["exports"].append(type(source).__name__)
        return export(self, source, *args, **kwargs)

    monkeypatch.setattr(block_runs, "BlockwiseEngine", Engine)
    monkeypatch.setattr(CheckpointWriter, "write_part", spy_part)
    monkeypatch.setattr(ExportFormat, "export", spy_export)
    return seen


@pytest.mark.slow
def test_in_memory_and_block_by_block_runs_share_orchestrator_writer_and_export_entry(spies, tmp_path) -> None:
    torch.set_num_threads(1)
    folder = tmp_path / "llama"
    tiny_llama(2).save_pretrained(folder)
    calib = token_batches(count=1, batch=2, length=16)

    float_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    quantized = ModelQuantizer(_config()).quantize_model(float_model, calib)
    in_memory = save_quantized(quantized, tmp_path / "memory")
    assert spies["engines"] == [(CopiedBlocks, BlockSink)]  # the model's blocks copied, kept in memory
    assert spies["parts"] == ["model.safetensors"]  # the model in memory: one part

    streamed = quantize_pretrained(folder, _config(), calib, tmp_path / "blocks")
    assert spies["engines"][1:] == [(FolderBlocks, BlockCheckpoint)]  # the folder's blocks, written one by one
    assert spies["parts"][1:] == ["model-block-00000.safetensors", "model-block-00001.safetensors",
                                  "model-rest.safetensors"]

    memory_state, streamed_state = read_weights(in_memory), read_weights(streamed)
    assert memory_state.keys() == streamed_state.keys()
    assert all(torch.equal(memory_state[k], streamed_state[k]) for k in memory_state)

    from_model = ModelExporter(tmp_path / "from-model").export("quark", quantized)
    from_checkpoint = ModelExporter(tmp_path / "from-checkpoint").export("quark", streamed)
    assert spies["exports"] == ["LlamaForCausalLM", "PosixPath"]
    written = [read_tensors(folder) for folder in (from_model, from_checkpoint)]
    assert written[0].keys() == written[1].keys() and len(written[0]) > 0
    assert all(torch.equal(written[0][k], written[1][k]) for k in written[0])


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.fixture
def runs(monkeypatch) -> list[tuple[str | None, bool]]:
    """``(stack, data given)`` of every call of the one orchestrator (from the pipeline and from streaming)."""
    seen: list[tuple[str | None, bool]] = []
    run_blocks = block_runs.run_blocks

    def spy(quantizer, model, stack, data, *args, **kwargs):
        seen.append((stack, data is not None))
        return run_blocks(quantizer, model, stack, data, *args, **kwargs)

    monkeypatch.setattr(block_runs, "run_blocks", spy)
    monkeypatch.setattr(streaming, "run_blocks", spy)
    return seen


def test_round_to_nearest_in_memory_goes_through_the_orchestrator_block_by_block(spies, runs, tmp_path) -> None:
    """A recipe that needs no calibration data (round to nearest, no algorithm) ran through the pipeline's
    whole-model conversion in memory; it now walks the Llama's blocks through :func:`run_blocks` like a folder
    streamed block by block, with the same checkpoint, and each weight is the hand-computed round to nearest."""
    torch.set_num_threads(1)
    folder = tmp_path / "llama"
    tiny_llama(2).save_pretrained(folder)
    config = weight_only_config(INT4_G32)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    quantized = ModelQuantizer(config).quantize_model(float_model)  # no calibration data
    assert runs == [("model.layers", False)]
    assert spies["engines"] == [(CopiedBlocks, BlockSink)]
    in_memory = save_quantized(quantized, tmp_path / "memory")

    streamed = quantize_pretrained(folder, weight_only_config(INT4_G32), None, tmp_path / "blocks")
    assert runs[1:] == [("model.layers", False)] and spies["engines"][1:] == [(FolderBlocks, BlockCheckpoint)]
    memory_state, streamed_state = read_weights(in_memory), read_weights(streamed)
    assert memory_state.keys() == streamed_state.keys()
    assert all(torch.equal(memory_state[k], streamed_state[k]) for k in memory_state)

    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        _rounded_to_nearest(quantized.get_submodule(name), float_model.get_submodule(name).weight)


def _rounded_to_nearest(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """The independent reference of INT4_G32: int4 per group of 32 on the full grid -8..7, scale max|group| / 7.5
    (tests/export/test_full_range.py)."""
    weight = weight.detach()
    expected = ref.int_qdq(weight, ref.group_absmax(weight, 32) / 7.5, 0.0, 4, True, False)
    with torch.no_grad():
        ref.assert_close(layer.quant_weight().value, expected, "round to nearest")


def test_a_model_without_a_block_stack_is_one_block(spies, runs) -> None:
    """A model that is not made of repeated blocks (the digits CNN, any small network) goes through the same
    orchestrator as its one block: no engine, the pipeline's stages on the whole model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    quantized = ModelQuantizer(weight_only_config(INT4_G32, exclude=())).quantize_model(model)
    assert runs == [(None, False)] and spies["engines"] == []
    for index in (0, 2):
        _rounded_to_nearest(quantized[index], model[index].weight)


def test_a_run_without_a_block_stack_refuses_a_source_that_addresses_blocks() -> None:
    class Loaded(block_runs.BlockSource):
        pass

    with pytest.raises(block_runs.ModelError, match="one block; Loaded takes or writes the blocks of a stack"):
        block_runs.run_blocks(None, torch.nn.Linear(2, 2), None, None, Loaded())
