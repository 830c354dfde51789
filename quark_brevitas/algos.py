"""Pre-quantization optimisations and post-quantization algorithms (Quark's Brevitas ``algos``).

Each algorithm is a small dataclass (plain, serialisable data) with ``verify`` (called by
:func:`quark_brevitas.config.verify_config` before the model is touched) and ``apply`` (runs the
corresponding Brevitas algorithm). Names and parameters follow
``quark.torch.extensions.brevitas.algos``. Every loop over calibration data goes through
:func:`quark_brevitas.data.run_batches` (progress bar, batch checks, any batch shape).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from quark_brevitas.data import run_batches
from quark_brevitas.errors import ConfigError, UnsupportedAlgorithmError

if TYPE_CHECKING:
    from quark_brevitas.config import Config

logger = logging.getLogger(__name__)


@dataclass
class AlgorithmConfig:
    """Common base: parameter type checks, ``apply`` contract and the registry of subclasses."""

    name: ClassVar[str] = ""
    #: Whether ``apply`` loops over calibration data (the pipeline then requires a calib_loader).
    needs_data: ClassVar[bool] = True

    def verify(self, config: Config, path: str) -> None:
        """Check parameter types against the dataclass defaults; subclasses add semantic checks."""
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
                allowed = "True or False"
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool)
                allowed = "an integer"
            elif isinstance(default, float):
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                allowed = "a number"
            else:
                ok, allowed = True, ""
            if not ok:
                raise ConfigError(f"{path}.{f.name}", f"must be {allowed}, got {value!r}")

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.apply")


@dataclass
class PreQuantOptConfig(AlgorithmConfig):
    """An algorithm applied to the float model before quantization."""


@dataclass
class AlgoConfig(AlgorithmConfig):
    """An algorithm applied to the quantized, calibrated model."""


def _any_level_sets(config: Config, role: str) -> bool:
    """Whether some level of the hierarchy (global, layer type or layer name) quantizes ``role``."""
    levels = [config.global_quant_config, *config.layer_type_quant_config.values(),
              *config.layer_quant_config.values()]
    return any(getattr(level, role) is not None for level in levels)


def _uses_inputs(config: Config, path: str, what: str) -> None:
    if not _any_level_sets(config, "input_tensors"):
        raise ConfigError(path, f"{what} needs input_tensors quantization (at the global, layer-type or layer level)")


def _uses_weights(config: Config, path: str, what: str) -> None:
    if not _any_level_sets(config, "weight"):
        raise ConfigError(path, f"{what} needs weight quantization (at the global, layer-type or layer level)")


@dataclass
class Preprocess(PreQuantOptConfig):
    """Make the float model easier to quantize: FX trace, merge BatchNorm into the preceding
    convolution/linear, graph (weight) equalization and channel splitting.

    These steps need a graph. A model that cannot be FX-traced (most Hugging Face transformers) is
    passed through unchanged with one warning that says which steps were skipped and why, so the
    default pipeline still runs.
    """

    name: ClassVar[str] = "Pre-Processing"
    needs_data: ClassVar[bool] = False
    trace_model: bool = True
    equalize_iterations: int = 20
    equalize_merge_bias: bool = True
    merge_batch_norm: bool = True
    channel_splitting_ratio: float = 0.0
    channel_splitting_split_input: bool = False

    def verify(self, config: Config, path: str) -> None:
        super().verify(config, path)
        if self.equalize_iterations < 0:
            raise ConfigError(f"{path}.equalize_iterations", "must be >= 0")
        if not 0.0 <= self.channel_splitting_ratio < 1.0:
            raise ConfigError(f"{path}.channel_splitting_ratio", "must be in [0, 1)")

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        from brevitas.fx import GraphModule
        from brevitas.graph.quantize import preprocess_for_quantize

        graph_model = model
        if self.trace_model and not isinstance(model, GraphModule):
            try:
                graph_model = _trace_keeping_layers(model)
            except Exception as exc:  # noqa: BLE001 - any tracing failure means "no graph"; reported below
                logger.warning(
                    "Preprocess: %s cannot be FX-traced (%s: %s); skipping BatchNorm merge, graph "
                    "equalization and channel splitting, which need a graph. The model is quantized as is.",
                    type(model).__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                )
                return model
        if not isinstance(graph_model, GraphModule):
            logger.warning("Preprocess: trace_model=False and %s is not an FX GraphModule; skipping the "
                           "graph steps (BatchNorm merge, equalization, channel splitting)", type(model).__name__)
            return model
        return preprocess_for_quantize(
            graph_model,
            trace_model=False,
            equalize_iters=self.equalize_iterations,
            equalize_merge_bias=self.equalize_merge_bias,
            merge_bn=self.merge_batch_norm,
            channel_splitting_ratio=self.channel_splitting_ratio,
            channel_splitting_split_input=self.channel_splitting_split_input,
        )


def _trace_keeping_layers(model: nn.Module) -> nn.Module:
    """FX-trace ``model`` with Brevitas's tracer (its graph transforms need its backported FX
    classes), keeping every module that owns parameters as a leaf.

    The default tracer only keeps ``torch.nn`` modules whole; a user layer such as
    ``class MyLinear(nn.Linear)`` would be inlined into a bare ``linear`` call and could no longer be
    replaced by a mapping registered in the container's layer map.
    """
    from brevitas.fx import Tracer
    from brevitas.fx.brevitas_tracer import _symbolic_trace

    class LayerKeepingTracer(Tracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            return super().is_leaf_module(m, module_qualified_name) or bool(m._parameters)

    return _symbolic_trace(LayerKeepingTracer(), model, None)


@dataclass
class ActivationEqualization(PreQuantOptConfig):
    """SmoothQuant-style activation equalization: migrate activation outliers into the weights
    (``alpha`` sets how much). ``is_layerwise`` must match the layerwise backend."""

    name: ClassVar[str] = "Activation Equalization"
    is_layerwise: bool = True
    alpha: float = 0.5

    def verify(self, config: Config, path: str) -> None:
        super().verify(config, path)
        if not self.is_layerwise:
            raise ConfigError(f"{path}.is_layerwise", "must be True with Backend.layerwise")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{path}.alpha", f"must be in [0, 1], got {self.alpha}")

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        from brevitas.graph.equalize import activation_equalization_mode

        return _forward_in_mode(model, calib_loader, self.name, lambda m: activation_equalization_mode(
            m, alpha=self.alpha, layerwise=self.is_layerwise, add_mul_node=self.is_layerwise))


def _forward_in_mode(model: nn.Module, calib_loader: Any, name: str, mode: Callable[[nn.Module], Any]) -> nn.Module:
    """Run every calibration batch through ``model`` (eval, no grad) inside the Brevitas context
    ``mode(model)``, which collects what it needs from the forward passes and applies it on exit."""
    model.eval()
    with torch.no_grad(), mode(model):
        run_batches(model, calib_loader, name)
    return model


def _run_gpxq(mode: Any, calib_loader: Any, name: str) -> None:
    """Drive a Brevitas GPxQ context: one pass over the data per layer, then update that layer."""
    from tqdm.auto import tqdm

    algo_model = mode.model
    for _ in tqdm(range(mode.num_layers), desc=f"{name} layers", leave=False, disable=None):
        run_batches(algo_model, calib_loader, name)
        mode.update()


@dataclass
class GPTQ(AlgoConfig):
    """GPTQ (Frantar et al.): per-layer weight rounding that compensates the error with the inverse
    Hessian of the layer inputs. ``act_order`` processes columns by decreasing activation energy."""

    name: ClassVar[str] = "GPTQ"
    act_order: bool = False

    def verify(self, config: Config, path: str) -> None:
        super().verify(config, path)
        _uses_weights(config, path, "GPTQ")

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        from brevitas.graph.gptq import gptq_mode

        model.eval()
        with torch.no_grad(), gptq_mode(model, act_order=self.act_order, use_quant_activations=False) as mode:
            _run_gpxq(mode, calib_loader, self.name)
        return model


@dataclass
class GPFQ(AlgoConfig):
    """GPFQ (Lybrand & Saab; Zhang et al.): greedy path-following weight quantization that matches
    the float layer's output given the quantized inputs."""

    name: ClassVar[str] = "GPFQ"
    act_order: bool = False
    percentage_of_processed_inputs: float = 1.0

    def verify(self, config: Config, path: str) -> None:
        super().verify(config, path)
        _uses_weights(config, path, self.name)
        _uses_inputs(config, path, self.name)
        if self.percentage_of_processed_inputs != 1.0:
            raise ConfigError(
                f"{path}.percentage_of_processed_inputs",
                "the installed Brevitas (>= 0.12) always processes all inputs; only 1.0 is allowed",
            )

    def _mode(self, model: nn.Module) -> Any:
        from brevitas.graph.gpfq import gpfq_mode

        return gpfq_mode(model, act_order=self.act_order, use_quant_activations=True)

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        model.eval()
        with torch.no_grad(), self._mode(model) as mode:
            _run_gpxq(mode, calib_loader, self.name)
        return model


@dataclass
class GPFA2Q(GPFQ):
    """Accumulator-aware GPFQ (A2Q / AXE, Colbert et al.): GPFQ whose weights are constrained so
    that dot products never overflow an ``accumulator_bit_width``-bit accumulator."""

    name: ClassVar[str] = "GPFA2Q"
    accumulator_bit_width: int = 16

    def verify(self, config: Config, path: str) -> None:
        super().verify(config, path)
        if not 8 <= self.accumulator_bit_width <= 32:
            raise ConfigError(f"{path}.accumulator_bit_width", "must be in 8..32")
        _a2gpfq_mode()  # fail at config time if the installed Brevitas cannot do it

    def _mode(self, model: nn.Module) -> Any:
        return _a2gpfq_mode()(
            model, act_order=self.act_order, use_quant_activations=True,
            max_accumulator_bit_width=self.accumulator_bit_width,
        )


def _a2gpfq_mode() -> Any:
    try:
        from brevitas_examples.common.axe import a2gpfq_mode
    except ImportError as exc:
        raise UnsupportedAlgorithmError(
            "GPFA2Q needs brevitas_examples.common.axe.a2gpfq_mode (shipped with brevitas >= 0.11); "
            f"the installed Brevitas does not provide it ({exc})"
        ) from exc
    return a2gpfq_mode


@dataclass
class BiasCorrection(AlgoConfig):
    """Bias correction (Nagel et al.): shift each layer's bias by the mean output error that
    quantization introduced, measured on the calibration data."""

    name: ClassVar[str] = "Bias Correction"

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        from brevitas.graph.calibrate import bias_correction_mode

        return _forward_in_mode(model, calib_loader, self.name, bias_correction_mode)


@dataclass
class CalibrateBatchNorm(AlgoConfig):
    """Re-estimate BatchNorm running statistics on the quantized model (for BatchNorm layers that
    were not merged, e.g. with ``Preprocess(merge_batch_norm=False)``)."""

    name: ClassVar[str] = "Calibrate Batch Norm"

    def apply(self, model: nn.Module, calib_loader: Any = None) -> nn.Module:
        from brevitas.graph.calibrate import norm_correction_mode

        return _forward_in_mode(model, calib_loader, self.name, norm_correction_mode)


def dynamic_act_proxies(model: nn.Module) -> list[nn.Module]:
    """The activation quantizers whose scales come from each input at run time (dynamic per tensor, per
    token, per group and MX): they have nothing to calibrate."""
    from brevitas.proxy.float_runtime_quant import DynamicActFloatQuantProxyFromInjector
    from brevitas.proxy.groupwise_float_runtime_quant import GroupwiseActFloatQuantProxyFromInjector
    from brevitas.proxy.groupwise_int_runtime_quant import GroupwiseActQuantProxyFromInjector
    from brevitas.proxy.runtime_quant import DynamicActQuantProxyFromInjector

    dynamic = (DynamicActQuantProxyFromInjector, DynamicActFloatQuantProxyFromInjector,
               GroupwiseActQuantProxyFromInjector, GroupwiseActFloatQuantProxyFromInjector)
    return [m for m in model.modules() if isinstance(m, dynamic)]


@contextmanager
def _calibration_mode(model: nn.Module) -> Iterator[None]:
    """Brevitas calibration mode, except that dynamic activation quantizers keep quantizing: Brevitas would
    run them as observers, which fails for per-group ones and would show the static quantizers after them
    float values they never see at inference."""
    from brevitas.graph.calibrate import calibration_mode

    with calibration_mode(model):
        for proxy in dynamic_act_proxies(model):
            proxy.disable_quant = False
            for sub in proxy.modules():
                if hasattr(sub, "observer_only"):
                    sub.observer_only = False
        yield


def calibrate(model: nn.Module, calib_loader: Any) -> nn.Module:
    """Collect activation statistics for every static activation quantizer (Brevitas calibration mode)."""
    return _forward_in_mode(model, calib_loader, "Calibration", _calibration_mode)


def registered(base: type) -> list[type]:
    """All concrete algorithm classes deriving from ``base`` (for messages and deserialisation)."""
    found: list[type] = []
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls not in (PreQuantOptConfig, AlgoConfig):
            found.append(cls)
    return found


def algorithm_from_dict(data: Any, path: str, base: type) -> AlgorithmConfig:
    """Build an algorithm config from ``{"name": ClassName, **params}``."""
    classes = {cls.__name__: cls for cls in registered(base)}
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(path, f"must be a mapping with a 'name' key; allowed names: {sorted(classes)}")
    name = data["name"]
    if name not in classes:
        raise ConfigError(f"{path}.name", f"{name!r} is not a {base.__name__}; allowed: {sorted(classes)}")
    cls = classes[name]
    params = {k: v for k, v in data.items() if k != "name"}
    allowed = [f.name for f in fields(cls)]
    for key in params:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"unknown parameter of {name}; allowed: {allowed}")
    return cls(**params)


__all__ = [
    "ActivationEqualization",
    "AlgoConfig",
    "BiasCorrection",
    "CalibrateBatchNorm",
    "GPFA2Q",
    "GPFQ",
    "GPTQ",
    "PreQuantOptConfig",
    "Preprocess",
    "calibrate",
]
