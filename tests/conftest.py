"""Shared fixtures: the digits data and CNN are trained once per test session."""

from __future__ import annotations

import pytest
import torch

from quark_brevitas.digits import DigitsData, load_digits_data, train_digits_cnn


@pytest.fixture(scope="session")
def digits_data() -> DigitsData:
    return load_digits_data()


@pytest.fixture(scope="session")
def digits_model(digits_data: DigitsData) -> torch.nn.Module:
    """A trained float DigitsCNN. Tests must not modify it (quantize_model works on a copy)."""
    return train_digits_cnn(digits_data)
