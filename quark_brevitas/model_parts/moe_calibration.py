"""All-expert calibration of mixture-of-experts blocks (llm-compressor's ``calibrate_all_experts`` idea).

A router sends each token to a few experts, so on a calibration set of practical size some experts of a block
receive few tokens or none: their input quantizers would keep no statistics and GPTQ would find no Hessian (or
a rank-deficient one) for their layers. Before a block's data phase, :func:`all_expert_calibration` runs the
block's calibration inputs once through the float block, counting the tokens routed to each expert; the experts
that received fewer than ``Config.moe_min_expert_tokens`` are marked in :attr:`UnfusedExperts.fill
<quark_brevitas.model_parts.moe.UnfusedExperts>` for the rest of the data phase: they then compute on every token of
each batch (what statistics observers and Hessian hooks on their layers see), while the block still adds only their
routed tokens' rows to its output. Experts that routing reaches often enough keep their routed-token statistics,
as in the float model's own use. The decision is per block and made on the float block (before any of its
layers is quantized), so it does not depend on the algorithm that runs after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from quark_brevitas.model_parts.moe import UnfusedExperts

logger = logging.getLogger(__name__)

__all__ = ["all_expert_calibration"]


@contextlib.contextmanager
def all_expert_calibration(unit: nn.Module, data: Any, config: Any, name: str = "") -> Iterator[dict[str, list[int]]]:
    """Within the block, experts routed fewer than ``config.moe_min_expert_tokens`` tokens of ``data`` (a
    :class:`~quark_brevitas.calibration.data.CalibrationData` of ``unit``'s inputs) compute on every token (see
    the module docstring); yields ``{experts module: [expert indices filled]}`` (empty when the unit has no
    unfused experts, there is no data, or ``config.moe_calibrate_all_experts`` is off). The routing pass runs
    whenever the unit has unfused experts and data, so the coverage line (:func:`~quark_brevitas.model_parts.moe.
    log_expert_coverage`) reports the tokens routed in one pass over the block's data. The marks are removed on
    exit: inference routes as the model does."""
    modules = {n: m for n, m in unit.named_modules() if isinstance(m, UnfusedExperts)}
    if not modules or data is None:
        yield {}
        return
    for module in modules.values():
        module.tokens.zero_()
        module.seen.zero_()
    data.forward(unit, f"{name or 'model'}: tokens routed to each expert")
    on = getattr(config, "moe_calibrate_all_experts", True)
    minimum = config.moe_min_expert_tokens if on else 0
    filled: dict[str, list[int]] = {}
    for module_name, module in modules.items():
        # Summed over processes on sharded data: every process decides alike.
        counts = data.all_reduce(module.tokens.clone(), "sum").tolist()
        few = [index for index, count in enumerate(counts) if count < minimum]
        module.routed, module.block_tokens = counts, int(data.all_reduce(module.seen.clone(), "sum"))
        module.fill, module.fill_below = frozenset(few), minimum
        module.tokens.zero_()
        module.filled.zero_()
        if few:
            filled[module_name] = few
    try:
        yield filled
    finally:
        for module in modules.values():
            module.fill, module.routed = frozenset(), None
