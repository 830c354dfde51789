"""Shared fixtures: the digits data and CNN are trained once per test session."""

from __future__ import annotations

import pytest
import torch

from quark_brevitas.cli.digits import DigitsData, load_digits_data, train_digits_cnn

# Checks shared by several test modules live in tests/helpers/ (e.g. helpers.rounding_checks): their asserts report
# the values compared, as a test module's do.
pytest.register_assert_rewrite("helpers")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test models are tiny: on a shared 2-core machine a second intra-op thread only spin-waits
    (measured 2-20x slower), and one thread makes results independent of the machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def digits_data() -> DigitsData:
    return load_digits_data()


@pytest.fixture(scope="session")
def digits_model(digits_data: DigitsData) -> torch.nn.Module:
    """A trained float DigitsCNN. Tests must not modify it (quantize_model works on a copy)."""
    return train_digits_cnn(digits_data)
