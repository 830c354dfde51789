"""The block-by-block data phase against the whole-model path (the independent reference it must match)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig, algos  # noqa: E402
from quark_brevitas.blocks.capture import replayable  # noqa: E402
from quark_brevitas.blocks.stack import RUN_STACK, find_block_stack  # noqa: E402
from quark_brevitas.blocks.store import ActivationStore  # noqa: E402
from quark_brevitas.checkpoint import load_quantized, save_quantized  # noqa: E402
from quark_brevitas.errors import ModelError  # noqa: E402
from quark_brevitas.export.intweights import integer_weights  # noqa: E402
from quark_brevitas.types import QSchemeType  # noqa: E402

W4_CHANNEL = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=4)
GPTQ_W4 = Config(QLayerConfig(weight=W4_CHANNEL), pre_quant_opt_config=[], algo_config=[algos.GPTQ()])


def tiny_llama(layers: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def token_batches(count: int = 3, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (2, 12), generator=generator)} for _ in range(count)]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama(3)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_detects_hugging_face_stacks(llama) -> None:
    assert find_block_stack(llama) == "model.layers"
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2,
                                                          num_attention_heads=2, intermediate_size=32))
    assert find_block_stack(bert) == "encoder.layer"
    assert find_block_stack(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) is None  # not a Hugging Face model


def test_weight_only_gptq_equals_whole_model_path(llama, caplog) -> None:
    """Block by block, GPTQ sees the same layer inputs as on the whole model (earlier blocks quantized):
    the quantized weights must be identical."""
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="quark_brevitas"):
        blockwise = ModelQuantizer(GPTQ_W4).quantize_model(llama, token_batches())
    assert "Calibrating block by block (3 blocks in model.layers)" in caplog.text
    whole = ModelQuantizer(GPTQ_W4).quantize_model(llama, token_batches(), blocks=False)
    assert_same_state(blockwise, whole)
    assert type(blockwise.lm_head).__name__ == "QuantLinear"
    # The caller's model is untouched (no quantized layer, same values).
    assert not any(type(m).__name__.startswith("Quant") for m in llama.modules())
    assert all(torch.equal(before[k], v) for k, v in llama.state_dict().items())
    # GPTQ changed the rounding: the weights differ from round-to-nearest.
    rtn = ModelQuantizer(Config(QLayerConfig(weight=W4_CHANNEL), pre_quant_opt_config=[])).quantize_model(llama)
    q_gptq = integer_weights(blockwise)["model.layers.1.mlp.down_proj"].int_weight
    q_rtn = integer_weights(rtn)["model.layers.1.mlp.down_proj"].int_weight
    assert not torch.equal(q_gptq, q_rtn)


def _block_calls(model: nn.Module, **kwargs) -> int:
    calls = []

    def count(module: nn.Module, args: tuple) -> None:
        if type(module).__name__ == "LlamaDecoderLayer":
            calls.append(1)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        ModelQuantizer(GPTQ_W4).quantize_model(model, token_batches(2), **kwargs)
    finally:
        handle.remove()
    return len(calls)


def test_forward_work_is_linear_in_depth() -> None:
    """Block calls per depth: the engine runs each block a fixed number of times (one pass per layer in it,
    plus its outputs); the whole-model path replays every earlier block for every layer."""
    shallow, deep = tiny_llama(2), tiny_llama(4)
    assert _block_calls(deep) == 2 * _block_calls(shallow)
    assert _block_calls(deep, blocks=False) > 3 * _block_calls(shallow, blocks=False)


def test_config_hierarchy_uses_full_names(llama) -> None:
    w8 = QTensorConfig(qscheme=QSchemeType.per_channel, bit_width=8)
    config = Config(QLayerConfig(weight=W4_CHANNEL), pre_quant_opt_config=[], algo_config=[algos.GPTQ()],
                    layer_quant_config={"model.layers.0.self_attn.q_proj": QLayerConfig(weight=w8)},
                    exclude=["model.layers.1.mlp.down_proj", "lm_head"])
    quant = ModelQuantizer(config).quantize_model(llama, token_batches())
    codes = integer_weights(quant)
    assert codes["model.layers.0.self_attn.q_proj"].bit_width == 8
    assert codes["model.layers.1.self_attn.q_proj"].bit_width == 4
    assert type(quant.model.layers[1].mlp.down_proj) is nn.Linear
    assert type(quant.lm_head) is nn.Linear
    assert torch.equal(quant.lm_head.weight, llama.lm_head.weight)


def test_w8a8_with_equalization_and_bias_correction_round_trips(llama, tmp_path) -> None:
    int8 = QTensorConfig()
    config = Config(QLayerConfig(weight=QTensorConfig(qscheme=QSchemeType.per_channel), input_tensors=int8),
                    pre_quant_opt_config=[algos.ActivationEqualization()],
                    algo_config=[algos.GPTQ(), algos.BiasCorrection()])
    batches = token_batches(4)
    quant = ModelQuantizer(config).quantize_model(llama, batches)
    whole = ModelQuantizer(config).quantize_model(llama, batches, blocks=False)
    ids = token_batches(1, seed=7)[0]["input_ids"]
    with torch.no_grad():
        reference = llama(ids).logits
        error = (quant(ids).logits - reference).abs().mean()
        whole_error = (whole(ids).logits - reference).abs().mean()
    assert 0 < error < 0.05 * reference.abs().mean()
    assert error < 1.5 * whole_error
    # Every activation quantizer, the lm_head's included, was calibrated: its scale is in the state dict.
    assert "lm_head.layer.input_quant.fused_activation_quant_proxy.tensor_quant.scaling_impl.value" in \
        quant.state_dict()
    save_quantized(quant, tmp_path / "ckpt")
    loaded = load_quantized(llama, tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, quant(ids).logits)


def test_encoder_with_head_and_keyword_mask() -> None:
    """BERT: the blocks take the attention mask; the pooler and the classifier come after the blocks."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3)
    bert = transformers.BertForSequenceClassification(config).eval()
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, 6:] = 0
        batches.append({"input_ids": torch.randint(0, 40, (2, 10), generator=generator), "attention_mask": mask})
    full = Config(QLayerConfig(weight=W4_CHANNEL, input_tensors=QTensorConfig()), pre_quant_opt_config=[],
                  algo_config=[algos.GPTQ()])
    quant = ModelQuantizer(full).quantize_model(bert, batches)
    whole = ModelQuantizer(full).quantize_model(bert, batches, blocks=False)
    assert type(quant.classifier).__name__ == "QuantLinear" and type(quant.bert.pooler.dense).__name__ == "QuantLinear"
    with torch.no_grad():
        reference = bert(**batches[0]).logits
        error = (quant(**batches[0]).logits - reference).abs().max()
        whole_error = (whole(**batches[0]).logits - reference).abs().max()
    assert error < 2 * whole_error + 1e-3
    # Weight-only: identical to the whole-model path, padding mask included.
    weight_only = ModelQuantizer(GPTQ_W4).quantize_model(bert, batches)
    assert_same_state(weight_only, ModelQuantizer(GPTQ_W4).quantize_model(bert, batches, blocks=False))


class Stack(nn.Module):
    """Not a Hugging Face model: a Linear before the blocks, a head after them, a keyword scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, h: torch.Tensor, scale: float) -> torch.Tensor:
        return h + scale * self.fc2(torch.relu(self.fc1(h)))


def test_named_stack_with_layers_before_and_after(caplog) -> None:
    model = Stack().eval()
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with caplog.at_level(logging.INFO, logger="quark_brevitas"):
        named = ModelQuantizer(GPTQ_W4).quantize_model(model, batches, blocks="blocks")
    assert "Layer outside the blocks: stem" in caplog.text and "Layer outside the blocks: head" in caplog.text
    assert_same_state(named, ModelQuantizer(GPTQ_W4).quantize_model(model, batches))  # not detected: whole model


def test_offload_to_disk_gives_the_same_model(llama, tmp_path) -> None:
    memory = ModelQuantizer(GPTQ_W4).quantize_model(llama, token_batches())
    disk = ModelQuantizer(GPTQ_W4).quantize_model(llama, token_batches(), offload=tmp_path / "acts")
    assert_same_state(memory, disk)
    assert not any((tmp_path / "acts").iterdir())  # every store removed its files


def test_store_spills_beyond_its_budget(tmp_path) -> None:
    store = ActivationStore(memory_budget=100)
    values = [torch.full((10,), float(i)) for i in range(4)]  # 40 bytes each
    for value in values:
        store.append(value)
    assert store.on_disk == 2
    assert all(torch.equal(store[i], values[i]) for i in range(4))
    spill = store._temporary
    store.close()
    assert not spill.exists()


def test_gpfq_keeps_whole_model_path(llama, caplog) -> None:
    config = Config(QLayerConfig(weight=W4_CHANNEL, input_tensors=QTensorConfig()), pre_quant_opt_config=[],
                    algo_config=[algos.GPFQ()])
    with caplog.at_level(logging.INFO, logger="quark_brevitas"):
        ModelQuantizer(config).quantize_model(llama, token_batches(2))
    assert "Calibrating the whole model at once: GPFQ needs the whole model" in caplog.text
    with pytest.raises(ModelError, match="cannot calibrate block by block: GPFQ"):
        ModelQuantizer(config).quantize_model(llama, token_batches(2), blocks="model.layers")


@pytest.mark.parametrize(("blocks", "message"), [("model.nope", "has no submodule"),
                                                 ("model.norm", "must name a non-empty nn.ModuleList")])
def test_bad_block_names(llama, blocks, message) -> None:
    with pytest.raises(ModelError, match=message):
        ModelQuantizer(GPTQ_W4).quantize_model(llama, token_batches(1), blocks=blocks)


def test_blocks_true_without_a_stack() -> None:
    with pytest.raises(ModelError, match="no stack of repeated blocks"):
        ModelQuantizer(GPTQ_W4).quantize_model(nn.Sequential(nn.Linear(4, 4)), [torch.randn(2, 4)], blocks=True)


def test_one_stack_finder_for_the_pipeline_and_the_algorithms() -> None:
    """The algorithms' decoder layers and the pipeline's block stack come from one finder: a Hugging Face model
    with two stacks (encoder-decoder) is ambiguous for both (the algorithms used to pick the decoder alone)."""
    from quark_brevitas.algorithms.structure import model_structure

    bart = transformers.BartModel(transformers.BartConfig(vocab_size=32, d_model=16, encoder_layers=2, decoder_layers=2,
                                                          encoder_attention_heads=2, decoder_attention_heads=2,
                                                          encoder_ffn_dim=32, decoder_ffn_dim=32))
    assert model_structure(bart, want_scaling=False).decoder_layers is None
    assert find_block_stack(bart) is None and find_block_stack(bart, policy=RUN_STACK) is None
    one = transformers.BertModel(transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=32))
    assert find_block_stack(one) == model_structure(one, want_scaling=False).decoder_layers == "encoder.layer"
    assert find_block_stack(one, policy=RUN_STACK) is None  # one block: the pipeline keeps the whole-model path


@pytest.mark.parametrize("keyword", ["cache", "past_key_values", "past_key_value", "layer_past"])
def test_replayable_drops_a_cache_under_any_transformers_name(keyword: str) -> None:
    """A legacy tuple cache is no Cache object: it is dropped by its keyword, which transformers 5.24 renamed to
    ``cache`` (a block replayed on a cache would append to it on every call)."""
    past = ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)),)
    hidden = torch.ones(1, 3, 8)
    args, kwargs = replayable((hidden,), {keyword: past, "use_cache": True, "attention_mask": None})
    assert args[0] is hidden
    assert kwargs == {keyword: None, "use_cache": False, "attention_mask": None}
