"""Fixtures of the graph backend tests (``test_graph_finn.py``, ``test_graph_digits.py``)."""

from __future__ import annotations

import pytest
from helpers.finn import FinnFrontEnd, setup_finn


@pytest.fixture(scope="module")
def finn() -> FinnFrontEnd:
    """FINN's front end, set up once per module; the test is skipped with the reason where none is given."""
    return setup_finn()
