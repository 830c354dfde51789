"""Test helpers: an exported file's predictions and accuracy match the PyTorch model's in onnxruntime; an exported
decoder decodes like the PyTorch model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from quark_brevitas.cli.digits import evaluate, evaluate_predictions
from quark_brevitas.export import run_onnx


def assert_onnx_predictions_match(model: nn.Module, path: Path, loader) -> None:
    """Argmax agreement >= 99.5 % over ``loader`` and accuracies within half a point."""
    torch_predictions, ort_predictions = [], []
    for images, _ in loader:
        with torch.no_grad():
            torch_predictions.append(model(images).argmax(1).numpy())
        ort_predictions.append(run_onnx(path, images)[0].argmax(1))
    agreement = float(np.mean(np.concatenate(torch_predictions) == np.concatenate(ort_predictions)))
    assert agreement >= 0.995, agreement
    ort_accuracy = evaluate_predictions(lambda x: run_onnx(path, torch.from_numpy(x))[0], loader)
    assert abs(ort_accuracy - evaluate(model, loader)) <= 0.5


def assert_decodes_like_pytorch(path: Path, model: nn.Module, prompt: torch.Tensor, steps: int = 4,
                                atol: float = 1e-4) -> None:
    """A decoder exported with ``past_key_values=True`` decodes like the PyTorch model: the prompt, then one token a
    step (the presents fed back as pasts), every step's logits within ``atol`` of the model's own incremental
    decoding with its cache."""
    import onnx

    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    names = [o.name for o in onnx.load(str(path)).graph.output]
    feed = {"input_ids": prompt.numpy(), "attention_mask": np.ones_like(prompt.numpy())}
    for i in range(layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((prompt.shape[0], kv_heads, 0, config.hidden_size // heads),
                                                           np.float32)
    tokens, mask = prompt, torch.ones_like(prompt)
    with torch.no_grad():
        cache = None
        for _ in range(steps):
            outputs = dict(zip(names, run_onnx(path, feed)))
            step = model(input_ids=tokens, attention_mask=mask, use_cache=True,
                         **({} if cache is None else {"cache": cache}))
            cache = step.get("cache", step.get("past_key_values"))
            np.testing.assert_allclose(outputs["logits"], step.logits.numpy(), rtol=0, atol=atol)
            tokens = step.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
            feed = {"input_ids": tokens.numpy(), "attention_mask": mask.numpy()}
            for i in range(layers):
                for kind in ("key", "value"):
                    feed[f"past_key_values.{i}.{kind}"] = outputs[f"present.{i}.{kind}"]
