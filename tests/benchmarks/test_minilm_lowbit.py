"""benchmarks/minilm_lowbit.py (issue 32): the rows are at Quark's symmetric spec, and the table's ratios and
target lines are computed from the run's own rows (Quark's best of the same table)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import minilm_lowbit as bench
from quark_brevitas import ModelQuantizer
from quark_brevitas.config import Config


@pytest.mark.parametrize(("spec", "low", "high", "divisor"), [(bench.SPECS[0], -4, 3, 3.5),
                                                               (bench.SPECS[1], -2, 1, 1.5)])
def test_symmetric_rows_use_quarks_grid(spec: bench.Spec, low: int, high: int, divisor: float) -> None:
    """Every symmetric row quantizes on Quark's grid: codes -2^(b-1)..2^(b-1)-1 per group, min-max rows with
    ``scale = max|w| / (2^(b-1) - 1/2)`` (Quark's observer), computed here by hand."""
    for name in spec.symmetric:
        layer = spec.format().layer(bench.RECIPES[name])
        assert layer.weight.symmetric and layer.weight.narrow_range is False and layer.weight.group_size == spec.group
    weight = torch.randn(8, 2 * spec.group, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Linear(2 * spec.group, 8, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    config = Config(spec.format().layer(bench.RECIPES["round to nearest"]), pre_quant_opt_config=[])
    quant = ModelQuantizer(config).quantize_model(model)[0].quant_weight()
    groups = weight.reshape(8, 2, spec.group)
    scale = groups.abs().amax(-1, keepdim=True) / divisor
    expected = (torch.round(groups / scale).clamp(low, high) * scale).reshape(weight.shape)
    assert torch.allclose(quant.value.detach().reshape(weight.shape), expected, atol=1e-6)
    codes = quant.int().reshape(weight.shape)
    assert int(codes.min()) == low and int(codes.max()) == high


def test_asymmetric_rows_are_kept_apart() -> None:
    for spec in bench.SPECS:
        assert all(bench.RECIPES[name].symmetric for name in spec.symmetric)
        assert not any(bench.RECIPES[name].symmetric for name in spec.asymmetric)


def _scores(cosine: float) -> dict[str, float]:
    return {"cosine": cosine, "nn": 0.5, "seconds": 1.0}


def test_table_ratios_and_targets_come_from_the_run() -> None:
    int3 = bench.SPECS[0]
    quark = {("rtn", 3, 128, True): _scores(0.79), ("gptq", 3, 128, True): _scores(0.90),
             ("qronos", 3, 128, True): {"error": "ValueError: no"}}
    ours = {"round to nearest": _scores(0.789), "GPTQ": _scores(0.91), bench.BEST: _scores(0.955)}
    text, targets = bench.table(int3, True, ours, quark)
    assert "Quark's best: GPTQConfig" in text
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:-1]] for line in text.splitlines()
            if line.startswith("|") and "---" not in line}
    assert rows[bench.BEST][:3] == ["0.9550", "0.0450", "0.45"]  # 0.045 / Quark's best error 0.100
    assert rows["Quark 0.13 QronosConfig"][0].startswith("error: ValueError")
    assert rows["Quark 0.13 AutoRoundConfig"][0] == "error: not run"
    assert targets == [f"- target int3 g128: best cosine 0.9550 ({bench.BEST}) >= 0.95: True",
                       "- target int3 g128: round to nearest 0.7890 >= Quark's 0.7900: False",
                       f"- target int3 g128: best error 0.0450 ({bench.BEST}) <= half of Quark's best 0.1000: True "
                       "(ratio 0.45)"]


def test_asymmetric_table_has_no_targets() -> None:
    quark = {("gptq", 3, 128, False): _scores(0.93)}
    text, targets = bench.table(bench.SPECS[0], False, {"GPTQ, asymmetric": _scores(0.94)}, quark)
    assert "asymmetric" in text and targets == []


class _Finished:
    """A stand-in for Quark's finished process: its exit status and standard output."""

    def __init__(self, returncode: int, out: str) -> None:
        self.returncode, self.out = returncode, out

    def communicate(self) -> tuple[str, None]:
        return self.out, None


def test_quark_results_are_scored_by_our_code_and_survive_a_failed_process(tmp_path) -> None:
    import json

    embeddings = torch.ones(4, 3)
    torch.save(embeddings, tmp_path / "0.pt")
    answers = [{"embeddings": str(tmp_path / "0.pt"), "cpu_seconds": 2.0}, {"error": "ValueError: no"}]
    runs = [["rtn", 3, 128, True], ["gptq", 3, 128, True], ["qronos", 3, 128, True]]
    fake = bench.Bench(nn.Identity(), [], lambda m: {}, [], score_embeddings=lambda e: {"cosine": float(e.sum())})
    done = bench.quark_results(_Finished(0, json.dumps({"results": [*answers, answers[1]]}) + "\n"), runs, fake,
                               str(tmp_path))
    assert done[("rtn", 3, 128, True)] == {"cosine": 12.0, "seconds": 2.0}
    assert done[("gptq", 3, 128, True)] == {"error": "ValueError: no"}
    (tmp_path / "results.json").write_text(json.dumps({"results": answers}))
    cut = bench.quark_results(_Finished(1, ""), runs, fake, str(tmp_path))
    assert cut[("rtn", 3, 128, True)]["cosine"] == 12.0
    assert cut[("qronos", 3, 128, True)]["error"].startswith("Quark's process exited with 1")


def test_tie_arithmetic_codes() -> None:
    """``rtn_codes`` (the ``--tie-arithmetic`` table): a group's negative extreme is the tie ``-3.5`` steps, which the
    exact quotient sends to -4 (half to even) and the positive extreme to 3 (4 clamped); the float32 division is
    the library's round to nearest code for code; the reciprocal stays on the grid and within a step of exact."""
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    weight[0, 5] = -10.0  # group 0 of row 0: a negative extreme
    weight[1, 130] = 9.0  # group 1 of row 1: a positive extreme
    exact, scale = bench.rtn_codes(weight, 3, 128, "exact")
    assert exact[0, 5] == -4 and exact[1, 130] == 3
    assert torch.allclose(scale[0, :128], torch.full((128,), 10.0 / 3.5))
    divide, _ = bench.rtn_codes(weight, 3, 128, "divide")
    reciprocal, _ = bench.rtn_codes(weight, 3, 128, "reciprocal")
    for codes in (divide, reciprocal):
        assert codes.min() >= -4 and codes.max() <= 3 and (codes - exact).abs().max() <= 1
    model = nn.Sequential(nn.Linear(256, 16, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    config = Config(bench.SPECS[0].format().layer(bench.RECIPES["round to nearest"]), pre_quant_opt_config=[])
    library = ModelQuantizer(config).quantize_model(model)[0].quant_weight().int().reshape(weight.shape)
    assert torch.equal(library.float(), divide)
