"""Tests for the built-in digits example (data splits, FX-traceable CNN, training, metrics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from quark_brevitas.cli.digits import (
    NUM_CLASSES,
    PIXEL_MAX,
    DigitsCNN,
    DigitsData,
    evaluate,
    evaluate_predictions,
    example_input,
    load_digits_data,
    train_digits_cnn,
)

N_IMAGES = 1797
N_TEST = 450  # ceil(0.25 * 1797)
N_TRAIN = N_IMAGES - N_TEST


def _all(loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    images, targets = zip(*loader)
    return torch.cat(images), torch.cat(targets)


@pytest.fixture(scope="module")
def data() -> DigitsData:
    return load_digits_data()


@pytest.fixture(scope="module")
def trained(data: DigitsData) -> DigitsCNN:
    return train_digits_cnn(data)


def test_split_sizes_and_stratification(data: DigitsData) -> None:
    x_train, y_train = _all(data.train)
    x_test, y_test = _all(data.test)
    x_calib, y_calib = _all(data.calib)
    assert x_train.shape == (N_TRAIN, 1, 8, 8)
    assert x_test.shape == (N_TEST, 1, 8, 8)
    assert x_calib.shape == (256, 1, 8, 8)
    for x in (x_train, x_test, x_calib):
        assert x.dtype == torch.float32
    for y in (y_train, y_test, y_calib):
        assert y.dtype == torch.int64
    # Stratified: each class's share of the test split is within one image of 25 % of its total.
    test_counts = torch.bincount(y_test, minlength=NUM_CLASSES)
    total_counts = test_counts + torch.bincount(y_train, minlength=NUM_CLASSES)
    assert int(total_counts.sum()) == N_IMAGES
    assert torch.all((test_counts.double() - 0.25 * total_counts.double()).abs() <= 1.0)
    # Standardised with train statistics.
    assert abs(float(x_train.mean())) < 1e-4
    assert float(x_train.std()) == pytest.approx(1.0, abs=1e-3)
    assert data.std > 0
    # Batches have the requested size.
    assert next(iter(data.test))[0].shape[0] == 64


def _raw_rows(images: torch.Tensor, target: torch.Tensor, data: DigitsData) -> list[tuple[int, ...]]:
    """Undo the normalisation back to the original 0..16 integer pixels, one tuple per image+label."""
    pixels = torch.round((images * data.std + data.mean) * PIXEL_MAX).to(torch.int64)
    return [(*row.tolist(), int(y)) for row, y in zip(pixels.reshape(len(pixels), -1), target)]


def test_splits_disjoint_and_calib_in_train(data: DigitsData) -> None:
    x_train, y_train = _all(data.train)
    x_test, y_test = _all(data.test)
    x_calib, y_calib = _all(data.calib)
    # train + test is exactly a partition of the digits set: as multisets of (pixels, label) their
    # union equals the original set and the sizes add up, so no image is in both or in neither.
    bunch = load_digits()
    original = sorted((*row.astype(np.int64).tolist(), int(y)) for row, y in zip(bunch.data, bunch.target))
    recovered = _raw_rows(x_train, y_train, data) + _raw_rows(x_test, y_test, data)
    assert sorted(recovered) == original
    # calib is a Subset of the train dataset with 256 distinct indices.
    indices = data.calib.dataset.indices
    assert data.calib.dataset.dataset is data.train.dataset
    assert len(set(indices)) == len(indices) == 256
    assert all(0 <= i < N_TRAIN for i in indices)
    assert torch.equal(data.train.dataset.tensors[0][indices], x_calib)
    assert torch.equal(data.train.dataset.tensors[1][indices], y_calib)
    # ... and therefore shares no index with test; by content it is contained in train.
    train_rows = set(_raw_rows(x_train, y_train, data))
    assert set(_raw_rows(x_calib, y_calib, data)) <= train_rows
    # calib should cover every class (random 256 of 1347 images).
    assert set(y_calib.tolist()) == set(range(NUM_CLASSES))


def test_split_is_deterministic_and_seed_dependent() -> None:
    a, b, c = load_digits_data(seed=0), load_digits_data(seed=0), load_digits_data(seed=1)
    assert torch.equal(a.test.dataset.tensors[0], b.test.dataset.tensors[0])
    assert a.calib.dataset.indices == b.calib.dataset.indices
    assert not torch.equal(a.test.dataset.tensors[1], c.test.dataset.tensors[1])


def test_custom_sizes_and_validation() -> None:
    d = load_digits_data(batch_size=32, calib_size=100)
    assert next(iter(d.train))[0].shape[0] == 32
    assert sum(x.shape[0] for x, _ in d.calib) == 100
    with pytest.raises(ValueError, match="calib_size"):
        load_digits_data(calib_size=N_TRAIN + 1)
    with pytest.raises(ValueError, match="batch_size"):
        load_digits_data(batch_size=0)


def test_cnn_is_fx_traceable(data: DigitsData) -> None:
    torch.manual_seed(0)
    model = DigitsCNN().eval()
    traced = torch.fx.symbolic_trace(model)
    call_modules = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert call_modules == [
        "conv1", "bn1", "relu1", "conv2", "bn2", "relu2", "pool", "flatten", "fc1", "relu3", "fc2"
    ]  # fmt: skip
    x = example_input(data, batch=16)
    with torch.no_grad():
        eager, fx_out = model(x), traced(x)
    assert eager.shape == (16, NUM_CLASSES)
    assert torch.equal(eager, fx_out)


def test_training_accuracy(trained: DigitsCNN, data: DigitsData) -> None:
    assert not trained.training
    acc = evaluate(trained, data.test)
    assert 95.0 <= acc <= 100.0
    assert evaluate(trained, data.train) >= 99.0
    # Chance is 10 %; an untrained model must be far below the trained one.
    torch.manual_seed(0)
    assert evaluate(DigitsCNN(), data.test) < 50.0


def test_same_seed_identical_weights(trained: DigitsCNN, data: DigitsData) -> None:
    # Iterate the shared train loader first: training must not depend on its RNG state.
    next(iter(data.train))
    # Training pins its own thread count, so the caller's setting neither changes the weights nor is
    # left modified.
    previous = torch.get_num_threads()
    caller_threads = 1 if previous > 1 else 2
    torch.set_num_threads(caller_threads)
    try:
        again = train_digits_cnn(data, seed=0)
        assert torch.get_num_threads() == caller_threads
    finally:
        torch.set_num_threads(previous)
    assert list(again.state_dict()) == list(trained.state_dict())
    for (name, a), (_, b) in zip(trained.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    other = train_digits_cnn(data, epochs=1, seed=1)
    assert not torch.equal(other.conv1.weight, trained.conv1.weight)


def test_train_validates_arguments(data: DigitsData) -> None:
    with pytest.raises(ValueError, match="epochs"):
        train_digits_cnn(data, epochs=0)
    with pytest.raises(ValueError, match="num_threads"):
        train_digits_cnn(data, num_threads=0)


def test_evaluate_restores_mode_and_handles_trivial_cases(trained: DigitsCNN) -> None:
    trained.train()
    try:
        evaluate(trained, load_digits_data().calib)
        assert trained.training
    finally:
        trained.eval()
    # A hand-made loader with known answers: all-zero logits for class 0 except one row.
    images = torch.zeros(4, 1, 8, 8)
    target = torch.tensor([0, 0, 1, 1])

    def predict(x: np.ndarray) -> np.ndarray:
        out = np.zeros((x.shape[0], NUM_CLASSES), dtype=np.float32)
        out[:, 0] = 1.0
        return out

    loader = DataLoader(TensorDataset(images, target), batch_size=3)
    assert evaluate_predictions(predict, loader) == pytest.approx(50.0)


def test_evaluate_predictions_matches_evaluate(trained: DigitsCNN, data: DigitsData) -> None:
    seen: list[tuple[type, np.dtype, tuple[int, ...]]] = []

    def predict(images: np.ndarray) -> np.ndarray:
        seen.append((type(images), images.dtype, images.shape[1:]))
        with torch.no_grad():
            return trained(torch.from_numpy(images)).numpy()

    expected = evaluate(trained, data.test)
    assert evaluate_predictions(predict, data.test) == expected
    assert seen and all(s == (np.ndarray, np.dtype(np.float32), (1, 8, 8)) for s in seen)


def test_example_input(data: DigitsData) -> None:
    x = example_input(data)
    assert x.shape == (8, 1, 8, 8) and x.dtype == torch.float32
    first_test = data.test.dataset.tensors[0]
    assert torch.equal(x, first_test[:8])
    # Larger than one loader batch: spans batches.
    big = example_input(data, batch=100)
    assert torch.equal(big, first_test[:100])
    with pytest.raises(ValueError):
        example_input(data, batch=N_TEST + 1)
