"""Canaries of the adapter: sampled MSE calibration (quark_brevitas/brevitas_adapter/mse.py).

Each test names the Brevitas internal it guards, so that a Brevitas release that renames or changes it fails
here, clearly, rather than somewhere deep in a quantization run.
"""

from __future__ import annotations

from helpers.adapter_layers import quant_linear

from quark_brevitas import brevitas_adapter as adapter


def test_mse_stats_module_interface() -> None:
    """sampled_activation_mse replaces MSE.mse_search per instance and MSE.mse_loss_fn per search."""
    from brevitas.core.stats.stats_op import MSE

    for name in ("mse_search", "mse_loss_fn", "evaluate_loss"):
        assert callable(getattr(MSE, name, None)), f"brevitas MSE lost {name}"
    from quark_brevitas.config import QTensorConfig
    from quark_brevitas.types import ParamType

    layer = quant_linear(act=QTensorConfig(param_type=ParamType.mse))
    modules = [m for m in layer.modules() if isinstance(m, MSE)]
    assert modules and all(m.stats_reduce_dim is None for m in modules)
    with adapter.sampled_activation_mse(layer):
        assert all("mse_search" in vars(m) for m in modules)
    assert not any("mse_search" in vars(m) or "mse_loss_fn" in vars(m) for m in modules)
