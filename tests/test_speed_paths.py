"""Issue 20's faster paths give the results of the paths they replace (and stay fast where it is structural).

- A calibration pass registers no hook per batch (the failing module is read from the exception's traceback).
- AWQ judges a group's own Linear layer from the Gram matrix of its inputs: the same error as running it, and the
  same chosen scales (hence the same codes) as the per-call forward it replaces.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.llm_models import tiny_llama, token_batches  # noqa: E402

from quark_brevitas.algorithms import awq  # noqa: E402
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.calibration.data import CalibrationData, CalibrationDataError  # noqa: E402
from quark_brevitas.config import AWQConfig, Config, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402


def _hooks_registered(monkeypatch: pytest.MonkeyPatch, batches: int) -> int:
    count = [0]
    original = nn.Module.register_forward_hook

    def counting(self: nn.Module, *args: object, **kwargs: object) -> object:
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "register_forward_hook", counting)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    CalibrationData([torch.randn(3, 4) for _ in range(batches)]).forward(model, "test pass")
    monkeypatch.undo()
    return count[0]


def test_a_calibration_pass_registers_no_hook_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _hooks_registered(monkeypatch, 2) == _hooks_registered(monkeypatch, 20) == 0


def test_a_failing_batch_still_names_the_innermost_module() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(5, 2)))
    with pytest.raises(CalibrationDataError, match=r"batch 0: the model rejected it in module '1\.1'") as info:
        CalibrationData([torch.randn(3, 4)]).forward(model, "test pass")
    assert info.value.module == "1.1"


def test_gram_error_equals_the_error_of_running_the_layer() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(24, 10)
    calls = [((torch.randn(2, 7, 24),), {}), ((), {"input": torch.randn(5, 24)}), ((torch.randn(1, 3, 24) * 9,), {})]
    candidate = layer.weight.detach() + 0.01 * torch.randn(10, 24)
    layer.requires_grad_(False)
    direct, elements = 0.0, 0
    for args, kwargs in calls:
        x = args[0] if args else kwargs["input"]
        difference = nn.functional.linear(x, candidate, layer.bias) - layer(x)
        direct += float(difference.double().pow(2).sum())
        elements += difference.numel()
    sse, count = awq._LinearError.of(calls, layer.weight).error(candidate).tolist()
    assert count == elements == (14 + 5 + 3) * 10
    assert sse == pytest.approx(direct, rel=1e-5)


def _awq_weights() -> dict[str, torch.Tensor]:
    spec = QuantizationSpec(dtype=Dtype.uint4, symmetric=False, qscheme=QSchemeType.per_group, group_size=32)
    config = Config(QuantizationConfig(weight=spec), pre_quant_opt_config=[], algo_config=[AWQConfig(group_size=32)],
                    exclude=["lm_head"])
    torch.set_num_threads(1)
    model = ModelQuantizer(config).quantize_model(tiny_llama(1), token_batches(2))
    return {name: p.detach().clone() for name, p in model.named_parameters() if "layers" in name}


def test_awq_gram_search_chooses_what_running_the_layers_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _awq_weights()
    monkeypatch.setattr(awq, "is_linear", lambda _module: False)  # every inspected module run on its calls
    slow = _awq_weights()
    assert fast.keys() == slow.keys() and any("o_proj" in name for name in fast)
    for name, value in fast.items():
        assert torch.equal(value, slow[name]), name


def _gptq_weights(spec: QuantizationSpec, act_order: bool) -> dict[str, torch.Tensor]:
    from helpers.llm_models import tiny_bert

    from quark_brevitas import algos

    torch.set_num_threads(1)
    config = Config(QuantizationConfig(weight=spec), pre_quant_opt_config=[],
                    algo_config=[algos.GPTQ(act_order=act_order)])
    model = ModelQuantizer(config).quantize_model(tiny_bert(1), [{"input_ids": b} for b in token_batches(2)])
    return {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("weight")}


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("spec", [QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_channel),
                                  QuantizationSpec(dtype=Dtype.uint4, symmetric=False, qscheme=QSchemeType.per_group,
                                                   group_size=32)], ids=["int4_channel", "uint4_g32"])
def test_brevitas_gptq_on_a_fixed_grid_equals_brevitas_column_loop(monkeypatch: pytest.MonkeyPatch,
                                                                   spec: QuantizationSpec, act_order: bool) -> None:
    from quark_brevitas.brevitas_adapter import cache

    used = [0]
    original = cache.columns_in_order

    def counted(*args: object) -> None:
        used[0] += 1
        original(*args)

    monkeypatch.setattr(cache, "columns_in_order", counted)
    fast = _gptq_weights(spec, act_order)
    assert used[0] > 0  # the fast path ran
    monkeypatch.setattr(cache, "fixed_weight_grid", lambda _layer: None)  # Brevitas's own loop, column by column
    used[0] = 0
    slow = _gptq_weights(spec, act_order)
    assert used[0] == 0
    assert fast.keys() == slow.keys()
    for name, value in fast.items():
        assert torch.equal(value, slow[name]), name


def test_brevitas_gptq_on_float_weights_takes_brevitas_column_loop() -> None:
    """Minifloat weights have no integer grid: the fixed-grid path steps aside (it raised before) and GPTQ runs."""
    from quark_brevitas import ModelQuantizer, algos
    from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec
    from quark_brevitas.types import QuantType

    fp8 = QuantizationSpec(quant_type=QuantType.float_quant, bit_width=8, exponent_bit_width=4, mantissa_bit_width=3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    batches = [torch.randn(32, 16) for _ in range(2)]
    rtn = ModelQuantizer(Config(QuantizationConfig(weight=fp8), pre_quant_opt_config=[])).quantize_model(model, batches)
    gptq = ModelQuantizer(Config(QuantizationConfig(weight=fp8), pre_quant_opt_config=[],
                                 algo_config=[algos.GPTQ()])).quantize_model(model, batches)
    assert not torch.equal(gptq[0].quant_weight().value, rtn[0].quant_weight().value)  # GPTQ changed the weights
