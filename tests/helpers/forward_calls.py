"""Counting a layer class's real computations, for the tests of the layer-output memo (``brevitas_adapter.memo``):
a remembered output is served without calling the class's ``forward``, so the count says what was computed."""

from __future__ import annotations

import pytest
from torch import nn


def count_forward_calls(monkeypatch: pytest.MonkeyPatch, layer_class: type[nn.Module]) -> list[int]:
    """Patch ``layer_class.forward`` (undone by ``monkeypatch``) to count its calls in the returned one-item list."""
    original = layer_class.forward
    count = [0]

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", forward)
    return count
