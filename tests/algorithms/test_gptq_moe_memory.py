"""GPTQ block by block on mixture-of-experts models in bounded memory (issue 30): the peak of the tensors the run
holds beyond the float model stays below twice one block's weights, and the rounded weights are those of passes
over whole blocks."""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.memory import peak_tensor_bytes  # noqa: E402

from quark_brevitas import ModelQuantizer  # noqa: E402
from quark_brevitas.algorithms import narrowing  # noqa: E402
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec  # noqa: E402
from quark_brevitas.config.algorithms import GPTQConfig  # noqa: E402
from quark_brevitas.model_parts.moe import unfuse_experts  # noqa: E402
from quark_brevitas.types import Dtype, QSchemeType  # noqa: E402

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               num_experts_per_tok=2, max_position_embeddings=64)


def _moe(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**_COMMON, intermediate_size=128,
                                                                           num_local_experts=8))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **_COMMON, intermediate_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            num_experts=8))
    unfuse_experts(model)
    return model.eval()


def _config() -> Config:
    weight = QuantizationSpec(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=32)
    return Config(QuantizationConfig(weight=weight), pre_quant_opt_config=[], algo_config=[GPTQConfig()],
                  exclude=["lm_head"])


def _calibration() -> list[dict[str, torch.Tensor]]:
    # 1024 tokens: as many activations per block weight as the benchmark's 4096 tokens of a 256-wide Mixtral
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 256, (2, 64), generator=generator)} for _ in range(8)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gptq_block_by_block_holds_less_than_twice_one_block(family: str) -> None:
    model = _moe(family)
    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    calibration = _calibration()
    quantizer = ModelQuantizer(_config())
    quantizer.quantize_model(copy.deepcopy(model), calibration, blocks=True, inplace=True)  # imports, first uses
    peak = peak_tensor_bytes(lambda: quantizer.quantize_model(model, calibration, blocks=True, inplace=True))
    assert peak < 2 * block, f"{family}: peak {peak / block:.2f} x one block's weights ({block} bytes)"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_narrowed_passes_round_as_passes_over_whole_blocks(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _moe(family)
    calibration = _calibration()
    narrowed = ModelQuantizer(_config()).quantize_model(model, calibration, blocks=True)
    monkeypatch.setattr(narrowing.Narrowing, "narrow", lambda self, remaining, memo: None)
    whole = ModelQuantizer(_config()).quantize_model(model, calibration, blocks=True)
    expected = whole.state_dict()
    for key, value in narrowed.state_dict().items():
        assert torch.equal(value, expected[key]), key
    with torch.no_grad():
        assert torch.equal(narrowed(**calibration[0]).logits, whole(**calibration[0]).logits)
