"""The structural pre-quantization step: FX trace, BatchNorm merge, graph equalization, channel splitting."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import AlgorithmHandler, register
from quark_brevitas.brevitas_adapter import is_graph_module, symbolic_trace
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.algorithms import Preprocess

logger = logging.getLogger(__name__)


def _owns_parameters(module: nn.Module, _name: str) -> bool:
    """Keep every module that owns parameters whole while tracing.

    The default tracer only keeps ``torch.nn`` modules; a user layer such as
    ``class MyLinear(nn.Linear)`` would be inlined into a bare ``linear`` call and could no longer be
    replaced by a mapping registered in the container's layer map.
    """
    return bool(module._parameters)


_TRANSPOSED_BATCH_NORM: dict[type[nn.Module], type[nn.Module]] = {
    nn.ConvTranspose1d: nn.BatchNorm1d, nn.ConvTranspose2d: nn.BatchNorm2d, nn.ConvTranspose3d: nn.BatchNorm3d,
}


def _fold_batch_norm_into_grouped_transposed(layer: nn.Module, bn: nn.Module) -> None:
    """``bn(layer(x)) == layer'(x)`` for a transposed convolution with groups, in place.

    The weight is ``(in, out / groups, *kernel)`` and output channel ``g * (out / groups) + j`` is column
    ``j`` of input-channel block ``g``, so the BatchNorm factor of each output channel multiplies that
    column of that block (Brevitas's merge scales dimension 1 as if there were one group and fails).
    """
    with torch.no_grad():
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(std)
        factor = gamma / std
        shift = beta - bn.running_mean * factor
        weight = layer.weight
        groups, kernel = layer.groups, weight.shape[2:]
        blocks = weight.view(groups, weight.shape[0] // groups, weight.shape[1], *kernel)
        blocks.mul_(factor.view(groups, 1, weight.shape[1], *[1] * len(kernel)).to(weight.dtype))
        if layer.bias is None:
            layer.bias = nn.Parameter(shift.to(weight.dtype))
        else:
            layer.bias.mul_(factor.to(weight.dtype)).add_(shift.to(weight.dtype))


def _merge_grouped_transposed_batch_norm(graph_model: Any) -> None:
    """Merge every BatchNorm that follows a grouped transposed convolution (and is its only user) into it,
    before Brevitas's BatchNorm merge, which handles the other layers."""
    modules = dict(graph_model.named_modules())
    merged = []
    for node in list(graph_model.graph.nodes):
        source = node.args[0] if node.op == "call_module" and node.args else None
        if getattr(source, "op", None) != "call_module" or len(source.users) != 1:
            continue
        layer, bn = modules.get(source.target), modules.get(node.target)
        if (type(layer) not in _TRANSPOSED_BATCH_NORM or layer.groups == 1
                or type(bn) is not _TRANSPOSED_BATCH_NORM[type(layer)] or bn.running_mean is None):
            continue
        _fold_batch_norm_into_grouped_transposed(layer, bn)
        node.replace_all_uses_with(source)
        graph_model.graph.erase_node(node)
        graph_model.delete_submodule(node.target)
        merged.append(f"{node.target} into {source.target}")
    if merged:
        graph_model.recompile()
        logger.info("Preprocess: merged BatchNorm into grouped transposed convolutions: %s", ", ".join(merged))


def _optional_inputs(model: nn.Module) -> list[str]:
    """The forward parameters with a default value: FX tracing turns each into a symbolic input that is
    never ``None``, so ``if y is not None:`` branches are traced as always taken (a wrong graph)."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _is_hugging_face(model: nn.Module) -> bool:
    """A transformers model (by its class hierarchy, without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(model).__mro__)


@register(Preprocess)
class PreprocessHandler(AlgorithmHandler):
    """Runs Brevitas's ``preprocess_for_quantize`` on an FX graph of the model; models that cannot be
    traced (most Hugging Face transformers) pass through unchanged with one warning."""

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        from brevitas.graph.quantize import preprocess_for_quantize

        if not any(True for _ in model.children()):
            # A bare layer (the model is an nn.Linear): nothing to merge or equalize, and tracing would
            # inline it into a functional call that no layer mapping can replace.
            return model
        graph_model = model
        if algo.trace_model and not is_graph_module(model):
            optional = _optional_inputs(model)
            if optional and algo == Preprocess() and _is_hugging_face(model):
                # Every preset and Config() starts with the default Preprocess, and a Hugging Face forward always
                # has optional inputs: the skip is expected there, so it is not worth a warning on every run.
                logger.debug("Preprocess: %s is a Hugging Face model (optional inputs %s); the default graph steps "
                             "are skipped", type(model).__name__, ", ".join(optional))
                return model
            if optional:
                logger.warning(
                    "Preprocess: %s.forward has optional inputs (%s); a symbolic trace would fix which of them are "
                    "given, so the graph steps (BatchNorm merge, graph equalization, channel splitting) are "
                    "skipped and the model is quantized as is", type(model).__name__, ", ".join(optional))
                return model
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
        if algo.merge_batch_norm:
            _merge_grouped_transposed_batch_norm(graph_model)
        return preprocess_for_quantize(
            graph_model,
            trace_model=False,
            equalize_iters=algo.equalize_iterations,
            equalize_merge_bias=algo.equalize_merge_bias,
            merge_bn=algo.merge_batch_norm,
            channel_splitting_ratio=algo.channel_splitting_ratio,
            channel_splitting_split_input=algo.channel_splitting_split_input,
        )
