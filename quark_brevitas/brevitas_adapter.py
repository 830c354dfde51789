"""The one door to Brevitas internals.

quark_brevitas builds on Brevitas's public classes (quantized layers, quantizer injectors, graph
algorithms), but some things it needs are Brevitas internals: global flags, private tracing,
attributes of quantizer proxies and quant tensors, the export managers' handler lists, quantizers
that ship in ``brevitas_examples``. Every such use lives here, behind a small function with a
docstring that says why it is needed; the rest of the package calls these functions. Each internal
relied on has one canary test (``tests/test_brevitas_adapter.py``) that fails with a clear message
if a Brevitas release changes it.

The supported Brevitas range is checked once, at import (:data:`SUPPORTED_BREVITAS`).
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import brevitas
import torch
from brevitas import config as _brevitas_config
from brevitas.graph import calibrate as _calibrate
from brevitas.nn.equalized_layer import EqualizedModule
from brevitas.nn.quant_layer import QuantWeightBiasInputOutputLayer
from brevitas.nn.quant_scale_bias import ScaleBias
from brevitas.proxy.float_parameter_quant import BiasFloatQuantProxyFromInjector, WeightFloatQuantProxyFromInjectorBase
from brevitas.proxy.float_runtime_quant import ActFloatQuantProxyFromInjectorBase, DynamicActFloatQuantProxyFromInjector
from brevitas.proxy.groupwise_float_runtime_quant import GroupwiseActFloatQuantProxyFromInjector
from brevitas.proxy.groupwise_int_runtime_quant import GroupwiseActQuantProxyFromInjector
from brevitas.proxy.parameter_quant import BiasQuantProxyFromInjectorBase, WeightQuantProxyFromInjectorBase
from brevitas.proxy.quant_proxy import QuantProxyFromInjector
from brevitas.proxy.runtime_quant import (
    ActQuantProxyFromInjectorBase,
    DynamicActQuantProxyFromInjector,
    TruncQuantProxyFromInjector,
)
from brevitas.quant_tensor import QuantTensor
from brevitas.utils.torch_utils import StopFwdException
from brevitas_examples.common.generative import quantizers as generative_quantizers
from packaging.version import Version
from torch import nn

from quark_brevitas.errors import NotPicklableError, QuarkBrevitasError

logger = logging.getLogger(__name__)

__all__ = [
    "FLOAT8_DTYPES",
    "IntWeightFormat",
    "SUPPORTED_BREVITAS",
    "EqualizedModule",
    "QuantLayer",
    "QuantizerSite",
    "StopFwdException",
    "Reducer",
    "WeightGrid",
    "a2gpfq_mode",
    "activation_equalization_mode",
    "all_reduce_statistics",
    "bias_correction_mode",
    "brevitas_version",
    "calibration_mode",
    "export_handler_proxy_types",
    "equalization_statistics",
    "float8_dtype",
    "full_state_dict",
    "gpfq_mode",
    "generative_quantizers",
    "gptq_mode",
    "gpxq_optimizers",
    "groupwise_parts",
    "has_static_activation_quantizers",
    "ignore_missing_keys",
    "init_weight_scales",
    "input_quantizer",
    "is_dynamic_activation",
    "is_float_quantizer",
    "is_groupwise",
    "int_weight_format",
    "iter_quantizers",
    "load_quant_model_mode",
    "mark_scale_initialised",
    "norm_correction_mode",
    "plain_tensor",
    "quantization_disabled",
    "quantizer_kind",
    "quantized_units",
    "quantizer_names",
    "require_onnxoptimizer",
    "reset_export_mode",
    "runtime_stats_modules",
    "restart_activation_statistics",
    "scale_impl",
    "scale_parameters",
    "symbolic_trace",
    "weight_grid",
    "weight_quant_disabled",
    "weight_quantization_pairs",
    "wrap_equalized",
]

#: The Brevitas releases this adapter was written and tested against: ``(lowest, first unsupported)``.
SUPPORTED_BREVITAS = ("0.13", "0.14")

#: Quantized layers with weight, bias, input and output quantizers (QuantLinear, QuantConv*, ...).
QuantLayer = QuantWeightBiasInputOutputLayer


def brevitas_version() -> str:
    """The installed Brevitas version."""
    return str(brevitas.__version__)


def _check_version() -> None:
    low, high = (Version(v) for v in SUPPORTED_BREVITAS)
    installed = Version(brevitas_version())
    if not low <= installed < high:
        raise QuarkBrevitasError(
            f"quark_brevitas supports Brevitas >= {low}, < {high}; Brevitas {installed} is installed. "
            f"Install a supported release: pip install 'brevitas>={low},<{high}'"
        )


_check_version()


# ===================================================================== pickling
def _reduce_injector(injector: type) -> str:
    """``pickle``'s reduction of a Brevitas quantizer (an injector class): one importable by its name (a
    Brevitas quantizer such as ``Int8WeightPerTensorFloat``) pickles by reference as before; one made at run
    time (``Base.let(...)``, how a config becomes a quantizer) cannot be re-created by name, and ``pickle``
    would fail with a ``PicklingError`` that names only the quantizer class. Say what to use instead."""
    module = sys.modules.get(injector.__module__)
    found: Any = module
    for part in injector.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is injector:
        return injector.__qualname__  # pickle's "a global of the object's module"
    raise NotPicklableError(
        f"a quantized model cannot be pickled (torch.save(model), pickle, multiprocessing): its quantizer "
        f"{injector.__qualname__} was made at run time from the config and cannot be re-created by name. Save "
        "it with quark_brevitas.save_quantized(model, directory) and load it with "
        "quark_brevitas.load_quantized(float_model, directory); or torch.save(model.state_dict())"
    )


def _register_pickling() -> None:
    """Route the pickling of every Brevitas injector class through :func:`_reduce_injector` (``copyreg`` is
    consulted by type, here the injectors' metaclass; ``copy.deepcopy`` copies classes by reference and is
    unaffected)."""
    from _dependencies.injector import _InjectorType
    from brevitas.inject import _ExtendedInjectorType

    for metaclass in (_InjectorType, _ExtendedInjectorType):
        copyreg.pickle(metaclass, _reduce_injector)


_register_pickling()


# Quantizers Brevitas ships in its examples package rather than in ``brevitas.quant`` (per-group weights,
# dynamic per-token / per-group activations): the translation table takes them from
# ``generative_quantizers`` (imported above) and from nowhere else.

# ===================================================================== global flags
@contextlib.contextmanager
def _flag(name: str, value: Any) -> Iterator[None]:
    previous = getattr(_brevitas_config, name)
    setattr(_brevitas_config, name, value)
    try:
        yield
    finally:
        setattr(_brevitas_config, name, previous)


def ignore_missing_keys() -> contextlib.AbstractContextManager[None]:
    """Let ``load_state_dict`` accept missing quantizer values.

    A float state dict has no quantizer parameters (their values are initialised from statistics on
    first use), and a calibrated model leaves uninitialised quantizers out of its state dict; Brevitas
    accepts such state dicts only with its global ``IGNORE_MISSING_KEYS`` flag set.
    """
    return _flag("IGNORE_MISSING_KEYS", True)


def full_state_dict() -> contextlib.AbstractContextManager[None]:
    """Make ``state_dict()`` include quantizer values that are not initialised yet (Brevitas's private
    ``_FULL_STATE_DICT`` flag): checkpoint loading compares the complete set of tensors."""
    return _flag("_FULL_STATE_DICT", True)


# ===================================================================== tracing
def symbolic_trace(model: nn.Module, is_leaf: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """FX-trace ``model`` with Brevitas's tracer (its graph transforms need its backported FX classes).

    ``is_leaf(module, qualified_name)`` keeps more modules whole than the default tracer does (which
    keeps only ``torch.nn`` modules); Brevitas offers a custom tracer only through its private
    ``_symbolic_trace``. Brevitas's FX backport reads ``treespec.children_specs``, which torch 2.13
    deprecates with a FutureWarning on every trace; that one warning is silenced here (nothing the user
    can act on), all others pass.
    """
    from brevitas.fx import Tracer
    from brevitas.fx.brevitas_tracer import _symbolic_trace

    class _Tracer(Tracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            leaf = super().is_leaf_module(m, module_qualified_name)
            return leaf or (is_leaf is not None and is_leaf(m, module_qualified_name))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`treespec\.children_specs` is deprecated", category=FutureWarning)
        return _symbolic_trace(_Tracer(), model, None)


def is_graph_module(model: nn.Module) -> bool:
    """Whether ``model`` is an FX graph module (torch's or Brevitas's backport)."""
    from brevitas.fx import GraphModule as BrevitasGraphModule

    return isinstance(model, torch.fx.GraphModule | BrevitasGraphModule)


# ===================================================================== quantizers
class QuantizerSite(NamedTuple):
    """One quantizer proxy of a model and where it sits.

    ``layer_name``: the module holding it (``""`` for the model itself); ``attribute``: its attribute
    name on that module (``weight_quant``, ``input_quant``, ``q_scaled_quant``, ...); ``kind``:
    ``weight``, ``bias``, ``act``, ``trunc`` or ``other`` (:func:`quantizer_kind`); ``name``: the
    proxy's own qualified module name.
    """

    layer_name: str
    attribute: str
    kind: str
    proxy: QuantProxyFromInjector
    layer: nn.Module
    name: str

    @property
    def role(self) -> str:
        """``weight``, ``bias``, ``input``, ``output`` for the quantizers of weight/bias layers, else the
        attribute name without its ``_quant`` suffix."""
        return self.attribute.removesuffix("_quant")


def quantizer_kind(proxy: nn.Module) -> str:
    """``weight``, ``bias``, ``act`` (activations), ``trunc`` or ``other``."""
    if isinstance(proxy, WeightQuantProxyFromInjectorBase):
        return "weight"
    if isinstance(proxy, BiasQuantProxyFromInjectorBase | BiasFloatQuantProxyFromInjector):
        return "bias"
    if isinstance(proxy, TruncQuantProxyFromInjector):
        return "trunc"
    if isinstance(proxy, ActQuantProxyFromInjectorBase):
        return "act"
    return "other"


def iter_quantizers(model: nn.Module, *, enabled_only: bool = True) -> Iterator[QuantizerSite]:
    """Every quantizer proxy of ``model``, in module order (the one walk every module uses).

    With ``enabled_only`` (the default) proxies whose quantization is disabled are skipped. Proxies
    are not searched for nested proxies.
    """
    modules = dict(model.named_modules())
    for name, proxy in modules.items():
        if not isinstance(proxy, QuantProxyFromInjector):
            continue
        if enabled_only and not proxy.is_quant_enabled:
            continue
        layer_name, _, attribute = name.rpartition(".")
        yield QuantizerSite(layer_name, attribute, quantizer_kind(proxy), proxy, modules[layer_name], name)


def quantizer_names(model: nn.Module) -> set[str]:
    """Qualified names of every quantizer proxy (enabled or not); their internals are Brevitas's."""
    return {site.name for site in iter_quantizers(model, enabled_only=False)}


def is_groupwise(proxy: nn.Module) -> bool:
    """Whether the proxy quantizes in groups (per-group or MX)."""
    return bool(getattr(proxy, "is_groupwise", False))


def is_dynamic_activation(proxy: nn.Module) -> bool:
    """Whether an activation quantizer computes its scale from each input at run time (dynamic per
    tensor / per token, per group, MX): it has nothing to calibrate and no ONNX QCDQ form."""
    dynamic = (DynamicActQuantProxyFromInjector, DynamicActFloatQuantProxyFromInjector,
               GroupwiseActQuantProxyFromInjector, GroupwiseActFloatQuantProxyFromInjector)
    return isinstance(proxy, dynamic)


def is_float_quantizer(proxy: nn.Module) -> bool:
    """Whether the proxy quantizes to a minifloat format (fp8, fp6, fp4, MXFP)."""
    return isinstance(proxy, WeightFloatQuantProxyFromInjectorBase | ActFloatQuantProxyFromInjectorBase
                      | BiasFloatQuantProxyFromInjector)


def injector_value(proxy: nn.Module, name: str, default: Any = None) -> Any:
    """A value of the proxy's quant injector (e.g. a bias's static ``bit_width``, the rounding
    ``float_to_int_impl``), or ``default`` if the injector does not define it."""
    injector = getattr(proxy, "quant_injector", None)
    if injector is None or name not in injector:
        return default
    return getattr(injector, name)


def groupwise_parts(quant_tensor: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """``(value, scale, zero_point, group_dim, group_size)`` of a group-wise quant tensor, in its
    grouped layout (``[..., groups, group_size, ...]``): Brevitas keeps them in private fields."""
    zero_point = getattr(quant_tensor, "zero_point_", None)
    return (quant_tensor.value_, quant_tensor.scale_, zero_point, int(quant_tensor.group_dim),
            int(quant_tensor.group_size))


@contextlib.contextmanager
def _quant_switched(proxy: nn.Module, disable: bool) -> Iterator[None]:
    previous = proxy.disable_quant
    proxy.disable_quant = disable
    try:
        yield
    finally:
        proxy.disable_quant = previous


def weight_quant_disabled(proxy: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Pass the weight through ``proxy`` unquantized while the context lasts."""
    return _quant_switched(proxy, True)


# ===================================================================== scales
def scale_impl(proxy: nn.Module) -> nn.Module | None:
    """The module holding the proxy's learnable scale (a ``value`` parameter), if it has one."""
    for module in proxy.modules():
        if isinstance(getattr(module, "value", None), nn.Parameter):
            return module
    return None


def scale_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every learnable scale / threshold parameter of the model, by qualified parameter name.

    Brevitas keeps them inside each proxy's ``scaling_impl`` (zero points live elsewhere).
    """
    found: dict[str, nn.Parameter] = {}
    for site in iter_quantizers(model, enabled_only=False):
        for name, param in site.proxy.named_parameters():
            if "scaling_impl" in name.split("."):
                found[f"{site.name}.{name}"] = param
    return found


def mark_scale_initialised(impl: nn.Module) -> None:
    """Tell a scale module that its value is final: parameter-from-stats scalings stop initialising
    from statistics (``init_done``), runtime-stats scalings stop collecting (``counter``)."""
    if hasattr(impl, "init_done"):
        impl.init_done = True
    if hasattr(impl, "counter"):
        impl.counter = getattr(impl, "collect_stats_steps", impl.counter) + 1


def init_weight_scales(model: nn.Module) -> None:
    """Compute every weight scale (and zero point) from its float weight now.

    Parameter-from-stats weight scales are otherwise initialised lazily on the first quantized
    forward pass; doing it at replacement makes weight-only quantization data-free and gives
    GPTQ/GPFQ the initialised grid they require (calibration mode does not touch weight quantizers).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantLayer) and module.weight_quant.is_quant_enabled:
                module.quant_weight()


# ===================================================================== float8
#: (exponent bits, mantissa bits, exponent bias) -> the torch dtype holding that fp8 format exactly
#: (OCP e4m3 / e5m2, and the FNUZ variants with their larger bias).
FLOAT8_DTYPES: dict[tuple[int, int, int], torch.dtype] = {
    (4, 3, 7): torch.float8_e4m3fn,
    (5, 2, 15): torch.float8_e5m2,
    (4, 3, 8): torch.float8_e4m3fnuz,
    (5, 2, 16): torch.float8_e5m2fnuz,
}


def float8_dtype(exponent_bits: int, mantissa_bits: int, *, fnuz: bool = False) -> torch.dtype | None:
    """The torch float8 dtype of an fp8 format (OCP unless ``fnuz``), or ``None`` if it has none."""
    bias = 2 ** (exponent_bits - 1) - 1 + int(fnuz)
    return FLOAT8_DTYPES.get((exponent_bits, mantissa_bits, bias))


# ===================================================================== modes and algorithms
@contextlib.contextmanager
def calibration_mode(model: nn.Module) -> Iterator[None]:
    """Brevitas calibration mode, except that dynamic activation quantizers keep quantizing.

    Brevitas runs every activation quantizer as an observer in this mode, which fails for per-group
    ones and would show the static quantizers after them float values they never see at inference.
    """
    with _calibrate.calibration_mode(model):
        for site in iter_quantizers(model, enabled_only=False):
            if site.kind == "act" and is_dynamic_activation(site.proxy):
                site.proxy.disable_quant = False
                for sub in site.proxy.modules():
                    if hasattr(sub, "observer_only"):
                        sub.observer_only = False
        yield


def quantization_disabled(model: nn.Module, *, act: bool = True, weight: bool = True, bias: bool = True
                          ) -> contextlib.AbstractContextManager[Any]:
    """Run ``model`` with the chosen kinds of quantization switched off (float forward)."""
    return _calibrate.quantization_status_manager(model, disable_act_quant=act, disable_weight_quant=weight,
                                                  disable_bias_quant=bias)


def bias_correction_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's bias correction: collects the mean output error per layer, corrects it on exit."""
    return _calibrate.bias_correction_mode(model)


def norm_correction_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's BatchNorm statistics re-estimation on the quantized model."""
    return _calibrate.norm_correction_mode(model)


def load_quant_model_mode(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Loading a state dict marks every loaded quantizer value as initialised (no re-derivation)."""
    return _calibrate.load_quant_model_mode(model)


def activation_equalization_mode(model: nn.Module, alpha: float) -> contextlib.AbstractContextManager[Any]:
    """Brevitas's layerwise (SmoothQuant-style) activation equalization, with scale modules."""
    from brevitas.graph.equalize import activation_equalization_mode as mode

    return mode(model, alpha=alpha, layerwise=True, add_mul_node=True)


def gptq_mode(model: nn.Module, *, act_order: bool) -> Any:
    """Brevitas's GPTQ context (float inputs to each layer). GPTQ does not need the float copy of each
    weight that Brevitas's GPxQ base class keeps by default, so none is made."""
    from brevitas.graph.gptq import gptq_mode as mode

    from quark_brevitas.brevitas_adapter_cache import gptq_class_checking_once

    return mode(model, act_order=act_order, use_quant_activations=False, create_weight_orig=False,
                gptq_class=gptq_class_checking_once())


def gpfq_mode(model: nn.Module, *, act_order: bool) -> Any:
    """Brevitas's GPFQ context (quantized inputs to each layer)."""
    from brevitas.graph.gpfq import gpfq_mode as mode

    return mode(model, act_order=act_order, use_quant_activations=True)


def a2gpfq_mode(model: nn.Module, *, act_order: bool, accumulator_bit_width: int) -> Any:
    """Accumulator-aware GPFQ (AXE), which Brevitas ships in ``brevitas_examples``."""
    return _a2gpfq_class()(model, act_order=act_order, use_quant_activations=True,
                           max_accumulator_bit_width=accumulator_bit_width)


def _a2gpfq_class() -> Any:
    try:
        from brevitas_examples.common.axe import a2gpfq_mode as mode
    except ImportError as exc:
        raise QuarkBrevitasError(
            "GPFA2Q needs brevitas_examples.common.axe.a2gpfq_mode (shipped with brevitas >= 0.11); "
            f"the installed Brevitas does not provide it ({exc})"
        ) from exc
    return mode


def a2gpfq_available() -> bool:
    """Whether the installed Brevitas ships accumulator-aware GPFQ."""
    try:
        _a2gpfq_class()
    except QuarkBrevitasError:
        return False
    return True


# ===================================================================== equalized layers
def wrap_equalized(layer: nn.Module, num_features: int, runtime_shape: list[int]) -> nn.Module:
    """``layer`` behind a per-channel input scale module (what activation equalization inserts),
    with unit scales: the structure of an equalized layer, whose scales a state dict then fills."""
    return EqualizedModule(ScaleBias(num_features, bias=False, runtime_shape=tuple(runtime_shape)), layer)


def equalized_scale_shape(module: nn.Module) -> tuple[int, list[int]] | None:
    """``(num_features, runtime_shape)`` of an equalized layer's scale module; ``None`` otherwise."""
    if not isinstance(module, EqualizedModule):
        return None
    scale = module.scale
    return int(scale.num_features), [int(d) for d in scale.runtime_shape]


# ===================================================================== export
def export_handler_proxy_types(manager: Any) -> frozenset[type]:
    """The proxy types an export manager (QCDQ, QONNX) has a handler for (its private handler list)."""
    types: set[type] = set()
    for handler in manager.handlers:
        layer = handler.handled_layer
        types.update(layer if isinstance(layer, tuple) else (layer,))
    return frozenset(types)


def reset_export_mode(model: nn.Module, manager: Any) -> None:
    """Leave Brevitas's export mode after a failed export (export mode and cached activations must not
    leak into the model's later use). Best effort: a failure here must not mask the export error."""
    try:
        manager.set_export_mode(model, enabled=False)
    except Exception:  # noqa: BLE001 - cleanup must not mask the original error
        logger.debug("could not reset Brevitas export mode", exc_info=True)
    for module in model.modules():
        if hasattr(module, "cache_inference_quant_act_backup"):
            module.cache_inference_quant_act = module.cache_inference_quant_act_backup
            del module.cache_inference_quant_act_backup


def require_onnxoptimizer() -> None:
    """Brevitas's TorchScript ONNX exporters refuse to run without onnxoptimizer installed; say so
    clearly before an export starts rather than from inside Brevitas."""
    try:
        import onnxoptimizer  # noqa: F401 - only its presence matters
    except ImportError as exc:
        raise QuarkBrevitasError(
            f"ONNX export needs the onnxoptimizer package, which Brevitas's exporter requires ({exc}); "
            "install it with pip install onnxoptimizer"
        ) from exc


# ===================================================================== statistics across processes
#: ``reduce(tensor, op)``: combine ``tensor`` in place with the same tensor of every other process (``op``:
#: ``"sum"`` or ``"max"``) and return it; :meth:`quark_brevitas.data.CalibrationData.all_reduce`.
Reducer = Callable[[torch.Tensor, str], torch.Tensor]


def all_reduce_statistics(model: nn.Module, reduce: Reducer) -> int:
    """Combine the statistics Brevitas accumulated inside ``model`` during a pass over this process's share
    of the calibration data with those of the other processes; return how many were combined.

    Brevitas keeps these statistics in its own objects, which only this module may touch:

    - activation calibration: each runtime-statistics scale / zero point averages per-batch statistics
      (``buffer`` over ``counter`` batches) -> the batch-weighted mean over the processes;
    - GPTQ: each layer's Hessian ``H`` is a mean over ``nsamples`` input rows -> the sample-weighted mean;
    - GPFQ (and accumulator-aware GPFQ): ``H`` and ``G`` are sums over batches -> the sum;
    - layerwise activation equalization: per-channel input ranges are maxima -> the maximum;
    - BatchNorm re-estimation: running statistics averaged over ``num_batches_tracked`` batches -> the
      batch-weighted mean.

    Bias correction synchronises itself (Brevitas's ``bias_correction_mode`` all-reduces its correction
    when ``torch.distributed`` is initialised). Every process must run the same model, so the objects are
    found in the same order everywhere; the result is the single-process statistic up to float summation
    order.
    """
    return (_reduce_runtime_stats(model, reduce) + _reduce_gpxq(model, reduce)
            + _reduce_equalization(model, reduce) + _reduce_norm_correction(model, reduce))


def _weighted_mean(tensors: list[torch.Tensor], local: int, total: float, reduce: Reducer) -> None:
    """Replace each tensor, a mean over ``local`` items here, by the mean over all processes' items."""
    for tensor in tensors:
        combined = reduce(tensor.detach().to(torch.float64) * local, "sum") / total
        tensor.detach().copy_(combined.to(tensor.dtype))


def _counts(values: list[float], device: torch.device, reduce: Reducer) -> list[float]:
    counts = torch.tensor(values, dtype=torch.float64, device=device)
    return reduce(counts, "sum").tolist()


def runtime_stats_modules(model: nn.Module) -> list[nn.Module]:
    """The runtime-statistics scales and zero points of ``model`` still collecting statistics (Brevitas's
    ``ParameterFromRuntimeStatsScaling`` / ``ParameterFromRuntimeZeroPoint`` whose ``counter`` has not passed
    ``collect_stats_steps``): the activation quantizers calibration is initialising."""
    from brevitas.core.scaling.standalone import ParameterFromRuntimeStatsScaling
    from brevitas.core.zero_point import ParameterFromRuntimeZeroPoint

    kinds = (ParameterFromRuntimeStatsScaling, ParameterFromRuntimeZeroPoint)
    return [m for m in model.modules() if isinstance(m, kinds) and m.counter <= m.collect_stats_steps]


def _mean_over_processes(entries: list[tuple[int, list[torch.Tensor], Callable[[int], None]]],
                         reduce: Reducer) -> int:
    """Statistics that are means: each entry is (how many items its tensors average here, the tensors, how to
    record the new count). Entries without an item on any process are left alone."""
    if not entries:
        return 0
    totals = _counts([float(count) for count, _, _ in entries], entries[0][1][0].device, reduce)
    done = 0
    for (count, tensors, set_count), total in zip(entries, totals):
        if total > 0:
            _weighted_mean(tensors, count, total, reduce)
            set_count(int(total))
            done += 1
    return done


def _reduce_runtime_stats(model: nn.Module, reduce: Reducer) -> int:
    return _mean_over_processes([(m.counter, [m.buffer], functools.partial(setattr, m, "counter"))
                                 for m in runtime_stats_modules(model)], reduce)


def gpxq_optimizers(model: nn.Module) -> list[Any]:
    """The per-layer GPTQ / GPFQ objects of a GPxQ context running on ``model`` that still wait for their
    update, in module order: Brevitas keeps them in the context, and reaches them from the model only
    through the forward pre-hook each registers on its layer (a ``partial`` of its ``update_batch``)."""
    from brevitas.graph.gpxq import GPxQ

    found = []
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook.func, "__self__", None) if isinstance(hook, functools.partial) else None
            if isinstance(owner, GPxQ):
                found.append(owner)
    return found


def _reduce_gpxq(model: nn.Module, reduce: Reducer) -> int:
    from brevitas.graph.gpfq import GPFQ
    from brevitas.graph.gptq import GPTQ

    pending = [o for o in gpxq_optimizers(model) if hasattr(o, "H")]
    unknown = [o for o in pending if not isinstance(o, GPTQ | GPFQ)]
    if unknown:
        raise QuarkBrevitasError(f"distributed calibration cannot combine the statistics of "
                                 f"{type(unknown[0]).__name__} (layer {unknown[0].name})")
    # GPTQ's Hessian is a mean over input rows; GPFQ's H and G are sums over batches (a non-zero H means data).
    done = _mean_over_processes([(o.nsamples, [o.H], functools.partial(setattr, o, "nsamples"))
                                 for o in pending if isinstance(o, GPTQ)], reduce)
    sums = [o for o in pending if isinstance(o, GPFQ)]
    if sums:
        totals = _counts([float(bool(o.H.any())) for o in sums], sums[0].H.device, reduce)
        for optimizer, total in zip(sums, totals):
            if total > 0:
                reduce(optimizer.H, "sum")
                reduce(optimizer.G, "sum")
                done += 1
    return done


def equalization_statistics(model: nn.Module) -> list[tuple[Any, Any]]:
    """``(owner, key)`` of every per-channel input range layerwise activation equalization is collecting in
    ``model``: Brevitas wraps each layer in a ``KwargsForwardHook`` whose hook is a ``partial`` of the
    equalization object's ``forward_stats_hook``; the ranges live in that object's ``float_act_map[key]``."""
    from brevitas.utils.torch_utils import KwargsForwardHook

    found = []
    for module in model.modules():
        hook = getattr(module, "hook_fn", None)
        if isinstance(module, KwargsForwardHook) and isinstance(hook, functools.partial):
            owner = getattr(hook.func, "__self__", None)
            if owner is not None and hasattr(owner, "float_act_map"):
                found.append((owner, hook.keywords["name"]))
    return found


def _reduce_equalization(model: nn.Module, reduce: Reducer) -> int:
    done = 0
    for owner, key in equalization_statistics(model):
        value = owner.float_act_map.get(key)
        if value is not None:
            reduce(value, "max")
            done += 1
    return done


def _reduce_norm_correction(model: nn.Module, reduce: Reducer) -> int:
    """BatchNorm layers inside Brevitas's ``norm_correction_mode`` (marked by its ``old_running_mean``
    buffer) average their statistics over ``num_batches_tracked`` batches (momentum ``None``)."""
    layers = [m for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and hasattr(m, "old_running_mean")]
    return _mean_over_processes([(int(m.num_batches_tracked), [m.running_mean, m.running_var],
                                  m.num_batches_tracked.fill_) for m in layers], reduce)
# ===================================================================== weight grids and statistics (LLM algorithms)
class WeightGrid(NamedTuple):
    """The integer grid a layer's weight quantizer puts its weight on, per weight element.

    ``scale`` and ``zero_point`` are broadcast to the weight's shape (``[out, in]`` for Linear layers), so column
    ``j`` of the weight uses ``scale[:, j]`` whatever the granularity (per tensor, per channel, per group).
    :meth:`quantize` repeats Brevitas's integer quantization (``IntQuant``) operation for operation, so values it
    returns are exactly what Brevitas's quantized weight holds for them.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    min_int: torch.Tensor
    max_int: torch.Tensor
    to_int: Callable[[torch.Tensor], torch.Tensor]
    clamp: Callable[..., torch.Tensor]
    bit_width: int

    def quantize(self, weight: torch.Tensor, columns: Any = slice(None)) -> torch.Tensor:
        """``weight`` (the weight, or its ``columns``) quantized and dequantized on this grid."""
        return self.quantize_values(weight, self.scale[:, columns], self.zero_point[:, columns])

    def quantize_values(self, values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        """``values`` quantized and dequantized with ``scale`` / ``zero_point`` (slices of this grid's, of the
        same shape): :meth:`quantize` without the slicing, for GPTQ's column loop.

        Brevitas's usual ``RoundSte`` / ``TensorClamp`` modules are ``torch.round`` and a clamp written with two
        ``torch.where``: for them the same values come from ``torch.round`` and ``torch.clamp`` directly, without a
        module call and an autograd function per column (a third of GPTQ's column loop)."""
        if _plain_round_and_clamp(self.to_int, self.clamp):
            codes = torch.clamp(torch.round(values / scale + zero_point), self.min_int, self.max_int)
        else:
            codes = self.clamp(self.to_int(values / scale + zero_point), min_val=self.min_int, max_val=self.max_int)
        return (codes - zero_point) * scale


def _plain_round_and_clamp(to_int: Any, clamp: Any) -> bool:
    """Whether ``to_int`` / ``clamp`` are exactly Brevitas's round-half-to-even ``RoundSte`` and ``TensorClamp``
    (subclasses may round or clamp differently)."""
    from brevitas.core.function_wrapper.clamp import TensorClamp
    from brevitas.core.function_wrapper.ops_ste import RoundSte

    return type(to_int) is RoundSte and type(clamp) is TensorClamp


def _int_weight_quant(layer: nn.Module) -> Any:
    """The layer's integer weight quantizer proxy and its ``IntQuant`` (whether or not quantization is switched off
    for the moment, e.g. by :func:`quantization_disabled`)."""
    proxy = getattr(layer, "weight_quant", None)
    int_quant = getattr(getattr(proxy, "tensor_quant", None), "int_quant", None)
    if not isinstance(proxy, WeightQuantProxyFromInjectorBase) or int_quant is None:
        raise QuarkBrevitasError(f"{type(layer).__name__} has no integer weight quantizer")
    return proxy, int_quant


def _restore_initial_values(modules: Iterable[nn.Module], initial: dict[type, float]) -> int:
    """Put statistics-initialised scale / zero-point modules back in their state before initialisation: ``value``
    (and the runtime statistics' ``buffer``) to their initial value (1 for scales, 0 for zero points, which the
    first statistic multiplies or is added to), ``init_done`` / ``counter`` back to the start; returns how many."""
    count = 0
    with torch.no_grad():
        for module in modules:
            value = initial.get(type(module))
            if value is None:
                continue
            module.value.fill_(value)
            if hasattr(module, "buffer"):
                module.buffer.fill_(value)
            if hasattr(module, "init_done"):
                module.init_done = False
            if hasattr(module, "counter"):
                module.counter = 0
            count += 1
    return count


def weight_grid(layer: nn.Module, weight: torch.Tensor | None = None) -> WeightGrid:
    """(Re-)initialise ``layer``'s integer weight quantizer from ``weight`` (default: the layer's own weight) and
    return its grid.

    The library's weight quantizers compute their scale (and zero point) once from the float weight and keep it
    as a parameter (``init_done``); algorithms that change the weight (AWQ's scaling and clipping) or choose the
    grid for a weight they are still building (GPTQ) re-initialise it from the tensor they mean. Passing a tensor
    other than the layer's weight works because a weight quantizer tracking one parameter takes its statistics
    from the tensor it is called with.
    """
    from brevitas.core.scaling.standalone import ParameterFromStatsFromParameterScaling
    from brevitas.core.zero_point import ParameterFromStatsFromParameterZeroPoint

    proxy, int_quant = _int_weight_quant(layer)
    target = layer.weight if weight is None else weight
    _restore_initial_values(proxy.modules(), {ParameterFromStatsFromParameterScaling: 1.0,
                                              ParameterFromStatsFromParameterZeroPoint: 0.0})
    with torch.no_grad(), _quant_switched(proxy, False):  # also inside quantization_disabled
        quant = proxy(target)
    bit_width = quant.bit_width
    scale = quant.scale.expand_as(target).detach()
    zero_point = torch.as_tensor(quant.zero_point, dtype=scale.dtype, device=scale.device).expand_as(target).detach()
    return WeightGrid(scale, zero_point, int_quant.min_int(bit_width), int_quant.max_int(bit_width),
                      int_quant.float_to_int_impl, int_quant.tensor_clamp_impl, int(bit_width))


class IntWeightFormat(NamedTuple):
    """The format of an integer weight quantizer: bits, elements per group (-1: no groups) and whether one scale
    covers the whole tensor."""

    bit_width: int
    group_size: int
    per_tensor: bool


def int_weight_format(layer: nn.Module) -> IntWeightFormat | None:
    """The format of ``layer``'s integer weight quantizer, or ``None`` if the layer has none (float formats, or no
    weight quantization)."""
    try:
        proxy, _ = _int_weight_quant(layer)
    except QuarkBrevitasError:
        return None
    with torch.no_grad(), _quant_switched(proxy, False):
        bit_width = int(proxy.bit_width())
        scale = proxy.scale()
    group_size = int(injector_value(proxy, "group_size")) if is_groupwise(proxy) else -1
    return IntWeightFormat(bit_width, group_size, group_size == -1 and scale.numel() == 1)


def restart_activation_statistics(model: nn.Module) -> int:
    """Make the static activation quantizers of ``model`` forget their calibration, so that the next calibration
    starts afresh; returns how many were reset.

    Brevitas's runtime-statistics scales and zero points keep a step counter, fold the first statistic into their
    buffer and the final average into their value, both starting from 1 (a scale) or 0 (a zero point);
    recalibrating after an algorithm has changed a layer's inputs (AWQ's folded scales) needs all three restored.
    """
    from brevitas.core.scaling.standalone import ParameterFromRuntimeStatsScaling
    from brevitas.core.zero_point import ParameterFromRuntimeZeroPoint

    initial = {ParameterFromRuntimeStatsScaling: 1.0, ParameterFromRuntimeZeroPoint: 0.0}
    return sum(_restore_initial_values(site.proxy.modules(), initial) for site in iter_quantizers(model)
               if site.kind == "act" and not is_dynamic_activation(site.proxy))


def has_static_activation_quantizers(model: nn.Module) -> bool:
    """Whether ``model`` has an enabled activation quantizer whose scale comes from calibration."""
    return any(site.kind == "act" and not is_dynamic_activation(site.proxy) for site in iter_quantizers(model))


# ===================================================================== analysis (quark_brevitas.analysis)
def quantized_units(model: nn.Module, quant_classes: Iterable[type]) -> dict[str, nn.Module]:
    """The layers the backend replaced, by the name the config hierarchy gives them: the outermost modules of
    one of ``quant_classes`` (the layer map's quantized classes), so the q/k/v projections of a quantized
    attention belong to the attention. A layer inside an ``EqualizedModule`` (activation equalization puts
    ``fc1`` behind a scale as ``fc1.layer``) is reported as the wrapper, under the wrapper's name: the name
    ``layer_quant_config``/``exclude`` use, and the module whose input is the model's own tensor.

    The analysis tools hook, toggle and re-run these units; the wrapper's ``layer`` attribute is Brevitas's.
    """
    classes = tuple(quant_classes)
    modules = dict(model.named_modules())
    units: dict[str, nn.Module] = {}
    for name, module in modules.items():
        if type(module) not in classes:
            continue
        if "" in units or any(name.startswith(unit + ".") for unit in units):
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = modules.get(parent_name) if name else None
        if isinstance(parent, EqualizedModule) and attribute == "layer":
            name, module = parent_name, parent
        units[name] = module
    return units


def weight_quantization_pairs(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(float weight, quantized weight)`` of every enabled weight quantizer in ``module`` (one pair for a
    Linear or a convolution, one per projection for an attention), both in the weight's own layout.

    The quantized value is the dequantized quant tensor that the layer computes with (``quant_weight()``'s
    ``value``; group-wise quant tensors give it back in the weight's layout).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, QuantLayer) and layer.weight_quant.is_quant_enabled:
                pairs.append((layer.weight.detach(), plain_tensor(layer.quant_weight()).detach()))
    return pairs


def input_quantizer(module: nn.Module) -> nn.Module | None:
    """The quantizer of the input a quantized layer computes with: the ``input_quant`` proxy of the first
    weight layer inside ``module`` (the layer itself, or an attention's query projection). It is called
    whether enabled or not (disabled, it passes the tensor through), so a forward hook on it sees the input
    as the layer consumes it. ``None`` if ``module`` holds no such layer."""
    for layer in module.modules():
        if isinstance(layer, QuantLayer):
            return layer.input_quant
    return None


def plain_tensor(value: Any) -> Any:
    """The dequantized ``torch.Tensor`` of a Brevitas quant tensor; anything else unchanged."""
    from brevitas.quant_tensor import QuantTensor

    return value.value if isinstance(value, QuantTensor) else value


# ===================================================================== half-precision models
#: Floating dtypes whose models get float32 quantizers (see :func:`keep_quantizers_float32`).
HALF_DTYPES = (torch.float16, torch.bfloat16)
_IO_DTYPE = "_quark_brevitas_io_dtype"


def _quantizer_inputs_float32(proxy: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: half-precision tensor arguments go into the quantizer as float32; the dtype
    of the first one is remembered for :func:`_quantizer_output_in_model_dtype`."""
    dtype = None
    cast = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dtype in HALF_DTYPES:
            dtype = dtype or arg.dtype
            arg = arg.float()
        cast.append(arg)
    object.__setattr__(proxy, _IO_DTYPE, dtype)
    return tuple(cast) if dtype is not None else args


def _quantizer_output_in_model_dtype(proxy: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook: the quantizer's result goes back to the dtype its input had. Of a quant tensor
    only the values are cast (its first field: ``value`` or a group-wise ``value_``); scales and zero
    points stay float32, as computed."""
    dtype = proxy.__dict__.get(_IO_DTYPE)
    if dtype is None:
        return output
    if isinstance(output, torch.Tensor):
        return output.to(dtype)
    if isinstance(output, QuantTensor):
        return output._replace(**{output._fields[0]: output[0].to(dtype)})
    return output


def float32_quantizer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A quantized layer's keyword arguments with every quantizer injector creating float32 state.

    Brevitas derives a weight or bias quantizer's dtype from the tracked parameter (a float16 weight
    gives a float16 scale) and re-creates the quantizer with it whenever a state dict is loaded; an
    explicit ``dtype`` in the injector keeps the quantizers of a half-precision model in float32 for
    good (see :func:`keep_quantizers_float32`).
    """
    return {key: value.let(dtype=torch.float32) if key.endswith("_quant") and hasattr(value, "let") else value
            for key, value in kwargs.items()}


def keep_quantizers_float32(model: nn.Module) -> None:
    """Make the quantizers of a float16/bfloat16 model compute in float32, and keep their state there.

    Brevitas creates activation scales, zero points and bias quantizers in float32 but weight scales
    in the weight's dtype, and multiplies half-precision tensors with float32 scales, so a quantized
    half model mixes dtypes and fails on its first forward pass (``Float and Half``). Here every
    quantizer's parameters and buffers are float32, and each quantizer proxy gets a pair of hooks:
    half-precision inputs are quantized in float32 (no int32-bias overflow, no bfloat16 division
    error in the scale search) and the quantized values are returned in the input's dtype, so the
    layers compute in the model's dtype. Hooks are module-level functions, so the model deep-copies
    and pickles; in a float32 copy of the model they do nothing.
    """
    for site in iter_quantizers(model, enabled_only=False):
        proxy = site.proxy
        proxy.float()
        if _quantizer_inputs_float32 not in proxy._forward_pre_hooks.values():
            proxy.register_forward_pre_hook(_quantizer_inputs_float32)
            proxy.register_forward_hook(_quantizer_output_in_model_dtype)


# ===================================================================== tied parameters
def adopt_parameters(new: nn.Module, old: nn.Module) -> None:
    """Give a freshly built quantized layer the float layer's own ``Parameter`` objects (same name,
    shape and dtype); its weight and bias quantizers are rebuilt around them.

    Brevitas's replacement loads the float layer's state into new ``Parameter`` objects that share its
    storage: a tie (``lm_head.weight is embed.weight``) silently becomes two parameters over one
    storage, which a weight-changing algorithm then edits together and an optimizer updates twice.
    Registering ``weight``/``bias`` on a Brevitas layer re-initialises its quantizer for the new
    tensor (``QuantWeightMixin.register_parameter``); nothing is initialised yet at this point, so
    nothing is lost.
    """
    kept_apart = getattr(new, "float_layout_differs", ())  # e.g. QuantConv1D holds Conv1D's weight transposed
    for name, param in old._parameters.items():
        current = new._parameters.get(name)
        if param is None or current is None or current is param or name in kept_apart:
            continue
        if current.shape == param.shape and current.dtype == param.dtype:
            setattr(new, name, param)


def swap_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in place of ``module``'s parameter ``name`` (same shape) while keeping its quantizers'
    state: registering ``weight`` or ``bias`` on a Brevitas layer would re-initialise its quantizer and
    drop its scale, so the parameter table is written directly."""
    module._parameters[name] = param


# ===================================================================== MSE activation calibration
#: Values of one calibration batch on which the MSE search of an activation quantizer scores its candidate
#: scales exactly (the largest and the smallest, 1/16 each) and by a random sample (see
#: :func:`sampled_activation_mse`).
MSE_SAMPLE_ELEMENTS = 1 << 16


def _sampled_search(module: nn.Module, max_elements: int,
                    generators: dict[torch.device, torch.Generator]) -> Callable[[torch.Tensor], torch.Tensor]:
    search = module.mse_search

    def sampled(x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        count = flat.numel()
        if count <= max_elements:
            return search(x)
        generator = generators.get(flat.device)
        if generator is None:
            generator = generators[flat.device] = torch.Generator(device=flat.device).manual_seed(0)
        sample = flat[torch.randint(count, (max_elements,), generator=generator, device=flat.device)]
        # The extremes: every value beyond the sample's quantiles that leave about max_elements / 16 values
        # of the batch in each tail (the batch's minimum and maximum among them).
        tail = min(0.5, max_elements / 16 / count)
        low, high = torch.quantile(sample.float(), torch.tensor([tail, 1 - tail], device=flat.device)).to(flat.dtype)
        extreme = (flat <= low) | (flat >= high)
        extremes = flat[extreme]
        middle = sample[(sample > low) & (sample < high)]
        weight = (count - extremes.numel()) / max(middle.numel(), 1)
        split = extremes.numel()

        def loss(values: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
            # The batch's squared error: the extremes' exactly, the middle's estimated from the sample.
            error = torch.nn.functional.mse_loss(values, quantized, reduction="none")
            return error[:split].sum() + weight * error[split:].sum()

        module.mse_loss_fn = loss
        try:
            return search(torch.cat([extremes, middle]))  # the extremes keep the batch's search interval
        finally:
            del module.mse_loss_fn

    return sampled


@contextlib.contextmanager
def sampled_activation_mse(model: nn.Module, max_elements: int = MSE_SAMPLE_ELEMENTS) -> Iterator[None]:
    """While the context lasts, the MSE scale search of every per-tensor activation quantizer scores its
    candidate scales on part of each batch: exactly on its extremes (about ``max_elements / 16`` largest
    and as many smallest values), and on the other values of a random sample of ``max_elements``, scaled
    up to their number.

    Brevitas searches every calibration batch of every MSE activation quantizer over 20 candidate
    scales, each scored by quantizing the whole activation (a transformer's feed-forward input is over a
    million values a batch): MSE calibration took 5-15x the time of percentile statistics. The
    candidates are unchanged (they come from the batch's max |x|, or min and max, which the extremes
    hold), and the clipping error, which only the extremes have for all but the smallest candidates, is
    exact; only the rounding error of the middle values is estimated (a fixed-seed random sample).
    Batches of at most ``max_elements`` values and weight quantizers are searched as before. The search's
    mode switches find the quantizer's flagged modules once instead of walking them on every candidate.
    """
    from brevitas.core.stats.stats_op import MSE

    generators: dict[torch.device, torch.Generator] = {}
    patched: list[tuple[nn.Module, dict[str, Any]]] = []
    for site in iter_quantizers(model, enabled_only=False):
        if site.kind != "act":
            continue
        for module in site.proxy.modules():
            if isinstance(module, MSE) and module.stats_reduce_dim is None:
                saved = {name: vars(module)[name] for name in _MODE_SWITCHES}
                module.__dict__.update(_mode_switches(site.proxy))
                module.mse_search = _sampled_search(module, max_elements, generators)
                patched.append((module, saved))
    try:
        yield
    finally:
        for module, saved in patched:
            del module.mse_search
            module.__dict__.update(saved)


#: The MSE module's per-instance callables that switch its quantizer between searching and observing.
_MODE_SWITCHES = ("set_local_loss_mode", "set_observer_mode", "restore_observer_mode")


def _mode_switches(proxy: nn.Module) -> dict[str, Callable[..., None]]:
    """Brevitas's mode switches of an MSE search with the proxy's flagged modules found once: its own walk
    every module of the proxy on each of the search's 40 switches (a fifth of the calibration time)."""
    local = [m for m in proxy.modules() if hasattr(m, "local_loss_mode")]
    observers = [m for m in proxy.modules() if hasattr(m, "observer_only")]
    previous: dict[nn.Module, bool] = {}

    def set_local_loss_mode(enabled: bool) -> None:
        for m in local:
            m.local_loss_mode = enabled

    def set_observer_mode(enabled: bool) -> None:
        for m in observers:
            previous[m] = m.observer_only
            m.observer_only = enabled

    def restore_observer_mode() -> None:
        for m in observers:
            m.observer_only = previous[m]

    return {"set_local_loss_mode": set_local_loss_mode, "set_observer_mode": set_observer_mode,
            "restore_observer_mode": restore_observer_mode}
