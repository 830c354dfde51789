"""Verification of deep quantized models: every activation quantizer pinned to PyTorch's values.

Why: in a quantized network a float difference of one unit in the last place (summation order of a
MatMul, a LayerNorm or GELU written as several ONNX ops) occasionally moves a value across a rounding
boundary, so one activation code differs by one step. Further layers mix that step into many values,
some of which cross boundaries in turn; after a few transformer layers a correct file can differ from
PyTorch by far more than one output step (all-MiniLM-L6-v2, W8A8: 0.2-0.6 on outputs of range 11,
while PyTorch itself moves as much when 1e-5 of noise is added to its input). Comparing only the final
outputs then either rejects correct files or, with a tolerance loose enough to accept them, accepts a
wrong scale (whose effect drowns in the same chaos).

The rule (see :func:`check_pinned`): run the file once more with the output of every activation
quantizer *pinned* to PyTorch's value (a graph input fed with PyTorch's codes replaces the tensor the
file computed) while the file's own codes are kept as extra outputs (*probes*). Pinning stops every
propagation, so

1. each probe must equal PyTorch's codes, except at elements whose PyTorch input lies within
   :data:`TIE_FRACTION` of a step of the midpoint between the two codes (a rounding tie: only there can
   float rounding pick the other code), and
2. the file's outputs must match PyTorch's within the ordinary tolerance (one output step).

A wrong scale, a dropped or changed op, or a kernel with other numerics changes some quantizer's input
by more than float rounding, which shows as non-tie differences at the first quantizer after it (named
in the error), or in the outputs after the last quantizer. Integer codes are pinned where the file keeps
them (in front of their ``DequantizeLinear``, so onnxruntime still fuses its integer kernels in the
pinned run); float8 activations are pinned at their ``DequantizeLinear`` output.

Matching file and model: Brevitas's exporter names each quantizer's nodes after the module path of its
proxy (``/model/encoder/layer.0/.../input_quant/export_handler/QuantizeLinear``); the k-th node of a
proxy is its k-th call in the PyTorch run. Quantizers of the file that match no proxy are left unpinned
and counted in the report.

Cost: only files that fail the output comparison get this check; it runs the model once more with hooks that
keep every activation quantizer's input and output on the example (memory: about twice the example's activations
of all quantized layers) and onnxruntime twice (once to learn the shapes of the tensors between each quantizer and
its ``DequantizeLinear``, once pinned).
"""

from __future__ import annotations

import logging
import pathlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto
from torch import nn

from quark_brevitas.brevitas_adapter import iter_quantizers
from quark_brevitas.export.errors import ExportMismatchError
from quark_brevitas.export.onnx.dynamic import CODE_NODE, ZERO_POINT_TENSOR
from quark_brevitas.export.onnx.onnx_types import FLOAT8_ONNX_TYPES
from quark_brevitas.export.onnx.passes.graph import GraphIndex

logger = logging.getLogger(__name__)

#: A differing code is a rounding tie when PyTorch's input is within this fraction of the spacing between
#: the two candidate values from their midpoint. Float rounding between two pinned quantizers moves
#: inputs by ~1e-5 of a step (MiniLM: at most 2e-4); a wrong scale or a missing op by whole steps.
TIE_FRACTION = 0.05
#: Ops that may sit between an activation's QuantizeLinear and its DequantizeLinear after the integer-kernel
#: rewrites (integer Clips, layout ops and MaxPool moved across the quantizer).
_CHAIN_OPS = frozenset({"Clip", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})
_NODE_NAME = re.compile(r"^/?(?P<path>.+)/export_handler/(?P<op>[A-Za-z]+)(?:_(?P<index>\d+))?$")
#: Runs a model proto on named feeds and returns the named outputs.
Runner = Callable[[onnx.ModelProto, dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class PinnedSummary:
    """What the pinned run found: quantizers pinned, elements at rounding ties, quantizers left unpinned."""

    pinned: int
    tie_elements: int
    unpinned: tuple[str, ...] = ()
    per_quantizer: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One sentence for reports and logs."""
        text = (f"every activation quantizer pinned to PyTorch's codes ({self.pinned} pinned): the file's codes "
                f"match except {self.tie_elements} element(s) at rounding ties")
        if self.unpinned:
            text += f"; {len(self.unpinned)} quantizer(s) could not be matched and stayed unpinned"
        return text


@dataclass
class _Call:
    """One call of an activation quantizer in the PyTorch run (scale and zero point as PyTorch computed them)."""

    inputs: np.ndarray
    values: np.ndarray
    scale: np.ndarray | None
    zero_point: np.ndarray | None
    signed: bool = True


@dataclass
class _Site:
    """One activation quantization of the file and where it is pinned."""

    proxy: str
    call: int
    quantize: onnx.NodeProto
    chain: list[str]  # tensors from the QuantizeLinear output to the DequantizeLinear input
    clips: list[onnx.NodeProto]
    dequantize: onnx.NodeProto | None
    float8: bool
    dynamic: bool = False  # codes of a dynamic quantizer (quark_brevitas.export.onnx.dynamic): PyTorch's scale per call
    pin: str = ""  # the tensor replaced by a graph input
    zero_point: str = ""  # an asymmetric dynamic quantizer's zero point tensor (pinned and probed too)
    position: int = -1  # index of ``pin`` in ``chain`` (integer codes)


def _proxy_of(node: onnx.NodeProto) -> tuple[str, int] | None:
    match = _NODE_NAME.match(node.name)
    if match is None:
        return None
    return match["path"].replace("/", "."), int(match["index"] or 0)


@contextmanager
def recorded_calls(model: nn.Module) -> Iterator[dict[str, list[_Call]]]:
    """Record every call (input and quantized output value) of the enabled activation quantizers of ``model``."""
    calls: dict[str, list[_Call]] = defaultdict(list)
    hooks = []

    def value(x: Any) -> np.ndarray:
        tensor = x.value if hasattr(x, "value") else x
        return tensor.detach().cpu().float().numpy().copy()

    def optional(t: Any) -> np.ndarray | None:
        return t.detach().cpu().float().numpy().copy() if isinstance(t, torch.Tensor) else None

    for site in iter_quantizers(model):
        if site.kind != "act":
            continue

        def hook(_module: nn.Module, args: tuple[Any, ...], output: Any, name: str = site.name) -> None:
            if args and output is not None:
                calls[name].append(_Call(value(args[0]), value(output), optional(getattr(output, "scale", None)),
                                         optional(getattr(output, "zero_point", None)),
                                         bool(getattr(output, "signed", True))))

        hooks.append(site.proxy.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in hooks:
            handle.remove()


def _chain(index: GraphIndex, q: onnx.NodeProto) -> tuple[list[str], list[onnx.NodeProto], onnx.NodeProto | None]:
    """Tensors from ``q``'s output along Clips/layout ops to the DequantizeLinear that reads them."""
    tensors, clips = [q.output[0]], []
    while True:
        users = index.consumers.get(tensors[-1], [])
        if tensors[-1] in index.graph_outputs or len(users) != 1:
            dq = [u for u in users if u.op_type == "DequantizeLinear"]
            return tensors, clips, dq[0] if len(dq) == 1 and len(users) == 1 else None
        user = users[0]
        if user.op_type == "DequantizeLinear":
            return tensors, clips, user
        if user.op_type not in _CHAIN_OPS or user.input[0] != tensors[-1]:
            return tensors, clips, None
        if user.op_type == "Clip":
            clips.append(user)
        tensors.append(user.output[0])


class _Proxies:
    """Resolves the module path in a node's name to a recorded proxy. The exporter names nodes after the *call
    stack* of modules, so a module whose ``forward`` is bypassed (``OPTForCausalLM`` calls ``self.model.decoder``,
    skipping ``OPTModel.forward``) is missing from the name: such a path matches the one proxy whose path contains
    it as a subsequence ending in the same components (ambiguous paths stay unmatched)."""

    def __init__(self, proxies: set[str]) -> None:
        self.proxies = proxies
        self.buckets: dict[tuple[str, ...], list[list[str]]] = defaultdict(list)
        for name in proxies:
            parts = name.split(".")
            self.buckets[tuple(parts[-4:])].append(parts)

    def resolve(self, path: str) -> str | None:
        if path in self.proxies:
            return path
        parts = path.split(".")
        found = [p for p in self.buckets.get(tuple(parts[-4:]), []) if _subsequence(parts, p)]
        return ".".join(found[0]) if len(found) == 1 else None


def _subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(part in it for part in short)


def _sites(proto: onnx.ModelProto, proxies: set[str]) -> tuple[list[_Site], list[str]]:
    index = GraphIndex(proto.graph)
    sites, unmatched = [], []
    resolver = _Proxies(proxies)
    for node in proto.graph.node:
        found = _proxy_of(node)
        if found is not None:
            resolved = resolver.resolve(found[0])
            found = (resolved, found[1]) if resolved is not None else found
        if found is not None and node.name.rsplit("/", 1)[-1].startswith(CODE_NODE.rsplit("/", 1)[-1]):
            if found[0] in proxies:
                zero_point = node.name.replace(CODE_NODE, ZERO_POINT_TENSOR)
                sites.append(_Site(found[0], found[1], node, [node.output[0]], [], None, False, dynamic=True,
                                   zero_point=zero_point if zero_point in index.producer else ""))
            else:
                unmatched.append(node.name)
            continue
        if node.op_type != "QuantizeLinear" or node.input[0] in index.inits:
            continue
        if found is None or found[0] not in proxies:
            if found is not None and found[0].rsplit(".", 1)[-1] in ("weight_quant", "bias_quant"):
                continue
            unmatched.append(node.name or node.output[0])
            continue
        chain, clips, dq = _chain(index, node)
        zero_point = index.inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        float8 = zero_point is not None and zero_point.data_type in FLOAT8_ONNX_TYPES
        if float8 and dq is None:
            unmatched.append(node.name)
            continue
        sites.append(_Site(found[0], found[1], node, chain, clips, dq, float8))
    return sites, unmatched


def _is_signed(node: onnx.NodeProto) -> bool:
    """Whether a dynamic quantizer's code node writes int8 (a Cast to INT8) rather than uint8."""
    return node.op_type == "Cast" and any(a.name == "to" and a.i == TensorProto.INT8 for a in node.attribute)


def _with_outputs(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    extended = onnx.ModelProto()
    extended.CopyFrom(proto)
    have = {o.name for o in extended.graph.output}
    for name in names:
        if name not in have:
            extended.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            have.add(name)
    return extended


def _scale_zero_point(proto_index: GraphIndex, q: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, int]:
    scale = proto_index.const(q.input[1])
    zero_point = proto_index.const(q.input[2]) if len(q.input) > 2 and q.input[2] else np.zeros((), np.uint8)
    code_type = proto_index.inits[q.input[2]].data_type if len(q.input) > 2 and q.input[2] else TensorProto.UINT8
    return scale, zero_point, code_type


def _codes(values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: np.dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    codes = np.rint(values.astype(np.float64) / scale.astype(np.float64)) + zero_point.astype(np.float64)
    return np.clip(codes, info.min, info.max).astype(dtype)


def _in_steps(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``values / scale`` in float64, 0 where the scale is 0 (an all-zero group of a dynamic quantizer that does not
    clamp its scale, :mod:`quark_brevitas.brevitas_adapter.reciprocal`: its codes are 0)."""
    values, scale = np.broadcast_arrays(values.astype(np.float64), scale.astype(np.float64))
    return np.divide(values, scale, out=np.zeros_like(values), where=scale != 0)


def _apply_clips(codes: np.ndarray, clips: Sequence[onnx.NodeProto], index: GraphIndex) -> np.ndarray:
    for clip in clips:
        low = index.const(clip.input[1]) if len(clip.input) > 1 and clip.input[1] else None
        high = index.const(clip.input[2]) if len(clip.input) > 2 and clip.input[2] else None
        codes = np.clip(codes, low if low is not None else codes.min(), high if high is not None else codes.max())
    return codes


def _non_tie(inputs: np.ndarray, probe: np.ndarray, expected: np.ndarray, *, exact: bool) -> tuple[int, int, float]:
    """(tie elements, non-tie elements, largest difference) of a probe against PyTorch's values (``exact``: integer
    codes; else dequantized float values, equal up to float rounding of the scale product)."""
    if probe.shape != expected.shape:
        return 0, int(expected.size), float("inf")
    differ = probe != expected if exact else ~np.isclose(probe, expected, rtol=1e-6, atol=0.0)
    if not differ.any():
        return 0, 0, 0.0
    x, a, b = inputs[differ].astype(np.float64), probe[differ].astype(np.float64), expected[differ].astype(np.float64)
    spacing = np.abs(a - b)
    tie = _is_tie(x, a, b)
    return int(tie.sum()), int((~tie).sum()), float(spacing.max())


def _compare_zero_point(probe: np.ndarray, expected: np.ndarray, shift: np.ndarray | None) -> tuple[int, int]:
    """(zero points at rounding ties, other differing zero points) of a dynamic quantizer's zero point probe; a
    zero point at a tie may be the other candidate (``shift``, see :func:`_zero_point_shift`)."""
    probe = probe.astype(np.float64).reshape(expected.shape)
    differ = probe != expected
    tie = differ & (shift is not None) & (probe == expected + (shift if shift is not None else 0.0))
    return int(tie.sum()), int((differ & ~tie).sum())


def _is_tie(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether ``x`` lies within :data:`TIE_FRACTION` of a step of the midpoint between the values ``a`` and ``b``."""
    return np.abs(np.abs(x - a) - np.abs(x - b)) <= 2 * TIE_FRACTION * np.abs(a - b)


def _zero_point_shift(call: _Call) -> np.ndarray | None:
    """For an asymmetric dynamic quantizer: per zero point (shaped like PyTorch's), the other candidate minus
    PyTorch's (+-1) where it was a rounding tie, else 0; ``None`` when no zero point of the call is at a tie.

    Why: a dynamic asymmetric quantizer rounds its zero point ``-min(min x, 0) / scale`` from each input (per token,
    or per tensor). The file computes it with the same formula (checked bit for bit on PyTorch's input), but its
    input differs from PyTorch's by float rounding of the ops before it; when the unrounded zero point lies within
    :data:`TIE_FRACTION` of a half-integer (all-MiniLM-L6-v2: 149.49998 on a padding token), that moves the whole
    row by one code. It is a rounding tie like an element's, only shared by the row: the pinned check pins the
    zero point to PyTorch's and accepts the file's own only where it is PyTorch's or, at such a tie, the other
    candidate.
    """
    if call.signed or call.zero_point is None or call.scale is None:
        return None
    scale = call.scale.astype(np.float32)
    # the zero point's statistic reduces over the axes along which the scale is broadcast (per token: the last)
    axes = tuple(axis for axis in range(call.inputs.ndim) if _broadcast_dim(scale, call.inputs.ndim, axis) == 1)
    low = np.minimum(call.inputs.min(axis=axes, keepdims=True), np.float32(0))
    unrounded = (-low / scale).astype(np.float64)
    fraction = unrounded - np.floor(unrounded)
    tie = np.abs(fraction - 0.5) <= TIE_FRACTION
    if not tie.any():
        return None
    picked, below = call.zero_point.astype(np.float64), np.floor(unrounded)
    other = np.clip(np.where(picked == below, below + 1, below), 0, 255)  # the candidate PyTorch did not pick
    return np.where(tie, other - picked, 0.0)


def _broadcast_dim(array: np.ndarray, ndim: int, axis: int) -> int:
    """Size of ``array`` along ``axis`` once broadcast (right-aligned) to ``ndim`` dimensions."""
    offset = axis - (ndim - array.ndim)
    return int(array.shape[offset]) if offset >= 0 else 1


def check_pinned(proto: onnx.ModelProto, model: nn.Module, args: tuple[torch.Tensor, ...],
                 input_names: Sequence[str], reference_outputs: Sequence[tuple[str, torch.Tensor]],
                 tolerance: float, path: pathlib.Path, runner: Runner) -> PinnedSummary:
    """The pinned verification of ``proto`` (see the module docstring); :class:`ExportMismatchError` naming the
    first quantizer whose codes differ away from rounding ties, or the output that still differs.

    ``model`` is the module that was exported (called positionally with ``args``), ``runner`` executes a proto
    the way the format's verification does.
    """
    with torch.no_grad(), recorded_calls(model) as calls:
        model(*args)
    sites, unmatched = _sites(proto, set(calls))
    feed = {name: _numpy(t) for name, t in zip(input_names, args)}
    index = GraphIndex(proto.graph)
    # Run 1: the file as it is, with the chain tensors as outputs, to learn their shapes.
    chain_names = [t for s in sites if not s.float8 for t in (*s.chain, *([s.zero_point] if s.zero_point else []))]
    shapes = {name: value.shape for name, value in runner(_with_outputs(proto, chain_names), feed).items()}
    pinned = onnx.ModelProto()
    pinned.CopyFrom(proto)
    pinned_index = GraphIndex(pinned.graph)
    producers = pinned_index.producer
    expected: dict[str, tuple[_Site, np.ndarray, np.ndarray]] = {}
    zero_points: dict[str, tuple[_Site, np.ndarray, np.ndarray | None]] = {}  # pinned dynamic zero points

    def pin(tensor: str, values: np.ndarray, elem_type: int) -> None:
        """Replace ``tensor`` by a graph input fed with ``values``; what the file computed becomes an output."""
        producer = producers[tensor]
        producer.output[list(producer.output).index(tensor)] = f"{tensor}__probe"
        pinned.graph.input.append(onnx.helper.make_tensor_value_info(tensor, elem_type, None))
        pinned.graph.output.append(onnx.helper.make_empty_tensor_value_info(f"{tensor}__probe"))
        feed[tensor] = values
    for site in sites:
        site_calls = calls.get(site.proxy, [])
        if site.call >= len(site_calls):
            unmatched.append(site.quantize.name)
            continue
        call = site_calls[site.call]
        if site.float8:
            site.pin = site.dequantize.output[0]
            values, inputs = call.values, call.inputs
        elif site.dynamic:
            if call.scale is None:
                unmatched.append(site.quantize.name)
                continue
            site.pin, site.position = site.chain[0], 0
            zero_point = call.zero_point if call.zero_point is not None else np.zeros((), np.float32)
            unsigned_file = not _is_signed(site.quantize)
            if call.signed and unsigned_file:  # symmetric codes stored as uint8 with zero point 128
                zero_point = zero_point + 128.0
            inputs = _in_steps(call.inputs, call.scale) + zero_point.astype(np.float64)
            values = _codes(_in_steps(call.values, call.scale), np.ones((), np.float64), zero_point,
                            np.uint8 if unsigned_file else np.int8)
            if site.zero_point and not call.signed and call.zero_point is not None \
                    and site.zero_point not in zero_points and site.zero_point in shapes:
                # Pinned like the codes: the file dequantizes them with its own zero point, and a zero point at a
                # rounding tie (see _zero_point_shift) would otherwise shift a whole row of pinned codes.
                file_zero_point = call.zero_point.reshape(shapes[site.zero_point])
                uint8 = site.quantize.op_type == "DynamicQuantizeLinear"
                pin(site.zero_point, file_zero_point.astype(np.uint8 if uint8 else np.float32),
                    TensorProto.UINT8 if uint8 else TensorProto.FLOAT)
                shift = _zero_point_shift(call)
                zero_points[site.zero_point] = (site, file_zero_point.astype(np.float64),
                                                None if shift is None else shift.reshape(file_zero_point.shape))
        else:
            scale, zero_point, code_type = _scale_zero_point(index, site.quantize)
            if scale is None or zero_point is None or scale.ndim != 0:
                unmatched.append(site.quantize.name)
                continue
            positions = [i for i, t in enumerate(site.chain) if shapes.get(t) == call.values.shape]
            if not positions:
                unmatched.append(site.quantize.name)
                continue
            site.position = positions[-1]
            site.pin = site.chain[site.position]
            dtype = np.int8 if code_type == TensorProto.INT8 else np.uint8
            values = _codes(call.values, scale, zero_point, dtype)
            # Ties are judged in code space: PyTorch's input in units of the step, shifted by the zero point.
            inputs = call.inputs.astype(np.float64) / float(scale) + float(zero_point)
        if site.pin in expected:  # two quantizers sharing one tensor: pin once
            continue
        pin(site.pin, values, TensorProto.FLOAT if site.float8 else (TensorProto.INT8 if values.dtype == np.int8
                                                                    else TensorProto.UINT8))
        expected[site.pin] = (site, values, inputs)
    out = runner(pinned, feed)
    summary = PinnedSummary(pinned=len(expected), tie_elements=0, unpinned=tuple(unmatched))
    for name, (site, values, inputs) in expected.items():
        probe = out[f"{name}__probe"]
        if not site.float8:
            probe = _apply_clips(probe, site.clips[site.position:] if site.position >= 0 else [], index)
            probe = probe.astype(np.float64)
        ties, wrong, largest = _non_tie(inputs, probe, values, exact=not site.float8)
        if site.zero_point in zero_points:
            zero_point_ties, zero_point_wrong = _compare_zero_point(out[f"{site.zero_point}__probe"],
                                                                    *zero_points[site.zero_point][1:])
            ties += zero_point_ties
            if zero_point_wrong:
                raise ExportMismatchError(
                    f"at quantizer '{site.proxy}' (node {site.zero_point}), with every quantizer before it pinned "
                    f"to PyTorch's codes, {zero_point_wrong} of its dynamic zero point(s) differ from PyTorch's away "
                    "from rounding ties: the file computes the zero point (or its input) differently.",
                    max_abs_diff=float("inf"), tolerance=tolerance, path=path)
        summary.tie_elements += ties
        summary.per_quantizer[site.proxy] = ties
        if wrong:
            unit = "value" if site.float8 else "code"
            raise ExportMismatchError(
                f"at quantizer '{site.proxy}' (node {site.quantize.name}), with every quantizer before it pinned "
                f"to PyTorch's codes, {wrong} element(s) of its output differ away from rounding ties (largest {unit} "
                f"difference {largest:.6g}): an op between the previous quantizers and this one computes "
                "differently in the file (a wrong scale, a missing op, a kernel with other numerics).",
                max_abs_diff=float("inf"), tolerance=tolerance, path=path)
    for (name, ref), graph_output in zip(reference_outputs, proto.graph.output):
        actual = out[graph_output.name].astype(np.float64)
        diff = float(np.max(np.abs(actual - _numpy(ref).astype(np.float64)))) if actual.size else 0.0
        if not diff <= tolerance:
            raise ExportMismatchError(
                f"with every activation quantizer pinned to PyTorch's codes, output '{name}' still differs by "
                f"{diff:.6g} > tolerance {tolerance:.6g}: the ops after the last quantizer compute differently in "
                "the file.",
                max_abs_diff=diff, tolerance=tolerance, path=path)
    logger.info("pinned verification of %s: %s", path, summary.describe())
    return summary


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


__all__ = ["TIE_FRACTION", "PinnedSummary", "check_pinned", "recorded_calls"]
