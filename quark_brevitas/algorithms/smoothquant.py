"""SmoothQuant (Quark's ``SmoothQuantConfig``), folded into the preceding norm or linear layer, without FX tracing.

Per scaling group (a ``prev_op`` and the layers it feeds, :mod:`quark_brevitas.algorithms.structure`), per input channel
j: ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``, at least ``scale_clamp_min``, with ``X`` the layers' input
over the calibration data and ``W`` their weights (all layers of the group together). ``prev_op``'s outputs are
divided by ``s`` and the layers' input channels multiplied by it (:func:`~.scaling.fold_scales`):
the float model computes the same function, with activation outliers moved into the weights, and the quantized
model has no extra multiplication (unlike :class:`quark_brevitas.algos.ActivationEqualization`, which inserts
scale modules).

On a whole model all statistics come from one pass (folding leaves every later activation unchanged). Scaling
groups given explicitly are checked to leave the model's output unchanged on the first batch (a group whose
``prev_op`` also feeds something else, e.g. a residual connection, would change it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from quark_brevitas.algorithms.base import register
from quark_brevitas.algorithms.blocks import BlockwiseHandler
from quark_brevitas.algorithms.scaling import ChannelStats, fold_scales, linear_weight
from quark_brevitas.algorithms.structure import ScalingGroup, check_scaling_groups
from quark_brevitas.blocks.capture import first_batch_output
from quark_brevitas.calibration.data import CalibrationData
from quark_brevitas.config.algorithms import SmoothQuantConfig
from quark_brevitas.errors import ConfigError

logger = logging.getLogger(__name__)

#: Largest relative change of the first batch's output that an explicit scaling group may cause (float rounding).
_UNCHANGED = 1e-3


def smoothing_scales(act_max: torch.Tensor, layers: list[nn.Module], alpha: float, clamp_min: float) -> torch.Tensor:
    """SmoothQuant's per-channel scales (Quark's formula): ``max|X|^alpha / max|W|^(1 - alpha)``, at least
    ``clamp_min``; ``max|W|`` per input channel over all ``layers``."""
    weight_max = torch.stack([linear_weight(layer).detach().abs().amax(dim=0).float() for layer in layers]).amax(0)
    scales = act_max.float().pow(alpha) / weight_max.clamp(min=1e-5).pow(1 - alpha)
    return scales.clamp(min=clamp_min)


@register(SmoothQuantConfig)
class SmoothQuantHandler(BlockwiseHandler):
    """Measures each group's input ranges, then folds the scales; see the module docstring."""

    needs_scaling_layers = True

    def _smooth(self, algo: Any, module: nn.Module, data: CalibrationData,
                groups: list[tuple[str, ScalingGroup, nn.Module]]) -> None:
        """Smooth ``groups`` (``(block name, group, block)``) of ``module`` with one pass of ``data``."""
        inputs = {f"{prefix}{group.inp}": block.get_submodule(group.inp) for prefix, group, block in groups}
        stats = ChannelStats()
        stats.collect(module, data, inputs, f"{algo.name}: activation ranges")
        explicit = algo.scaling_layers is not None
        reference = first_batch_output(module, data, f"{algo.name}: reference output") if explicit else None
        for prefix, group, block in groups:
            layers = [block.get_submodule(name) for name in group.layers]
            scales = smoothing_scales(stats.max[f"{prefix}{group.inp}"], layers, algo.alpha, algo.scale_clamp_min)
            fold_scales(block.get_submodule(group.prev_op), layers, scales)
            logger.debug("%s: %s%s: scales in [%.3g, %.3g]", algo.name, prefix, group, scales.min(), scales.max())
            if reference is not None:
                self._check_unchanged(algo, module, data, reference, prefix, group)

    def _check_unchanged(self, algo: Any, module: nn.Module, data: CalibrationData, reference: torch.Tensor,
                         prefix: str, group: ScalingGroup) -> None:
        output = first_batch_output(module, data, f"{algo.name}: check {group}")
        change = float((output - reference).norm() / reference.norm().clamp(min=1e-12))
        if change > _UNCHANGED:
            index = [ScalingGroup.from_quark(entry) for entry in algo.scaling_layers].index(group)
            raise ConfigError(f"{type(algo).__name__}.scaling_layers[{index}]",
                              f"folding scales from {prefix}{group.prev_op} into {', '.join(group.layers)} changes the "
                              f"model's output (relative change {change:.2g} on the first batch): {group.prev_op}'s "
                              "output also feeds something else (e.g. a residual connection or a non-homogeneous "
                              "activation). Remove this entry")

    def apply_block(self, algo: Any, block: nn.Module, data: CalibrationData, name: str) -> nn.Module:
        block.eval()
        groups = self.scaling_groups(algo, block)
        check_scaling_groups(block, name, groups, "SmoothQuantConfig.scaling_layers")
        with torch.no_grad():
            self._smooth(algo, block, data, [("", group, block) for group in groups])
        return block

    def apply(self, algo: Any, model: nn.Module, data: CalibrationData | None) -> nn.Module:
        """All blocks from one pass over the whole model (smoothing leaves every activation the next block sees
        unchanged, so no block needs the previous ones processed first)."""
        model.eval()
        structure = self.structure(algo, model)
        groups = []
        for name in structure.blocks:
            block = model.get_submodule(name) if name else model
            groups += [(f"{name}." if name else "", group, block) for group in self.scaling_groups(algo, block)]
        with torch.no_grad():
            self._smooth(algo, model, data, groups)
        return model
