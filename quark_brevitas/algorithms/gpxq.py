"""GPTQ, GPFQ and accumulator-aware GPFQ: weight rounding that compensates the error layer by layer.

Brevitas's GPxQ contexts need one pass over the calibration data per layer (each pass collects the
inputs of the next layer to optimise); the data come from the pipeline (the whole model's batches, or
the cached inputs of one block).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quark_brevitas import algos
from quark_brevitas.algorithms.base import AlgorithmHandler, SavedStructure, register
from quark_brevitas.brevitas_adapter import a2gpfq_available, a2gpfq_mode, gpfq_mode, gptq_mode
from quark_brevitas.data import CalibrationData
from quark_brevitas.errors import UnsupportedAlgorithmError

#: The float copy of each weight GPFQ keeps while it runs (Brevitas's name); removed afterwards.
_FLOAT_WEIGHT_COPY = "weight_orig"


def _run(mode: Any, data: CalibrationData, name: str) -> None:
    for _ in tqdm(range(mode.num_layers), desc=f"{name} layers", leave=False, disable=None):
        data.forward(mode.model, name)
        mode.update()


def _drop_float_weight_copies(model: nn.Module) -> None:
    """Remove the float weight copies GPxQ registers on each layer: the quantized model does not need
    them, and they would double the size of a checkpoint."""
    for module in model.modules():
        if _FLOAT_WEIGHT_COPY in module._buffers:
            del module._buffers[_FLOAT_WEIGHT_COPY]


class _GPxQHandler(AlgorithmHandler):
    def mode(self, algo: Any, model: nn.Module) -> Any:
        raise NotImplementedError

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        model.eval()
        with torch.no_grad(), self.mode(algo, model) as mode:
            _run(mode, data, algo.name)
        _drop_float_weight_copies(model)
        return model

    def restore(self, algo: Any, model: nn.Module, saved: SavedStructure) -> nn.Module:
        """Checkpoints written before the copies were dropped still hold them: recreate the buffers so that
        such a checkpoint loads (their values are not used)."""
        modules = dict(model.named_modules())
        for key, shape in saved.tensors.items():
            owner, _, attr = key.rpartition(".")
            module = modules.get(owner)
            if attr == _FLOAT_WEIGHT_COPY and module is not None and not hasattr(module, attr):
                module.register_buffer(attr, torch.empty(shape))
        return model


@register(algos.GPTQ)
class GPTQHandler(_GPxQHandler):
    """GPTQ with float inputs to each layer."""

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return gptq_mode(model, act_order=algo.act_order)


@register(algos.GPFQ)
class GPFQHandler(_GPxQHandler):
    """GPFQ with quantized inputs to each layer."""

    blockwise = False  # it compares with the float model's activations at every layer

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return gpfq_mode(model, act_order=algo.act_order)


@register(algos.GPFA2Q)
class GPFA2QHandler(_GPxQHandler):
    """GPFQ whose weights keep every dot product inside an accumulator of the given width."""

    blockwise = False  # it compares with the float model's activations at every layer

    def check(self, algo: Any, path: str) -> None:
        if not a2gpfq_available():
            raise UnsupportedAlgorithmError(f"{path}: GPFA2Q needs brevitas_examples.common.axe.a2gpfq_mode "
                                            "(shipped with brevitas >= 0.11); the installed Brevitas lacks it")

    def mode(self, algo: Any, model: nn.Module) -> Any:
        return a2gpfq_mode(model, act_order=algo.act_order, accumulator_bit_width=algo.accumulator_bit_width)
