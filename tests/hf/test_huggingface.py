"""A Hugging Face BERT-style model, fed with real tokenizer dicts, through the default Config."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig  # noqa: E402

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "quick", "brown", "fox", "jumps", "over"]
SENTENCES = ["the cat sat on the mat", "a quick brown fox jumps over the dog", "the dog ran far",
             "a cat ran over the mat", "the quick dog sat", "a brown fox ran far over the mat"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


@pytest.fixture(scope="module")
def bert(tokenizer):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                     num_labels=3)
    return transformers.BertForSequenceClassification(config).eval()


@pytest.mark.slow
def test_default_config_quantizes_bert_with_tokenizer_dicts(bert, tokenizer, caplog) -> None:
    batches = [tokenizer(SENTENCES[i:i + 2], padding=True, return_tensors="pt") for i in range(0, 6, 2)]
    assert batches[0]["input_ids"].dtype == torch.int64
    config = Config(global_quant_config=QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(),
                                                     bias=QTensorConfig(bit_width=32)))
    with caplog.at_level("DEBUG", logger="quark_brevitas"):
        quant = ModelQuantizer(config).quantize_model(bert, batches)
    # The default Preprocess skips its graph steps on a Hugging Face model (the forward has optional inputs, so it
    # is not traced at all): expected for every Hugging Face run, so a debug line, not a warning (issue 27).
    preprocess = [r for r in caplog.records if r.getMessage().startswith("Preprocess:")]
    assert [r.levelname for r in preprocess] == ["DEBUG"]
    assert "skipped" in preprocess[0].getMessage()
    n_linear = sum(type(m).__name__ == "Linear" for m in bert.modules())
    assert sum(type(m).__name__ == "QuantLinear" for m in quant.modules()) == n_linear
    assert not any(type(m).__name__ == "QuantLinear" for m in bert.modules())  # the caller's model is intact
    with torch.no_grad():
        ref = bert(**batches[0]).logits
        out = quant(**batches[0]).logits
    assert not torch.equal(ref, out)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max() + 1e-3
