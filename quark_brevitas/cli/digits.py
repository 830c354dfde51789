"""The built-in example: a small CNN trained on scikit-learn's digits data set.

``quark-brevitas quantize`` with no arguments, the examples and most end-to-end tests need a real,
trained model with real data to calibrate on and to measure accuracy with. scikit-learn's digits
set (:func:`sklearn.datasets.load_digits`, 1797 grey 8x8 images of the digits 0-9) fits that
role well:

* it ships inside the scikit-learn wheel, so nothing is downloaded at run time (the library must
  work offline and in sandboxed CI);
* a two-convolution network reaches ~98 % test accuracy after a few seconds of CPU training, so a
  fresh model can be trained on demand instead of storing weights in the repository;
* the network still has convolutions, BatchNorm, pooling and linear layers, so quantization,
  BatchNorm merging and ONNX export are exercised on the layer types that matter, and the int8
  accuracy drop is measurable rather than lost in noise.

Everything here is deterministic for a given ``seed``: the train/test split, the calibration
subset and the training run (data order and initialisation are drawn from explicitly seeded
generators, so results do not depend on what else consumed random numbers before; training runs
on a fixed number of threads, so the weights do not depend on the host's core count either).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from tqdm.auto import tqdm

__all__ = [
    "NUM_CLASSES",
    "PIXEL_MAX",
    "TEST_FRACTION",
    "DigitsCNN",
    "DigitsData",
    "evaluate",
    "evaluate_predictions",
    "example_input",
    "fine_tune",
    "load_digits_data",
    "train_digits_cnn",
]

logger = logging.getLogger(__name__)

#: Raw digits pixels are integers in ``0..16``; dividing by this maps them to ``[0, 1]``.
PIXEL_MAX: float = 16.0
#: Number of digit classes.
NUM_CLASSES: int = 10
#: Fraction of the 1797 images held out (stratified) for testing.
TEST_FRACTION: float = 0.25


@dataclass(frozen=True)
class DigitsData:
    """Train, calibration and test loaders over the digits set.

    Batches are ``(images, target)`` tuples, Quark's calibration convention: ``images`` is a
    float32 tensor of shape ``[B, 1, 8, 8]`` (pixels scaled to ``[0, 1]`` and then standardised with
    the train split's ``mean``/``std``), ``target`` is an int64 tensor of shape ``[B]``.

    ``calib`` draws from the *train* split only, so calibrating never peeks at the test images
    that accuracy is measured on. ``mean``/``std`` are kept so that raw images can be normalised the
    same way (``(pixels / PIXEL_MAX - mean) / std``).
    """

    train: DataLoader
    calib: DataLoader
    test: DataLoader
    mean: float = 0.0
    std: float = 1.0


def load_digits_data(batch_size: int = 64, calib_size: int = 256, seed: int = 0) -> DigitsData:
    """Split the digits set into train/calib/test loaders, deterministically for ``seed``.

    The test split is a stratified 25 % hold-out (450 images for the full set), so every class is
    represented in proportion and accuracy numbers are comparable across seeds. Inputs are
    standardised with one scalar mean/std computed on the train split only (no test leakage);
    standardised inputs are roughly centred on zero, which suits the signed symmetric int8
    quantizers that are the library's default better than a ``[0, 1]`` range would.

    The train loader shuffles with its own seeded generator; :func:`train_digits_cnn` does not rely
    on its state (it re-creates the order from its own ``seed``). ``calib`` and ``test`` are not
    shuffled, so calibration and evaluation see identical batches on every run.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if calib_size < 1:
        raise ValueError(f"calib_size must be >= 1, got {calib_size}")

    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / PIXEL_MAX)[:, None, :, :]  # [N, 1, 8, 8]
    target = bunch.target.astype(np.int64)

    x_train, x_test, y_train, y_test = train_test_split(
        images, target, test_size=TEST_FRACTION, stratify=target, random_state=seed
    )
    mean = float(x_train.mean())
    std = float(x_train.std())
    x_train = (x_train - mean) / std
    x_test = (x_test - mean) / std

    train_set = TensorDataset(torch.from_numpy(np.ascontiguousarray(x_train)), torch.from_numpy(y_train))
    test_set = TensorDataset(torch.from_numpy(np.ascontiguousarray(x_test)), torch.from_numpy(y_test))

    if calib_size > len(train_set):
        raise ValueError(f"calib_size={calib_size} exceeds the {len(train_set)} training images")
    calib_indices = np.sort(np.random.default_rng(seed).choice(len(train_set), calib_size, replace=False))
    calib_set = Subset(train_set, calib_indices.tolist())

    train_loader = DataLoader(
        train_set, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    calib_loader = DataLoader(calib_set, batch_size=batch_size, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=batch_size, shuffle=False)
    logger.debug(
        "digits: %d train, %d calib, %d test images (seed=%d, mean=%.4f, std=%.4f)",
        len(train_set),
        len(calib_set),
        len(test_set),
        seed,
        mean,
        std,
    )
    return DigitsData(train=train_loader, calib=calib_loader, test=test_loader, mean=mean, std=std)


class DigitsCNN(nn.Module):
    """Two conv blocks and a two-layer classifier for 8x8 digit images.

    The structure is deliberately plain so the quantization pipeline can work on it unchanged:

    * only ``nn`` modules and a straight-line ``forward`` (no Python control flow on tensors),
      so :func:`torch.fx.symbolic_trace` captures it completely;
    * BatchNorm directly after each convolution, so BatchNorm merging has something to merge;
    * a separate ``nn.ReLU`` instance per activation (never a shared module), so every activation
      gets its own quantizer and its own name in layer-wise configs;
    * flat attribute names (``conv1``, ``fc2``, ...) that are easy to address in include/exclude
      lists.

    ~40 k parameters: big enough that int8 quantization has a measurable effect, small enough to
    train in seconds on CPU.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, 1, 8, 8]`` images to ``[B, num_classes]`` logits."""
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.flatten(self.pool(x))
        x = self.relu3(self.fc1(x))
        return self.fc2(x)


def train_digits_cnn(
    data: DigitsData | None = None, epochs: int = 15, seed: int = 0, *, num_threads: int | None = 1
) -> DigitsCNN:
    """Train a fresh :class:`DigitsCNN` with Adam and return it in eval mode.

    Training on demand (a few seconds on CPU) avoids shipping weight files. For reproducibility the
    initialisation comes from ``torch.manual_seed(seed)`` and the batch order from a generator
    seeded with ``seed`` on a fresh loader over ``data.train``'s dataset, so calling this twice with
    the same arguments gives bit-identical weights even if ``data.train`` was iterated in between.
    (The global torch RNG is reseeded as a side effect.)

    ``num_threads`` (default 1) sets torch's intra-op thread count for the duration of training
    and restores the previous value afterwards; ``None`` keeps the current setting. One thread is
    the default on purpose: this model is far too small to profit from intra-op parallelism, with
    two threads on a shared 2-core machine OpenMP spin-waiting made training up to 20x slower
    (35 s instead of ~1.6 s), and the floating-point reduction order -- hence the exact weights --
    depends on the thread count. With a fixed count, weights are bit-identical across runs and
    processes; other CPUs or torch builds may still differ in the last bits.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
    if data is None:
        data = load_digits_data(seed=seed)

    torch.manual_seed(seed)
    model = DigitsCNN()
    loader = DataLoader(
        data.train.dataset,
        batch_size=data.train.batch_size or 64,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    fit(model, loader, epochs, num_threads=num_threads)
    return model


def fine_tune(model: nn.Module, data: DigitsData, epochs: int = 5, lr: float = 1e-3, seed: int = 0, *,
              num_threads: int | None = 1) -> nn.Module:
    """Train an existing model (e.g. a quantized one, for QAT) on the digits train split, in place.

    Same loop as :func:`train_digits_cnn` (Adam, cosine decay, seeded batch order) with a lower
    starting rate suited to fine-tuning; returns the model in eval mode.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    loader = DataLoader(data.train.dataset, batch_size=data.train.batch_size or 64, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    fit(model, loader, epochs, lr=lr, desc="fine-tune", num_threads=num_threads)
    return model


def fit(model: nn.Module, loader: DataLoader, epochs: int, lr: float = 3e-3, desc: str = "train digits CNN",
         num_threads: int | None = 1) -> None:
    """Adam + cosine-decayed learning rate; leaves ``model`` in eval mode.

    A relatively high initial rate (3e-3) decayed to zero converges in ~15 short epochs, which keeps
    the on-demand training inside a couple of seconds. ``num_threads`` is set for the duration only.
    """
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        _fit_loop(model, loader, epochs, lr, desc)
    finally:
        torch.set_num_threads(previous_threads)


def _fit_loop(model: nn.Module, loader: DataLoader, epochs: int, lr: float, desc: str) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    model.train()
    progress = tqdm(range(epochs), desc=desc, unit="epoch", disable=None)
    for epoch in progress:
        total_loss = 0.0
        seen = 0
        for images, target in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), target)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += loss.item() * target.numel()
            seen += target.numel()
        mean_loss = total_loss / max(seen, 1)
        progress.set_postfix(loss=f"{mean_loss:.4f}")
        logger.debug("epoch %d/%d: train loss %.4f", epoch + 1, epochs, mean_loss)
    model.eval()
    logger.info("%s: %d epochs in %.1f s", desc, epochs, time.perf_counter() - start)


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for parameter-free models)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    """Top-1 accuracy of ``model`` on ``loader`` in percent.

    Runs in eval mode without gradients and moves each ``(images, target)`` batch to the model's
    device, so it works for float, fake-quantized and GPU models alike. The model's previous
    train/eval mode is restored afterwards so that evaluating mid-pipeline has no side effect.
    """
    device = _model_device(model)
    was_training = model.training
    model.eval()
    correct = 0
    total = 0
    try:
        with torch.no_grad():
            for images, target in loader:
                logits = model(images.to(device))
                correct += int((logits.argmax(dim=1).cpu() == target).sum())
                total += target.numel()
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError("cannot evaluate on an empty loader")
    return 100.0 * correct / total


def evaluate_predictions(predict: Callable[[np.ndarray], np.ndarray], loader: DataLoader) -> float:
    """Top-1 accuracy in percent of any ``images -> logits`` function, e.g. an onnxruntime session.

    ``predict`` receives each batch's images as a float32 numpy array ``[B, 1, 8, 8]`` and must return
    logits (or any scores) of shape ``[B, num_classes]``. This measures an exported ONNX file with the
    same data and metric as :func:`evaluate`, so float, fake-quantized and exported accuracies are
    directly comparable.
    """
    correct = 0
    total = 0
    for images, target in loader:
        scores = np.asarray(predict(images.detach().cpu().numpy().astype(np.float32, copy=False)))
        if scores.ndim != 2 or scores.shape[0] != target.shape[0]:
            raise ValueError(f"predict returned shape {scores.shape}, expected [{target.shape[0]}, classes]")
        correct += int((scores.argmax(axis=1) == target.numpy()).sum())
        total += int(target.numel())
    if total == 0:
        raise ValueError("cannot evaluate on an empty loader")
    return 100.0 * correct / total


def example_input(data: DigitsData, batch: int = 8) -> torch.Tensor:
    """The first ``batch`` test images, a real input for tracing and ONNX export.

    Real images (rather than random noise) keep export-time shape inference and any
    value-dependent checks representative; the test loader is unshuffled, so it is always the same
    batch.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    parts: list[torch.Tensor] = []
    have = 0
    for images, _ in data.test:
        parts.append(images)
        have += images.shape[0]
        if have >= batch:
            break
    if have < batch:
        raise ValueError(f"batch={batch} exceeds the {have} test images")
    return torch.cat(parts)[:batch].contiguous()
