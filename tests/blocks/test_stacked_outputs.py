"""The block engine's outputs pass on stacked batches (issue 32): the per-batch outputs and the final codes are
those of the batch-by-batch pass, bit for bit, and the pass runs batch by batch where rows are not independent."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from brevitas.nn import QuantLinear  # noqa: E402
from helpers.llm_models import UINT4_G32, VOCAB, tiny_llama  # noqa: E402

from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.blocks import engine, stacked_outputs  # noqa: E402
from quark_brevitas.brevitas_adapter import QuantLayer  # noqa: E402
from quark_brevitas.calibration.data import BlockInputs, CalibrationData  # noqa: E402
from quark_brevitas.config import Config, GPTQConfig, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.config.enums import Dtype, QSchemeType  # noqa: E402


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (rows, 24), generator=generator) for rows in (1, 2, 1, 3, 1, 1, 2)]


def _quantize(monkeypatch, config: Config, stack: bool) -> tuple[list[bool], list[torch.Tensor], dict]:
    """Quantize the tiny Llama; the outputs pass stacked or not; returns whether each outputs pass stacked,
    every per-batch output of those passes, and the final weight codes."""
    used, outputs = [], []

    def recorded(block, inputs: BlockInputs, desc: str):
        results = stacked_outputs.stacked_forward(block, inputs, desc) if stack else None
        used.append(results is not None)
        if results is None:  # the engine's batch-by-batch pass, recorded here
            results = []
            inputs.forward(block, desc, on_output=lambda _position, output: results.append(output))
        outputs.extend(results)
        return results

    monkeypatch.setattr(engine, "stacked_forward", recorded)
    torch.set_num_threads(1)
    model = ModelQuantizer(config).quantize_model(tiny_llama(2), _batches())
    with torch.no_grad():
        codes = {name: layer.quant_weight().int() for name, layer in model.named_modules()
                 if isinstance(layer, QuantLayer) and name != "lm_head"}
    return used, outputs, codes


@pytest.mark.slow
def test_stacked_outputs_pass_gives_the_outputs_and_codes_of_batch_by_batch(monkeypatch) -> None:
    config = Config(QuantizationConfig(weight=UINT4_G32), algo_config=[GPTQConfig(group_size=32)],
                    exclude=["lm_head"])
    used, stacked, stacked_codes = _quantize(monkeypatch, config, stack=True)
    assert used == [True, True], "the outputs passes were not stacked"
    used, plain, plain_codes = _quantize(monkeypatch, config, stack=False)
    assert used == [False, False]
    assert len(stacked) == len(plain) == 2 * len(_batches())
    for one, other in zip(stacked, plain):
        assert one.shape == other.shape and torch.equal(one, other)
    assert stacked_codes.keys() == plain_codes.keys()
    for name, codes in plain_codes.items():
        assert torch.equal(stacked_codes[name], codes), name


def test_outputs_pass_is_not_stacked_with_dynamic_activation_quantizers(monkeypatch) -> None:
    dynamic = QuantizationSpec(dtype=Dtype.int8, qscheme=QSchemeType.per_tensor, is_dynamic=True)
    config = Config(QuantizationConfig(weight=UINT4_G32, input_tensors=dynamic), exclude=["lm_head"])
    used, outputs, _ = _quantize(monkeypatch, config, stack=True)
    assert used == [False, False] and len(outputs) == 2 * len(_batches())


class _Flattening(torch.nn.Module):
    """A block whose quantized layer reads every token of the call as one row (like routed experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = QuantLinear(8, 8, bias=False, weight_bit_width=4)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.flatten(0, 1)).view_as(hidden)


class _Pooling(torch.nn.Module):
    """A block whose output mixes the rows of its call."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.sum(0)


def _cached(rows: tuple[int, ...]) -> BlockInputs:
    generator = torch.Generator().manual_seed(0)
    return BlockInputs.of([((torch.randn(count, 3, 8, generator=generator),), {}) for count in rows],
                          CalibrationData([torch.zeros(1)]), "block")


def test_stacked_forward_splits_outputs_into_batches_and_refuses_mixed_rows() -> None:
    inputs = _cached((1, 2, 1, 1))
    linear = torch.nn.Linear(8, 8)
    plain: list[torch.Tensor] = []
    inputs.forward(linear, "plain", on_output=lambda _position, output: plain.append(output))
    stacked = stacked_outputs.stacked_forward(linear, inputs, "stacked")
    assert stacked is not None and len(stacked) == len(plain)
    assert all(torch.equal(one, other) for one, other in zip(stacked, plain))
    assert stacked_outputs.stacked_forward(_Flattening(), inputs, "flattening") is None
    assert stacked_outputs.stacked_forward(_Pooling(), inputs, "pooling") is None
