"""Group sizes that do not divide a layer's input channels (issue 27, failure 7).

Why a module of its own: Brevitas pads a per-group weight's last group when the layer's input channels are no
multiple of ``group_size`` (or fewer than it). Done silently, that cost 3-70x evaluation time and +45 % memory
(group sizes 7 and 100000 on 64 channels), and a group size that cannot fit is a mistake the user wants to hear
about before calibration, not after. So ``plan()`` refuses such a layer by name (:func:`group_size_check`) unless
the spec pads (:func:`pads_groups`), and a run that does pad says which layers it pads (:func:`log_padded_groups`).

What pads, following Quark 0.13: ``pad_groups=True`` always, ``pad_groups=False`` never; unset, MX formats pad
(Quark's MX quantizer pads a tensor to whole blocks, as OCP MX allows) and integer / float groups do not (Quark's
per-group observer raises a ``ValueError`` when ``group_size`` does not divide the channels).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from quark_brevitas.config import QuantizationConfig
from quark_brevitas.config.enums import Dtype, QSchemeType
from quark_brevitas.config.specs import QuantizationSpec

__all__ = ["group_size_check", "log_padded_groups", "padded_width", "pads_groups"]

logger = logging.getLogger(__name__)


def _grouped_width(module: nn.Module) -> int | None:
    """The input channels a per-group weight's groups run along (Linear, Conv1d/2d at each kernel position,
    Hugging Face's Conv1D stored ``[in, out]``); ``None`` for layers whose groups are laid out otherwise."""
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    if isinstance(module, nn.Conv1d | nn.Conv2d) and not isinstance(module, nn.ConvTranspose1d | nn.ConvTranspose2d):
        return int(module.in_channels // module.groups)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0])
    return None


def pads_groups(spec: QuantizationSpec) -> bool:
    """Whether ``spec`` lets a layer whose width its groups do not divide pad its last group: ``pad_groups=True``
    does; ``None`` (the default) follows Quark 0.13 -- MX blocks pad (its MX quantizer pads to whole blocks, as the
    OCP MX block layout allows) while integer and float groups are refused (its group observer raises)."""
    if spec.pad_groups is not None:
        return bool(spec.pad_groups)
    return spec.dtype is Dtype.mx


def padded_width(module: nn.Module, layer: QuantizationConfig | None) -> tuple[int, int] | None:
    """``(width, group_size)`` when ``layer``'s per-group weight pads ``module``'s last group (its input channels
    are fewer than ``group_size`` or no multiple of it), else ``None``."""
    spec = layer.weight.resolved() if layer is not None and layer.weight is not None else None
    if spec is None or spec.qscheme is not QSchemeType.per_group or not spec.group_size:
        return None
    width = _grouped_width(module)
    if width is None or width % spec.group_size == 0:
        return None
    return width, spec.group_size


def group_size_check(module: nn.Module, layer: QuantizationConfig) -> tuple[str, str] | None:
    """A per-group weight whose layer's input channels are no multiple of ``group_size`` (or fewer): Brevitas would
    pad the last group, silently costing evaluation time and memory (3-70x and +45 % measured for group sizes of
    7 and 100000 on 64 channels), so it is refused in ``plan()`` -- before calibration -- unless the spec pads
    (:func:`pads_groups`)."""
    padded = padded_width(module, layer)
    if padded is None or pads_groups(layer.weight.resolved()):
        return None
    width, group_size = padded
    divisors = [g for g in (256, 128, 64, 32, 16, 8, 4, 2) if g < width and width % g == 0][:1]
    hint = f"a group_size that divides {width} (e.g. {divisors[0]})" if divisors else "another granularity"
    relation = "fewer than" if width < group_size else "no multiple of"
    return "weight.group_size", (f"its {width} input channels are {relation} group_size {group_size}; allowed: "
                                 f"{hint}, excluding the layer, or pad_groups=True to pad its last group")


def log_padded_groups(rows: Sequence[Any], modules: Mapping[str, nn.Module], level: int) -> None:
    """One line naming the layers a quantization pads (the user asked for it, or MX pads as Quark's does): padding
    is never silent."""
    padded = []
    for row in rows:
        pad = padded_width(modules[row.name], row.layer_config) if row.layer_config is not None else None
        if pad is not None:
            padded.append(f"{row.name or type(modules[row.name]).__name__} ({pad[0]} inputs, groups of {pad[1]})")
    if padded:
        logger.log(level, "Padding the last weight group of %d layer(s) (pad_groups or MX blocks): %s", len(padded),
                   ", ".join(padded))
