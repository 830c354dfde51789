"""Brevitas's GPTQ (algos.GPTQ) with fewer passes and fewer layer computations, same weights (issue 20).

- Layers that read the same input tensor (q/k/v, gate/up) collect their Hessians in one pass
  (``brevitas_adapter.cache.SharedInputPass``): the weights equal those of Brevitas's own one-layer-per-pass
  ``gptq_mode``, bit for bit.
- Layers already optimised return the output they computed in an earlier pass while their input is equal
  (``brevitas_adapter.memo.LayerOutputs``): never a stale output (weights changed, input changed, output modified
  in place, quantizers switched), bounded memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.forward_calls import count_forward_calls  # noqa: E402
from helpers.llm_models import tiny_bert, tiny_llama, token_batches  # noqa: E402

from quark_brevitas import ModelQuantizer, algos  # noqa: E402
from quark_brevitas.algorithms import gpxq  # noqa: E402
from quark_brevitas.brevitas_adapter import LayerOutputs, layer_outputs_remembered, quantization_disabled  # noqa: E402
from quark_brevitas.calibration.data import BlockInputs, CalibrationData  # noqa: E402
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

INT4_CHANNEL = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel)


def _brevitas_sequential(model: nn.Module, *, act_order: bool) -> object:
    """Brevitas's own gptq_mode and GPTQ class: one layer per pass, Brevitas's Hessians and column loop."""
    from brevitas.graph.gptq import gptq_mode

    return gptq_mode(model, act_order=act_order, use_quant_activations=False, create_weight_orig=False)


def _gptq(model: nn.Module, batches: list, act_order: bool, monkeypatch: pytest.MonkeyPatch | None = None,
          exclude: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], int, int]:
    """GPTQ's weights, its number of passes over a block's data and of inputs it turned into Hessian products."""
    from brevitas.graph.gpxq import GPxQ

    passes, products = [0], [0]
    process_input = GPxQ.process_input

    def processed(self: GPxQ, inputs: object) -> object:
        products[0] += 1
        return process_input(self, inputs)

    def counting(original: object) -> object:
        def counted(self: CalibrationData, model: nn.Module, desc: str, **kwargs: object) -> int:
            passes[0] += desc == "GPTQ"
            return original(self, model, desc, **kwargs)

        return counted

    with pytest.MonkeyPatch.context() as patch:
        for owner in (BlockInputs, CalibrationData):  # block by block, whole model
            patch.setattr(owner, "forward", counting(owner.forward))
        patch.setattr(GPxQ, "process_input", processed)
        if monkeypatch is not None:  # the reference: Brevitas's sequence, nothing remembered
            patch.setattr(gpxq, "gptq_mode", _brevitas_sequential)
            patch.setattr(gpxq.GPTQHandler, "remembers_outputs", False)
        torch.set_num_threads(1)
        config = Config(QuantizationConfig(weight=INT4_CHANNEL), pre_quant_opt_config=[],
                        algo_config=[algos.GPTQ(act_order=act_order)], exclude=list(exclude))
        quant = ModelQuantizer(config).quantize_model(model, batches)
    weights = {name: p.detach().clone() for name, p in quant.named_parameters() if name.endswith("weight")}
    return weights, passes[0], products[0]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_shared_input_passes_give_brevitas_sequential_weights(family: str, act_order: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    build = {"llama": lambda: tiny_llama(2), "bert": lambda: tiny_bert(2)}[family]
    batches = token_batches(3) if family == "llama" else [{"input_ids": b} for b in token_batches(3)]
    exclude = ("lm_head",) if family == "llama" else ()
    ours, our_passes, our_products = _gptq(build(), batches, act_order, exclude=exclude)
    reference, reference_passes, reference_products = _gptq(build(), batches, act_order, monkeypatch,
                                                            exclude=exclude)
    assert ours.keys() == reference.keys()
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name
    # Llama block: q/k/v, o, gate/up, down (4 passes, 7 layers); BERT block: q/k/v, o, intermediate, output (4, 6).
    layers = 7 if family == "llama" else 6
    assert reference_passes == 2 * layers + (1 if family == "bert" else 0)  # BERT's pooler is a unit of its own
    assert our_passes == 2 * 4 + (1 if family == "bert" else 0)
    # One Hessian product per batch for the layers of a group (q/k/v: one instead of three; gate/up: one).
    blocks, batches_per_pass = 2, 3
    assert reference_products == blocks * batches_per_pass * layers + (batches_per_pass if family == "bert" else 0)
    assert our_products == blocks * batches_per_pass * 4 + (batches_per_pass if family == "bert" else 0)


class _Twice(nn.Module):
    """Two layers on the same tensor object; when ``in_place``, the first's output is added to it in place before
    the second reads it, so the second's input depends on the first's weights (one group would be wrong)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 0
        y = self.first(h)
        if self.in_place:
            h.add_(y)
        return y + self.second(h)


@pytest.mark.parametrize("in_place", [False, True])
def test_an_input_changed_in_place_is_not_shared(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    batches = [torch.randn(64, 16) for _ in range(3)]

    def build() -> nn.Module:
        torch.manual_seed(1)
        return _Twice(in_place)

    ours, our_passes, _ = _gptq(build(), batches, False)
    reference, reference_passes, _ = _gptq(build(), batches, False, monkeypatch)
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name
    assert reference_passes == 2 and our_passes == (2 if in_place else 1)


# ===================================================================== the memo itself
def _layer() -> nn.Module:

    config = Config(QuantizationConfig(weight=INT4_CHANNEL), pre_quant_opt_config=[])
    torch.manual_seed(0)
    return ModelQuantizer(config).quantize_model(nn.Sequential(nn.Linear(8, 4)), [torch.randn(4, 8)])


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, list[int]]:
    """A one-layer quantized model and the count of its layer's real computations (its class's forward)."""
    model = _layer()
    return model, count_forward_calls(monkeypatch, type(model[0]))


def test_memo_returns_earlier_outputs_only_while_valid(counted: tuple[nn.Module, list[int]]) -> None:
    model, runs = counted
    layer = model[0]
    x = torch.randn(5, 8)
    with torch.no_grad(), layer_outputs_remembered(model) as memo:
        first = model(x)
        memo.new_pass()
        assert torch.equal(model(x.clone()), first) and runs[0] == 1  # equal input: remembered
        memo.new_pass()
        assert not torch.equal(model(x + 1), first) and runs[0] == 2  # another input: computed
        memo.new_pass()
        model(x + 1)
        assert runs[0] == 2
        memo.forget([layer])
        layer.weight.data.mul_(2)  # GPTQ writes through .data: only forget() can tell
        memo.new_pass()
        doubled = model(x + 1)
        assert runs[0] == 3
        memo.new_pass()
        doubled.add_(1)  # the remembered output modified in place downstream: not reused
        model(x + 1)
        assert runs[0] == 4
        memo.new_pass()
        with quantization_disabled(model):  # quantizers switched off: another output
            float_out = model(x + 1)
        assert runs[0] == 5
        assert torch.allclose(float_out, nn.functional.linear(x + 1, layer.weight, layer.bias))
    with torch.no_grad():
        model(x + 1)
    assert runs[0] == 6 and "forward" not in layer.__dict__  # the context is gone


def test_memo_stays_within_its_budget_and_skips_gradients(counted: tuple[nn.Module, list[int]]) -> None:
    model, runs = counted
    x = torch.randn(5, 8)
    one_call = x.numel() * 4 + 5 * 4 * 4
    with torch.no_grad(), layer_outputs_remembered(model, budget_bytes=one_call) as memo:
        model(x)
        model(x + 1)  # the second call's entry does not fit
        assert memo.used == one_call
        memo.new_pass()
        model(x)
        model(x + 1)
        assert runs[0] == 3
    with layer_outputs_remembered(model) as memo:
        model(x).sum().backward()  # training path: never remembered
        assert memo.used == 0 and isinstance(memo, LayerOutputs)


def test_memo_budget_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from quark_brevitas.brevitas_adapter import memo as memo_module

    model = _layer()
    monkeypatch.setattr(memo_module, "LAYER_OUTPUT_BUDGET", 0)
    x = torch.randn(5, 8)
    with torch.no_grad(), layer_outputs_remembered(model) as memo:
        model(x)
        assert memo.used == 0 and memo.budget == 0


def test_memo_keeps_nothing_new_in_a_last_pass(counted: tuple[nn.Module, list[int]]) -> None:
    model, runs = counted
    x = torch.randn(5, 8)
    with torch.no_grad(), layer_outputs_remembered(model) as memo:
        memo.new_pass(keep_new=False)
        model(x)
        assert memo.used == 0
        memo.new_pass()
        model(x)
        model(x)
        assert runs[0] == 3 and memo.used > 0  # kept now (the second call is call 1 of the pass: a new entry)


@pytest.mark.parametrize("offload", [None, "disk"])
def test_offloading_activations_turns_the_memo_off(offload: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who offloads the cached activations to disk asked for memory: GPTQ keeps no layer outputs then."""
    from quark_brevitas.brevitas_adapter import LAYER_OUTPUT_BUDGET

    budgets: list[int] = []
    original = LayerOutputs.__init__

    def recorded(self: LayerOutputs, budget_bytes: int) -> None:
        budgets.append(budget_bytes)
        original(self, budget_bytes)

    monkeypatch.setattr(LayerOutputs, "__init__", recorded)
    config = Config(QuantizationConfig(weight=INT4_CHANNEL), pre_quant_opt_config=[], algo_config=[algos.GPTQ()],
                    exclude=["lm_head"])
    ModelQuantizer(config).quantize_model(tiny_llama(2), token_batches(2), offload=offload)
    assert budgets == [0 if offload else LAYER_OUTPUT_BUDGET] * 2  # one GPTQ run per block


def test_group_starts_are_each_groups_first_column_in_processing_order() -> None:
    """GPTQConfig's dynamic groups start where the permuted column order first reaches each group (worked out once
    per layer instead of per column); columns of groups already started (Qronos's first column) are left out."""
    from quark_brevitas.algorithms.gptq import ColumnRounding

    perm = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])  # groups of 2: 5->2, 0->0, 7->3, 2->1, ...

    def state(dynamic: bool, started: set[int]) -> ColumnRounding:
        return ColumnRounding(work=torch.zeros(1, 8), grid=None, perm=perm, inverse_perm=torch.argsort(perm),
                              scale_source=torch.zeros(1, 8), grid_for=None, group_size=2, dynamic=dynamic,
                              quantized=torch.zeros(1, 8), losses=torch.zeros(1), groups_started=set(started))

    assert state(True, set()).group_starts() == {0, 1, 2, 3}
    assert state(True, {2}).group_starts() == {1, 2, 3}  # group 2 (column 0's) already started
    assert state(False, set()).group_starts() == set()
