"""Distributed calibration: two gloo processes on CPU, each with half of the batches, against one process.

The test launches the processes itself (``torch.multiprocessing.spawn``); each quantizes the same model with
its shard and saves its result; both must equal the single-process model: integer weight codes equal, every
scale within 1e-6 relative.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos  # noqa: E402
from quark_brevitas.calibration.data import CalibrationData, Shard  # noqa: E402
from quark_brevitas.checkpoint import load_quantized, read_weights, save_quantized  # noqa: E402
from quark_brevitas.errors import CalibrationDataError  # noqa: E402
from quark_brevitas.export.intweights import integer_weights  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (2, 12), generator=generator)} for _ in range(5)]  # uneven shards


RECIPES = {
    # GPTQ's Hessians (weighted by rows) and activation calibration (weighted by batches), block by block.
    "w4a8_gptq": (Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4),
                                      input_tensors=QTensorConfig()),
                         pre_quant_opt_config=[], algo_config=[algos.GPTQ()]), {}),
    # Activation-equalization ranges (maxima) and asymmetric activation zero points, on the whole model.
    "smooth_w8a8_whole": (Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel),
                                              input_tensors=QTensorConfig(symmetric=False)),
                                 pre_quant_opt_config=[algos.ActivationEqualization()], algo_config=[algos.GPTQ()]),
                          {"blocks": False}),
}


def _worker(rank: int, init_file: str, out_dir: str, recipe: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        config, kwargs = RECIPES[recipe]
        model = _model()
        calls = []
        model.model.embed_tokens.register_forward_pre_hook(lambda module, args: calls.append(1))
        quant = ModelQuantizer(config).quantize_model(model, _batches(), **kwargs)
        save_quantized(quant, Path(out_dir) / f"rank{rank}")
        (Path(out_dir) / f"rank{rank}.calls").write_text(str(len(calls)))
    finally:
        dist.destroy_process_group()


def _compare(reference: torch.nn.Module, other: torch.nn.Module) -> None:
    expected, got = integer_weights(reference), integer_weights(other)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name].int_weight, got[name].int_weight), name
        torch.testing.assert_close(got[name].scale, expected[name].scale, rtol=1e-6, atol=0)
    ref_state, state = reference.state_dict(), other.state_dict()
    assert ref_state.keys() == state.keys()
    quantizer_values = [k for k in ref_state if "_quant." in k]
    assert any("input_quant" in k for k in quantizer_values)
    for key in quantizer_values:  # activation scales and zero points, equalization scales
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-6, atol=1e-7, msg=key)
    for key in (k for k in ref_state if k.endswith("scale.weight")):
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-6, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_gloo_processes_equal_one(recipe: str, tmp_path) -> None:
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path), recipe), nprocs=WORLD,
                                join=True)
    # Each process ran the model on its own share only: 3 of the 5 batches on rank 0, 2 on rank 1.
    calls = [int((tmp_path / f"rank{rank}.calls").read_text()) for rank in range(WORLD)]
    assert calls[0] * 2 == calls[1] * 3 > 0
    config, kwargs = RECIPES[recipe]
    model = _model()
    single = ModelQuantizer(config).quantize_model(model, _batches(), **kwargs)
    for rank in range(WORLD):
        _compare(single, load_quantized(model, tmp_path / f"rank{rank}"))


def _stream_worker(rank: int, init_file: str, folder: str, out: str) -> None:
    from quark_brevitas.hf.streaming import quantize_pretrained

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        quantize_pretrained(folder, RECIPES["w4a8_gptq"][0], _batches(), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_stream_a_folder(tmp_path) -> None:
    """Both processes read the folder and take half of the batches; the first writes the checkpoint."""
    pytest.importorskip("accelerate")
    from quark_brevitas.hf.streaming import quantize_pretrained

    _model().save_pretrained(tmp_path / "float")
    torch.multiprocessing.spawn(_stream_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path / "float"),
                                                      str(tmp_path / "two")), nprocs=WORLD, join=True)
    quantize_pretrained(tmp_path / "float", RECIPES["w4a8_gptq"][0], _batches(), tmp_path / "one")
    model = _model()
    _compare(load_quantized(model, tmp_path / "one"), load_quantized(model, tmp_path / "two"))
    assert read_weights(tmp_path / "one").keys() == read_weights(tmp_path / "two").keys()
    assert not (tmp_path / "two" / ".progress").exists()


def test_shards_split_batches_and_name_global_indices() -> None:
    batches = [torch.full((1, 2), float(i)) for i in range(5)]
    first, second = (CalibrationData(batches, shard=Shard(rank, 2)) for rank in range(2))
    assert [int(b[0, 0]) for b in first] == [0, 2, 4] and len(first) == 3
    assert [int(b[0, 0]) for b in second] == [1, 3] and len(second) == 2
    assert [index for index, _ in second.indexed()] == [1, 3]
    with pytest.raises(CalibrationDataError, match="2 batch\\(es\\) for 3 processes"):
        CalibrationData(batches[:2], shard=Shard(0, 3))


def test_distributed_true_needs_a_process_group() -> None:
    assert not (dist.is_available() and dist.is_initialized())
    with pytest.raises(ValueError, match="distributed=True needs an initialised torch.distributed"):
        ModelQuantizer(RECIPES["w4a8_gptq"][0]).quantize_model(_model(), _batches(), distributed=True)


def test_bias_correction_needs_equal_shares() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    data = CalibrationData(_batches(), shard=Shard(0, 2))
    config = Config(QLayerConfig(weight=QTensorConfig()), pre_quant_opt_config=[], algo_config=[algos.BiasCorrection()])
    with pytest.raises(CalibrationDataError, match="divisible by 2"):
        ModelQuantizer(config).pipeline._check_shards(data, needs_data=True)
