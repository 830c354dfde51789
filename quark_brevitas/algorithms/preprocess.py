"""The structural pre-quantization step: FX trace, BatchNorm merge, graph equalization, channel splitting."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from quark_brevitas import algos
from quark_brevitas.algorithms.base import AlgorithmHandler, register
from quark_brevitas.brevitas_adapter import is_graph_module, symbolic_trace
from quark_brevitas.data import CalibrationData

logger = logging.getLogger(__name__)


def _owns_parameters(module: nn.Module, _name: str) -> bool:
    """Keep every module that owns parameters whole while tracing.

    The default tracer only keeps ``torch.nn`` modules; a user layer such as
    ``class MyLinear(nn.Linear)`` would be inlined into a bare ``linear`` call and could no longer be
    replaced by a mapping registered in the container's layer map.
    """
    return bool(module._parameters)


@register(algos.Preprocess)
class PreprocessHandler(AlgorithmHandler):
    """Runs Brevitas's ``preprocess_for_quantize`` on an FX graph of the model; models that cannot be
    traced (most Hugging Face transformers) pass through unchanged with one warning."""

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        from brevitas.graph.quantize import preprocess_for_quantize

        graph_model = model
        if algo.trace_model and not is_graph_module(model):
            try:
                graph_model = symbolic_trace(model, _owns_parameters)
            except Exception as exc:  # noqa: BLE001 - any tracing failure means "no graph"; reported below
                logger.warning(
                    "Preprocess: %s cannot be FX-traced (%s: %s); skipping BatchNorm merge, graph "
                    "equalization and channel splitting, which need a graph. The model is quantized as is.",
                    type(model).__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                )
                return model
        if not is_graph_module(graph_model):
            logger.warning("Preprocess: trace_model=False and %s is not an FX GraphModule; skipping the "
                           "graph steps (BatchNorm merge, equalization, channel splitting)", type(model).__name__)
            return model
        return preprocess_for_quantize(
            graph_model,
            trace_model=False,
            equalize_iters=algo.equalize_iterations,
            equalize_merge_bias=algo.equalize_merge_bias,
            merge_bn=algo.merge_batch_norm,
            channel_splitting_ratio=algo.channel_splitting_ratio,
            channel_splitting_split_input=algo.channel_splitting_split_input,
        )
