"""The graph backend (``Backend.graph``, Quark's ``QuantizationMode.fx_graph_mode``): whole networks, integer end to
end.

The layerwise backend quantizes the inputs and weights of compute layers and leaves every tensor between them in
float. This backend traces the model (FX) and quantizes every tensor that reaches a compute layer: the model's
inputs, every activation's output, a requantization behind every op that leaves the grid, and the inputs of each
add/concat through one shared quantizer. The compute layers themselves are replaced as in the layerwise backend
(same layer map, weight specs, per-layer config hierarchy), without their own input quantizers: their inputs are
the points in front of them. See :mod:`.points` for where the points go and why, and docs/how-to/graph-finn.md.

The config maps plainly: a layer's ``input_tensors`` is the spec of every point whose value reaches it,
``output_tensors`` quantizes the layer's own output (the model's output when set on the last layer), ``weight`` as
in the layerwise backend. ``bias``: ``None`` keeps it float (FINN absorbs it into the next thresholds); an integer
bias (``scale = input scale x weight scale``) takes the scale of the quantizer the layer's input comes from
(:func:`.rewrite.share_input_scales`), which keeps a power-of-two network's arithmetic exact.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from quark_brevitas.backend import LayerMapping, LayerwiseBackend, PlannedLayer
from quark_brevitas.backend.graph.points import GraphAnalysis, QuantPoint, analyse
from quark_brevitas.backend.graph.rewrite import insert_points, privatise_forks, share_input_scales
from quark_brevitas.backend.graph.trace import trace
from quark_brevitas.config import Config, QuantizationConfig, QuantType
from quark_brevitas.config.enums import QSchemeType
from quark_brevitas.errors import ConfigError
from quark_brevitas.resolve import GLOBAL

logger = logging.getLogger(__name__)

_ACTIVATION_ROLES = ("input_tensors", "output_tensors")


def _activation_refusal(spec: Any) -> tuple[str, str] | None:
    """``(field, reason)`` if an activation spec cannot be a graph point (what FINN and integer kernels take)."""
    spec = spec.resolved()
    if spec.quant_type is not QuantType.int_quant:
        return "quant_type", "graph points are integer quantizers (int_quant); float formats have no integer kernel"
    if not spec.symmetric:
        return "symmetric", ("graph points are symmetric (zero point 0): FINN's converter refuses other zero points, "
                             "and an unsigned ReLU output is already one-sided")
    if spec.is_dynamic:
        return "is_dynamic", "graph points have static scales (calibrated), which FINN folds into thresholds"
    if spec.qscheme is not QSchemeType.per_tensor:
        return "qscheme", "graph points are per_tensor: FINN moves only scalar scales past convolutions"
    return None


class GraphBackend:
    """Quantizes every tensor of a traced model (module docstring); same interface as the layerwise backend."""

    def __init__(self, layer_map: Mapping[type[nn.Module], LayerMapping]) -> None:
        self.layerwise = LayerwiseBackend(layer_map)
        self.layer_map = self.layerwise.layer_map

    # ------------------------------------------------------------------ tracing and planning
    def trace(self, model: nn.Module) -> nn.Module:
        """``model`` as an FX graph module (:func:`.trace.trace`: ``ModelError`` if torch.fx cannot trace it)."""
        return trace(model)

    def plan(self, model: nn.Module, config: Config, *, check_names: bool = True, prefix: str = ""
             ) -> list[PlannedLayer]:
        """The layers' plan (as the layerwise backend's), each compute layer's row with the graph points it owns
        (``graph_points``); the points are built here, so an untraceable model or a disagreeing shared point fails
        before anything is calibrated."""
        rows = self.layerwise.plan(model, config, check_names=check_names, prefix=prefix)
        self._check_specs(rows)
        points = self.analyse(model, rows).points

        def owned(row: PlannedLayer) -> tuple[QuantPoint, ...]:
            local = row.name.removeprefix(f"{prefix}.") if prefix else row.name
            return tuple(point for point in points if local in point.layers)

        return [dataclasses.replace(row, graph_points=owned(row)) if row.quantized else row for row in rows]

    def points(self, model: nn.Module, config: Config) -> list[QuantPoint]:
        """Every quantization point of ``model`` under ``config`` (tensor, owning layers, spec, sign, group)."""
        rows = self.layerwise.plan(model, config)
        self._check_specs(rows)
        return self.analyse(model, rows).points

    def analyse(self, model: nn.Module, rows: Sequence[PlannedLayer]) -> GraphAnalysis:
        graph_model = self.trace(model)
        configs = {row.name: row.layer_config for row in rows}

        def spec_of(layer: str) -> Any:
            config = configs.get(layer)
            return config.input_tensors if config is not None else None

        return analyse(graph_model.graph, dict(graph_model.named_modules()), self.layer_map, spec_of)

    def _check_specs(self, rows: Sequence[PlannedLayer]) -> None:
        for row in rows:
            layer = row.layer_config
            if layer is None:
                continue
            for role in _ACTIVATION_ROLES:
                spec = getattr(layer, role)
                refusal = _activation_refusal(spec) if spec is not None else None
                if refusal is not None:
                    raise ConfigError(self._path(row, role, refusal[0]), f"layer {row.name!r}: {refusal[1]}")

    @staticmethod
    def _path(row: PlannedLayer, role: str, field: str) -> str:
        source = row.sources.get(role, GLOBAL)
        level = "global_quant_config" if source == GLOBAL else source
        return f"{level}.{role}{'.' + field if field else ''}"

    # ------------------------------------------------------------------ the layerwise backend's checks
    def require_values(self, model: nn.Module, loaded_later: str | None = None) -> None:
        self.layerwise.require_values(model, loaded_later)

    def require_targets(self, model: nn.Module, rows: Sequence[PlannedLayer]) -> None:
        self.layerwise.require_targets(model, rows)

    # ------------------------------------------------------------------ quantization
    def quantize(self, model: nn.Module, config: Config, *, check_names: bool = True, prefix: str = "",
                 log: int = logging.INFO) -> nn.Module:
        """The traced model with every point's quantizer and its compute layers replaced (``model`` itself is
        changed where it already is a graph module); ``log``: the level of the summary lines (DEBUG on reload)."""
        graph_model = self.trace(model)
        rows = self.layerwise.plan(graph_model, config, check_names=False, prefix=prefix)
        self._check_specs(rows)
        analysis = self.analyse(graph_model, rows)
        # Layers first (the layerwise walk must see only float modules), then the points: graph nodes name
        # modules by their qualified names, which replacing a layer keeps.
        graph_model = self.layerwise.quantize(graph_model, _without_inputs(config), check_names=False, prefix=prefix,
                                              log=log)
        quantizers = insert_points(graph_model, analysis)
        privatise_forks(graph_model, analysis, quantizers)
        biased = {row.name.removeprefix(f"{prefix}.") if prefix else row.name: row.layer_config.bias
                  for row in rows if row.quantized and row.layer_config is not None
                  and row.layer_config.bias is not None}
        share_input_scales(graph_model, analysis, quantizers, biased)
        graph_model.recompile()
        logger.log(log, "Backend.graph: %d quantization points (%d shared-scale groups)", len(analysis.points),
                   sum(point.kind == "shared" for point in analysis.points))
        return graph_model


def _without_inputs(config: Config) -> Config:
    """``config`` with no ``input_tensors`` (and no ``bias``) at any level: the graph points quantize the layers'
    inputs, and an integer bias takes its scale from them (:func:`.rewrite.share_input_scales`)."""
    def strip(layer: QuantizationConfig) -> QuantizationConfig:
        return dataclasses.replace(layer, input_tensors=None, bias=None)

    return dataclasses.replace(
        config, global_quant_config=strip(config.global_quant_config),
        layer_type_quant_config={k: strip(v) for k, v in config.layer_type_quant_config.items()},
        layer_quant_config={k: strip(v) for k, v in config.layer_quant_config.items()})


def plan_points(model: nn.Module, config: Config) -> list[QuantPoint]:
    """Every quantization point ``Backend.graph`` would put in ``model`` under ``config`` (tensor, kind, owning
    layers, spec, sign; the inputs of each shared-scale group), before anything is calibrated or changed."""
    from quark_brevitas.backend import DEFAULT_LAYER_MAP

    return GraphBackend(DEFAULT_LAYER_MAP).points(model, config)


def points_table(points: Sequence[QuantPoint]) -> str:
    """The points as an aligned text table: tensor, kind, producer, owning layers, spec, sign, shared inputs."""
    header = ("tensor", "kind", "producer", "layers", "spec", "sign", "shared by")
    table = [header]
    for p in points:
        table.append((p.tensor, p.kind, p.producer, ", ".join(p.layers) or "-", p.spec.short(),
                      "signed" if p.signed else "unsigned", ", ".join(p.inputs) if p.kind == "shared" else "-"))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


from quark_brevitas.backend.graph.recipes import FINN_QAT_RECIPE, end_layers, finn_config  # noqa: E402

__all__ = ["FINN_QAT_RECIPE", "GraphBackend", "QuantPoint", "end_layers", "finn_config", "plan_points",
           "points_table"]
