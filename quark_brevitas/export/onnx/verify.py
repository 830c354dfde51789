"""Checking an ONNX file against its PyTorch model.

Flattens the model's (possibly nested) outputs into named tensors, computes the reference outputs and
the default tolerance (one output quantization step, or a fraction of the output range), compares them
with onnxruntime's outputs and raises :class:`~quark_brevitas.export.ExportMismatchError` on a
disagreement; :func:`verify_onnx` is the public entry point.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx
import torch
from brevitas.nn.mixin.base import QuantLayerMixin
from brevitas.quant_tensor import QuantTensor
from torch import nn
from torch.overrides import TorchFunctionMode

from quark_brevitas.brevitas_adapter import float8_dtype, is_float_quantizer, quantizer_kind
from quark_brevitas.export.args import (
    PathLike,
    TensorArgs,
    check_model,
    normalize_example,
    past_name,
    type_name,
    with_attention_mask,
)
from quark_brevitas.export.errors import ExportArgumentError, ExportError, ExportMismatchError
from quark_brevitas.export.onnx.inspect import as_int, safe_call
from quark_brevitas.export.onnx.kv import export_module, with_past
from quark_brevitas.export.onnx.kv_quant import float_runner, quantized_cache
from quark_brevitas.export.onnx.pinned import PinnedSummary, check_pinned
from quark_brevitas.export.onnx.runtime import run_model_proto, run_onnx

logger = logging.getLogger(__name__)

#: Relative epsilon added to every tolerance so that float rounding of an exact one-step
#: difference does not count as a mismatch.
_TOLERANCE_EPS = 1e-6


class VerificationResult(NamedTuple):
    """Outcome of comparing an ONNX file with its PyTorch model (see :func:`verify_onnx`).

    ``pinned`` is set when the outputs differed by more than the tolerance and the file was accepted by the
    pinned check instead (:mod:`~quark_brevitas.export.onnx.pinned`): then ``max_abs_diff`` exceeds ``tolerance``.
    """

    max_abs_diff: float
    tolerance: float
    tolerance_source: str
    per_output: tuple[tuple[str, float], ...]
    pinned: Any = None


# --------------------------------------------------------------------------------------------
# Output flattening
# --------------------------------------------------------------------------------------------


def flatten_outputs(obj: object, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Flatten a model output into ``(name, tensor)`` pairs in a deterministic order.

    Tensors and QuantTensors (their ``.value``) are leaves; tuples/lists are walked in order and
    mappings (dicts, Hugging Face ``ModelOutput``) in insertion order; ``None`` is skipped.
    Names are ``"output"`` for a bare tensor, ``"output_<i>"`` / ``"<key>"`` at top level and
    dotted paths below.
    """
    if isinstance(obj, QuantTensor):
        return [(path or "output", obj.value)]
    if isinstance(obj, torch.Tensor):
        return [(path or "output", obj)]
    if obj is None:
        return []
    if isinstance(obj, Mapping):
        out: list[tuple[str, torch.Tensor]] = []
        for key, value in obj.items():
            out.extend(flatten_outputs(value, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(obj, (tuple, list)):
        out = []
        for i, value in enumerate(obj):
            out.extend(flatten_outputs(value, f"{path}.{i}" if path else f"output_{i}"))
        return out
    raise ExportError(
        f"model output {path or '<root>'} is a {type_name(obj)}; ONNX export supports tensors, "
        "QuantTensors and (nested) tuples, lists and dicts of them"
    )


def unique_names(names: Sequence[str], taken: Sequence[str]) -> tuple[str, ...]:
    """``names`` made unique among themselves and ``taken`` by numbered suffixes (``out``, ``out_1``)."""
    seen = set(taken)
    result = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            candidate, k = f"{name}_{k}", k + 1
        seen.add(candidate)
        result.append(candidate)
    return tuple(result)


class FlatOutputs(nn.Module):
    """Export wrapper returning the model's outputs as a flat tuple (see ``flatten_outputs``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t for _, t in flatten_outputs(self.model(*args)))


# --------------------------------------------------------------------------------------------
# Reference outputs and tolerance
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode while the context lasts; its training mode is restored afterwards,
    also on failure (verification must not change the caller's model)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class Reference:
    """The PyTorch outputs on the example input, and what the default tolerance is derived from."""

    outputs: tuple[tuple[str, torch.Tensor], ...]
    last_quant_layer: str | None
    output_step: float | None
    output_step_source: str
    min_opset: int = 0


def _float8_top_step(proxy: Any) -> float | None:
    """Spacing of the largest binade of the proxy's fp8 format, in units of its scale (``None`` for a
    format without a torch float8 dtype; non-OCP formats are read as FNUZ)."""
    e = as_int(proxy.exponent_bit_width())
    m = as_int(proxy.mantissa_bit_width())
    if e is None or m is None:
        return None
    dtype = float8_dtype(e, m, fnuz=not proxy.is_ocp)
    if dtype is None:
        return None
    max_value = float(torch.finfo(dtype).max)
    return float(2.0 ** (math.floor(math.log2(max_value)) - m))


def _output_quantizer(layer: nn.Module) -> nn.Module | None:
    for attr in ("output_quant", "act_quant"):
        if hasattr(layer, attr):
            proxy = getattr(layer, attr)
            if quantizer_kind(proxy) == "act" and proxy.is_quant_enabled:
                return proxy
            return None
    return None


def _output_step(layer_name: str, layer: nn.Module) -> tuple[float | None, str]:
    proxy = _output_quantizer(layer)
    if proxy is None:
        return None, f"last quantized op '{layer_name}' has no output quantizer"
    scale = safe_call(proxy, "scale")
    if not isinstance(scale, torch.Tensor):
        return None, f"output quantizer of '{layer_name}' has no static scale"
    step = float(scale.detach().abs().max())
    if is_float_quantizer(proxy):
        factor = _float8_top_step(proxy)
        if factor is None:
            return None, f"output quantizer of '{layer_name}' has an unknown float format"
        return (
            step * factor,
            f"one fp8 step (top binade, {factor:g} x scale) of the output quantizer of '{layer_name}'",
        )
    return step, f"largest scale of the output quantizer of '{layer_name}'"


#: Functions the TorchScript ONNX exporter handles only from an opset on (``scaled_dot_product_attention``: 14;
#: Hugging Face models call it with ``attn_implementation="sdpa"``, their default).
_MIN_OPSETS: dict[Any, int] = {torch.nn.functional.scaled_dot_product_attention: 14}


class _CalledFunctions(TorchFunctionMode):
    """Records which of the :data:`_MIN_OPSETS` functions a forward pass calls."""

    def __init__(self) -> None:
        super().__init__()
        self.functions: set[Any] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _MIN_OPSETS:
            self.functions.add(func)
        return func(*args, **(kwargs or {}))


def compute_reference(model: nn.Module, args: tuple[torch.Tensor, ...]) -> Reference:
    """Run ``model`` (already in eval mode) on ``args`` and record what the tolerance needs."""
    order: list[str] = []
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLayerMixin)}
    hooks = [
        m.register_forward_hook(lambda _m, _i, _o, name=name: order.append(name))
        for name, m in layers.items()
    ]
    try:
        with torch.no_grad(), _CalledFunctions() as called:
            output = model(*args)
    finally:
        for hook in hooks:
            hook.remove()
    named = flatten_outputs(output)
    if not named:
        raise ExportError("the model returned no tensor output; nothing to export")
    last = order[-1] if order else None
    if last is None:
        step, source = None, "the model has no quantized op"
    else:
        step, source = _output_step(last, layers[last])
    return Reference(
        outputs=tuple((n, t.detach()) for n, t in named),
        last_quant_layer=last,
        output_step=step,
        output_step_source=source,
        min_opset=max((opset for fn, opset in _MIN_OPSETS.items() if fn in called.functions), default=0),
    )


def exported_module(model: nn.Module, reference: Reference) -> nn.Module:
    """The module the exporter traces: ``model`` itself for a single tensor output, else wrapped in
    :class:`FlatOutputs` (made in eval mode: ``torch.onnx.export`` restores the traced module's mode afterwards,
    and a fresh module is in train mode, which would switch the model's dropout on)."""
    if len(reference.outputs) == 1 and reference.outputs[0][0] == "output":
        return model
    return FlatOutputs(model).eval()


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype != torch.float64:
        t = t.float()
    return t.numpy()


def _default_tolerance(ref: Reference) -> tuple[float, str]:
    arrays = [_to_numpy(t).astype(np.float64).ravel() for _, t in ref.outputs]
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    finite = values[np.isfinite(values)]
    abs_max = float(np.abs(finite).max()) if finite.size else 0.0
    eps = _TOLERANCE_EPS * max(1.0, abs_max)
    if ref.output_step is not None:
        return ref.output_step + eps, ref.output_step_source
    span = float(finite.max() - finite.min()) if finite.size else 0.0
    reason = ref.output_step_source
    return span / 255.0 + eps, f"one 8-bit step (max - min) / 255 of the reference output ({reason})"


def measure(
    ref: Reference, onnx_outputs: Sequence[np.ndarray], path: pathlib.Path, tolerance: float | None
) -> VerificationResult:
    """``max |onnx - reference|`` per output and the tolerance it is judged against (``None``: the default rule,
    one output quantization step). Raises :class:`ExportMismatchError` only for outputs of the wrong number or
    shape; whether the difference is acceptable is :func:`compare`'s (or the pinned check's) business."""
    if tolerance is None:
        tol, source = _default_tolerance(ref)
    else:
        tol, source = tolerance, "given by the caller"
    if len(onnx_outputs) != len(ref.outputs):
        raise ExportMismatchError(
            f"ONNX file {path} has {len(onnx_outputs)} outputs but the PyTorch model has {len(ref.outputs)} "
            f"({', '.join(n for n, _ in ref.outputs)})",
            max_abs_diff=math.inf,
            tolerance=tol,
            path=path,
        )
    per_output: list[tuple[str, float]] = []
    for (name, expected), actual in zip(ref.outputs, onnx_outputs):
        exp = _to_numpy(expected)
        act = np.asarray(actual)
        if exp.shape != act.shape:
            raise ExportMismatchError(
                f"ONNX output '{name}' of {path} has shape {act.shape}, PyTorch gives {exp.shape}",
                max_abs_diff=math.inf,
                tolerance=tol,
                path=path,
            )
        diff = np.abs(act.astype(np.float64) - exp.astype(np.float64))
        both_nan = np.isnan(act.astype(np.float64)) & np.isnan(exp.astype(np.float64))
        diff = np.where(both_nan, 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        per_output.append((name, float(diff.max()) if diff.size else 0.0))
    max_diff = max(d for _, d in per_output)
    return VerificationResult(max_diff, tol, source, tuple(per_output))


def mismatch_error(result: VerificationResult, path: pathlib.Path) -> ExportMismatchError:
    """The error for a result beyond its tolerance."""
    worst = ", ".join(f"{n}: {d:.6g}" for n, d in result.per_output)
    return ExportMismatchError(
        f"ONNX file {path} disagrees with PyTorch: max |onnxruntime - PyTorch| = {result.max_abs_diff:.6g} > "
        f"tolerance {result.tolerance:.6g} ({result.tolerance_source}); per output: {worst}. The file was kept for "
        "inspection.",
        max_abs_diff=result.max_abs_diff,
        tolerance=result.tolerance,
        path=path,
    )


def compare(
    ref: Reference, onnx_outputs: Sequence[np.ndarray], path: pathlib.Path, tolerance: float | None
) -> VerificationResult:
    """Check ``onnx_outputs`` against the reference; :class:`ExportMismatchError` beyond the tolerance
    (``None``: the default rule, one output quantization step)."""
    result = measure(ref, onnx_outputs, path, tolerance)
    if not result.max_abs_diff <= result.tolerance:
        raise mismatch_error(result, path)
    return result


def accept(result: VerificationResult, path: pathlib.Path,
           pin: Callable[[float], PinnedSummary] | None) -> VerificationResult:
    """``result`` if within its tolerance; else the pinned check ``pin`` (``None``: not available) decides whether
    the difference is rounding flips propagated through the model (see :mod:`~quark_brevitas.export.onnx.pinned`)."""
    if result.max_abs_diff <= result.tolerance:
        return result
    mismatch = mismatch_error(result, path)
    if pin is None or not math.isfinite(result.max_abs_diff):
        raise mismatch
    logger.info("%s; checking the file with every activation quantizer pinned to PyTorch's codes", mismatch)
    try:
        summary = pin(result.tolerance)
    except ExportMismatchError as pinned:
        raise ExportMismatchError(f"{mismatch} Rounding flips propagated through the model do not explain it: "
                                  f"{pinned}", max_abs_diff=result.max_abs_diff, tolerance=result.tolerance,
                                  path=path) from pinned
    if summary.pinned == 0:
        raise mismatch
    return result._replace(tolerance_source=f"{result.tolerance_source}; {summary.describe()}", pinned=summary)


def validate_tolerance(tolerance: float | None) -> float | None:
    """The caller's tolerance as a float (``None`` kept); argument errors for anything else."""
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ExportArgumentError(f"tolerance must be a float or None; got {type_name(tolerance)}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ExportError(f"tolerance must be a finite number >= 0; got {tolerance}")
    return float(tolerance)


def _graph_inputs(path: pathlib.Path) -> list[str]:
    """The input names of the ONNX file ``path`` (none if there is no such file: running it reports that), read
    without its external weight data."""
    if not path.is_file():
        return []
    return [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]


def _quantized_pasts(path: pathlib.Path) -> bool:
    """Whether the file's ``past_key_values.*`` inputs are codes (a cache stored quantized), not float."""
    if not path.is_file():
        return False
    graph = onnx.load(str(path), load_external_data=False).graph
    return any(past_name(i.name) is not None and i.type.tensor_type.elem_type != onnx.TensorProto.FLOAT
               for i in graph.input)


def verify_onnx(
    model: nn.Module, args: TensorArgs, path: PathLike, *, tolerance: float | None = None
) -> VerificationResult:
    """Compare an ONNX file with ``model`` on ``args`` (same rules as :func:`export_onnx_qcdq`, the pinned check of
    deep models included; ``args`` as there: a tensor, a tuple of tensors or a dict of keyword tensors).

    A file whose cache is stored quantized (``export_onnx_qcdq(..., past_key_values=True)`` of a model with a quantized
    KV cache) is fed the codes of the example's float pasts and its presents are compared as float values.

    Raises :class:`ExportMismatchError` when the file disagrees with the model. The model's training mode is
    restored afterwards.
    """
    check_model(model)
    example = normalize_example(args)
    tol = validate_tolerance(tolerance)
    file = pathlib.Path(path)
    with eval_mode(model):
        if example.past:
            example = with_past(model, example)
        elif "attention_mask" in _graph_inputs(file):  # the export added one (with_attention_mask): do the same
            example = with_attention_mask(model, example)
        cache = quantized_cache(model, example, True) if example.past and _quantized_pasts(file) else None
        if cache is not None:  # a file storing the cache as codes: fed the codes of the example's (float) pasts
            example = cache.on_grid(example)
        called = export_module(model, example)
        reference = compute_reference(called, example.tensors)
        run, run_proto = (run_onnx, run_model_proto) if cache is None else \
            float_runner(cache, _graph_inputs(file))
        result = measure(reference, run(file, example.tensors), file, tol)
        exported = exported_module(called, reference)

        def pin(tolerance: float) -> PinnedSummary:
            proto = onnx.load(str(file))
            return check_pinned(proto, exported, example.tensors, [i.name for i in proto.graph.input],
                                reference.outputs, tolerance, file, run_proto)

        return accept(result, file, pin)
