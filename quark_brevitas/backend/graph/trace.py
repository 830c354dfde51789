"""Tracing a model for the graph backend: torch.fx, with modules that own parameters kept whole.

One place for the trace and its error, used by :class:`~quark_brevitas.backend.graph.GraphBackend` and by the
recipes that name a model's layers (:mod:`.recipes`), so both see the same graph.
"""

from __future__ import annotations

from torch import nn

from quark_brevitas.brevitas_adapter import is_graph_module, symbolic_trace
from quark_brevitas.errors import ModelError


def _leaf(module: nn.Module, _name: str) -> bool:
    """Keep modules that own parameters whole while tracing, so a user's layer class stays replaceable."""
    return bool(module._parameters)


def trace(model: nn.Module) -> nn.Module:
    """``model`` as an FX graph module (itself if it already is one, e.g. after ``Preprocess``); an untraceable
    model is a :class:`ModelError` quoting the trace error and pointing at ``Backend.layerwise``."""
    if is_graph_module(model):
        return model
    try:
        return symbolic_trace(model, _leaf)
    except Exception as exc:  # noqa: BLE001 - every trace failure is reported as the model's, with its cause
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelError(
            f"Backend.graph cannot trace {type(model).__name__} with torch.fx ({type(exc).__name__}: {first}). "
            "The graph backend needs the whole forward as a graph to place a quantizer on every tensor; make "
            "the forward traceable (no data-dependent control flow), or use Backend.layerwise, which "
            "quantizes layer by layer without a trace") from exc


__all__ = ["trace"]
