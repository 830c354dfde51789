"""Test helper: an exported file's predictions and accuracy match the PyTorch model's in onnxruntime."""

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
