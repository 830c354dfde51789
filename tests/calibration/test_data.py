"""Batch conventions and the errors for bad calibration data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.calibration.data import cache_keyword, output_cache, prepare_batch, run_batches
from quark_brevitas.errors import CalibrationDataError

W8A8 = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()),
              pre_quant_opt_config=[])


class KwargsModel(nn.Module):
    """Takes token ids and a float mask by keyword, like a Hugging Face model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 2)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, input_ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.seen.append((input_ids.dtype, scale.dtype))
        return self.fc(self.emb(input_ids) * scale[..., None])


def test_batch_shapes() -> None:
    x = torch.ones(2, 3)
    device, dtype = torch.device("cpu"), torch.float64
    assert prepare_batch(x, 0, device, dtype)[0][0].dtype == torch.float64
    args, kwargs = prepare_batch((x, torch.zeros(2)), 0, device, dtype)
    assert len(args) == 1 and torch.equal(args[0], x.double()) and kwargs == {}
    args, kwargs = prepare_batch([(x, x), "target"], 0, device, dtype)
    assert len(args) == 2
    ids = torch.tensor([[1, 2]])
    args, kwargs = prepare_batch({"input_ids": ids, "scale": x}, 0, device, dtype)
    assert args == () and kwargs["input_ids"].dtype == torch.int64 and kwargs["scale"].dtype == torch.float64
    args, kwargs = prepare_batch(({"input_ids": ids}, torch.zeros(1)), 0, device, dtype)
    assert kwargs["input_ids"] is not None


def test_dict_batches_keep_integer_dtype() -> None:
    model = KwargsModel()
    batches = [{"input_ids": torch.randint(0, 10, (3, 5)), "scale": torch.rand(3, 5)} for _ in range(2)]
    quant = ModelQuantizer(W8A8).quantize_model(model, batches)
    assert quant.seen and all(seen == (torch.int64, torch.float32) for seen in quant.seen)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_batch_names_index(bad: float) -> None:
    batches = [torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)]
    batches[2][1, 3] = bad
    with pytest.raises(CalibrationDataError, match=r"batch 2: input\[0\] contains 1 NaN/Inf"):
        ModelQuantizer(W8A8).quantize_model(nn.Linear(4, 4), batches)


def test_empty_loader() -> None:
    with pytest.raises(CalibrationDataError, match="no batches"):
        ModelQuantizer(W8A8).quantize_model(nn.Linear(4, 4), [])


def test_missing_loader_when_needed() -> None:
    with pytest.raises(CalibrationDataError, match="activation calibration"):
        ModelQuantizer(W8A8).quantize_model(nn.Linear(4, 4))


def test_rejected_batch_names_index_and_cause() -> None:
    batches = [torch.randn(2, 4), torch.randn(2, 5)]
    with pytest.raises(CalibrationDataError, match=r"batch 1: the model rejected it \(RuntimeError") as info:
        ModelQuantizer(W8A8).quantize_model(nn.Linear(4, 4), batches)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_unsupported_batch_type() -> None:
    with pytest.raises(CalibrationDataError, match="batch 0: got a str"):
        run_batches(nn.Linear(2, 2), ["text"], "Calibration")
    with pytest.raises(CalibrationDataError, match="batch 0: empty tuple"):
        run_batches(nn.Linear(2, 2), [()], "Calibration")


def test_model_and_input_type_errors() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ModelQuantizer(W8A8).quantize_model("model", [torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no floating-point parameters"):
        ModelQuantizer(W8A8).quantize_model(nn.ReLU(), [torch.ones(1)])


class _Decoder(nn.Module):
    """Stands for a decoder LM: only its forward's signature matters here."""

    def forward(self, input_ids: torch.Tensor, cache: object = None, past_key_values: object = None,
                use_cache: bool = False) -> torch.Tensor:
        return input_ids


class _OldDecoder(nn.Module):
    def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
        return input_ids


class _OldBlock(nn.Module):
    def forward(self, hidden_states: torch.Tensor, layer_past: object = None) -> torch.Tensor:
        return hidden_states


def test_cache_keyword_is_read_from_the_signature_newest_name_first() -> None:
    """transformers 5.24 renamed past_key_values to cache (the old name is only a deprecated alias, absent from the
    signature): the name a model takes decides, the new one first when a forward lists both."""
    assert cache_keyword(_Decoder()) == "cache"
    assert cache_keyword(_OldDecoder()) == "past_key_values"
    assert cache_keyword(_OldBlock()) == "layer_past"
    assert cache_keyword(nn.Linear(2, 2)) is None


def test_output_cache_reads_either_output_field() -> None:
    new, old = object(), object()
    assert output_cache({"logits": torch.zeros(1), "cache": new}) is new
    assert output_cache({"logits": torch.zeros(1), "past_key_values": old}) is old
    assert output_cache({"logits": torch.zeros(1)}) is None
    assert output_cache((torch.zeros(1), old)) is None
