"""Decoder exports whose key/value cache is stored quantized between decoding steps (``past_key_values=True`` on a
model with a quantized KV cache, :mod:`quark_brevitas.model_parts.kv_cache`).

Why the cache, not only the attention: on long contexts the cache is what fills the memory, and a model whose keys and
values are quantized to 8 bits can keep them at one byte per element. In PyTorch the quantized model stores
``dequant(quant(k))`` in its ``DynamicCache``: values on the grid ``code * scale`` of the cache's static scale. The
exported file keeps the codes instead:

- every quantized ``past_key_values.{i}.key`` / ``.value`` input is ``INT8`` (int8 cache) or ``FLOAT8E4M3FN`` (FP8
  cache) codes, read through a ``DequantizeLinear`` with the calibrated scale (per tensor, or per key/value head on
  axis 1);
- every ``present.{i}.key`` / ``.value`` output is a ``QuantizeLinear`` of the float present (past and current
  tokens) with the same scale. That is exact: the float present holds grid values only (the dequantized past and the
  new keys/values after the model's own fake quantization), and ``round(code * s / s)`` is ``code``.

So the graph computes attention on the same values as PyTorch, and the caller feeds each step's presents back as the
next step's pasts: 1 byte per element between steps. For the int8 cache the new tokens' codes are concatenated to
the past codes directly (``Concat`` on int8) and the attention reads the dequantized present, so no step re-quantizes
the past. onnxruntime's CPU ``Concat`` takes no float8, so the FP8 cache concatenates in float and quantizes the
present (the same values, one extra pass over the cache per step).

Only a cache quantized after RoPE (``kv_cache_post_rope=True``, as vLLM applies ``k_scale``) holds grid values: with
Quark's default (``kv_cache_post_rope=False``) the keys are quantized at the ``k_proj`` output and RoPE moves them off
the grid, so such a model exports with a float cache (``quantized_cache=None``, logged) or is refused
(``quantized_cache=True``).

The FP8 fake quantization of the new keys/values (``torch.float8_e4m3fn`` casts, which the TorchScript exporter
cannot write) is traced through :func:`exportable_kv_quantizers` as ``Div -> Clip -> Cast(FLOAT8E4M3FN) -> Cast ->
Mul`` (opset 19); int8 traces as the ``Div -> Round -> Clip -> Mul`` of its PyTorch code.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from quark_brevitas.config.kv_cache import KV_FORMATS
from quark_brevitas.export.args import Example, past_name
from quark_brevitas.export.errors import ExportError
from quark_brevitas.model_parts.kv_cache import (
    KEY_QUANTIZER,
    VALUE_QUANTIZER,
    KVCacheQuantizer,
    StaticQuantizer,
    fake_quantize,
    grid_codes,
)

logger = logging.getLogger(__name__)

__all__ = ["QuantizedCache", "exportable_kv_quantizers", "kv_min_opset", "quantized_cache"]

#: ONNX element type of each cache format's codes, and the opset its QuantizeLinear/DequantizeLinear need.
ELEMENT_TYPES = {"int8": TensorProto.INT8, "fp8_e4m3": TensorProto.FLOAT8E4M3FN}
MIN_OPSETS = {"int8": 13, "fp8_e4m3": 19}
#: torch dtype of the codes (an FP8 code travels through numpy as its uint8 bit pattern).
TORCH_CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _quantizers(model: nn.Module) -> list[KVCacheQuantizer]:
    return [m for m in model.modules() if isinstance(m, KVCacheQuantizer) and m.enabled and not m.calibrating]


def _fp8_quantizers(model: nn.Module) -> list[StaticQuantizer]:
    """The calibrated, enabled FP8 quantizers of attention: the cache's and the query's / probabilities'
    (``attention_scheme``, :mod:`quark_brevitas.model_parts.attention`), which share :class:`StaticQuantizer`."""
    return [m for m in model.modules() if isinstance(m, StaticQuantizer) and m.enabled and not m.calibrating
            and m.fmt == "fp8_e4m3"]


def kv_min_opset(model: nn.Module) -> int:
    """The opset the model's enabled attention quantizers (KV cache, query, probabilities) need in a file (19 for
    FP8 casts, else 0)."""
    return max((MIN_OPSETS[q.fmt] for q in _fp8_quantizers(model)), default=0)


# ===================================================================== tracing the FP8 fake quantization
class _FP8CacheQuant(torch.autograd.Function):
    """``fake_quantize`` to FP8 E4M3 in PyTorch, the same formula as standard ONNX ops in the traced graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - Function API
        return fake_quantize(x, scale, "fp8_e4m3")

    @staticmethod
    def symbolic(g: Any, x: Any, scale: Any) -> Any:
        limit = float(KV_FORMATS["fp8_e4m3"])
        low = g.op("Constant", value_t=torch.tensor(-limit, dtype=torch.float32))
        high = g.op("Constant", value_t=torch.tensor(limit, dtype=torch.float32))
        y = g.op("Clip", g.op("Div", x, scale), low, high)
        y = g.op("Cast", g.op("Cast", y, to_i=TensorProto.FLOAT8E4M3FN), to_i=TensorProto.FLOAT)
        return g.op("Mul", y, scale)


def _scale_view(quantizer: StaticQuantizer, x: torch.Tensor) -> torch.Tensor:
    scale = quantizer.scale.to(device=x.device, dtype=torch.float32)
    return scale.view(1, -1, *([1] * (x.dim() - 2))) if quantizer.per_head else scale


def _traceable_forward(self: StaticQuantizer, x: torch.Tensor) -> torch.Tensor:
    if not self.enabled:
        return x
    return _FP8CacheQuant.apply(x, _scale_view(self, x)).to(x.dtype)


@contextlib.contextmanager
def exportable_kv_quantizers(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s calibrated FP8 quantizers of attention (KV cache, query, probabilities)
    compute the same values through :class:`_FP8CacheQuant`, which the TorchScript exporter can write (int8
    quantizers are left as they are)."""
    patched = _fp8_quantizers(model)
    for quantizer in patched:
        quantizer.forward = types.MethodType(_traceable_forward, quantizer)
    try:
        yield
    finally:
        for quantizer in patched:
            del quantizer.forward


# ===================================================================== which cache tensors are quantized
@dataclass(frozen=True)
class CacheTensor:
    """One quantized cache tensor of the file: its past input, present output, format and scale."""

    past: str
    present: str
    fmt: str
    scale: torch.Tensor  # 0-d, or one per key/value head
    target: str  # the projection it stands for (model.layers.0.self_attn.k_proj)

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (grid values, ``[batch, heads, sequence, head_dim]``) as codes of the cache's format."""
        return grid_codes(x, self._scale(), self.fmt).to(TORCH_CODES[self.fmt])

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """The float values of ``codes`` (``code * scale``, float32)."""
        return codes.float() * self._scale()

    def _scale(self) -> torch.Tensor:
        """The scale as it broadcasts over ``[batch, heads, sequence, head_dim]``."""
        return self.scale.float().view(1, -1, 1, 1) if self.scale.ndim else self.scale.float()


@dataclass(frozen=True)
class QuantizedCache:
    """The quantized cache tensors of one export (see the module docstring)."""

    tensors: tuple[CacheTensor, ...]

    @property
    def min_opset(self) -> int:
        return max(MIN_OPSETS[t.fmt] for t in self.tensors)

    @property
    def by_past(self) -> dict[str, CacheTensor]:
        return {t.past: t for t in self.tensors}

    @property
    def by_present(self) -> dict[str, CacheTensor]:
        return {t.present: t for t in self.tensors}

    def on_grid(self, example: Example) -> Example:
        """``example`` with its quantized pasts rounded to the cache's grid (a past made by the quantized model is
        already on it; one given by the caller may not be)."""
        by_past = self.by_past
        tensors = tuple(by_past[n].values(by_past[n].codes(t)) if n in by_past else t
                        for n, t in zip(example.names, example.tensors))
        return Example(tensors, example.names, keyword=example.keyword, past=example.past)


def _layer_index(model: nn.Module, attention: str, position: int) -> int:
    module = model.get_submodule(attention) if attention else model
    index = getattr(module, "layer_idx", position)
    return index if isinstance(index, int) else position


def quantized_cache(model: nn.Module, example: Example, requested: bool | None) -> QuantizedCache | None:
    """The cache tensors of an export of ``model`` on ``example`` that the file stores quantized (``None``: a float
    cache). ``requested``: ``None`` quantizes them where the model's cache is quantized after RoPE, ``True`` requires
    it (:class:`ExportError` otherwise, naming why), ``False`` keeps a float cache."""
    if requested is not None and not isinstance(requested, bool):
        raise ExportError(f"quantized_cache must be True, False or None; got {requested!r}")
    if not example.past:
        if requested:
            raise ExportError("quantized_cache=True needs past_key_values=True: without a past the file has no cache "
                              "to store")
        return None
    if requested is False:
        return None
    attentions = [(name, m) for name, m in model.named_modules()
                  if isinstance(getattr(m, KEY_QUANTIZER, None), KVCacheQuantizer)]
    pre_rope = [q.target for q in _quantizers(model) if not any(q is getattr(m, KEY_QUANTIZER) or
                                                                q is getattr(m, VALUE_QUANTIZER)
                                                                for _, m in attentions)]
    tensors = []
    for position, (name, attention) in enumerate(attentions):
        index = _layer_index(model, name, position)
        for kind, attr in (("key", KEY_QUANTIZER), ("value", VALUE_QUANTIZER)):
            quantizer = getattr(attention, attr)
            if not quantizer.enabled:
                continue
            if quantizer.calibrating:
                raise ExportError(f"{quantizer.target}: the KV-cache quantizer is not calibrated; quantize the model "
                                  "with calibration data before exporting")
            tensors.append(CacheTensor(f"past_key_values.{index}.{kind}", f"present.{index}.{kind}", quantizer.fmt,
                                       quantizer.scale.detach().clone().float(), quantizer.target))
    if not tensors:
        if requested and pre_rope:
            raise ExportError(f"quantized_cache=True: the cache of this model is quantized before RoPE "
                              f"(kv_cache_post_rope=False, at {pre_rope[0]}); RoPE moves the keys off the quantization "
                              "grid, so the cache cannot be stored as codes. Quantize with kv_cache_post_rope=True, or "
                              "export with quantized_cache=False (a float cache)")
        if requested:
            raise ExportError("quantized_cache=True: the model has no calibrated, enabled KV-cache quantizer "
                              "(kv_cache_quant_config with kv_cache_post_rope=True)")
        if pre_rope:
            logger.info("the KV cache is quantized before RoPE (kv_cache_post_rope=False): exported as a float "
                        "cache (keys after RoPE are not on the quantization grid)")
        return None
    known = {n for n in example.names if past_name(n) is not None}
    missing = [t.past for t in tensors if t.past not in known]
    if missing:
        raise ExportError(f"the model's KV-cache quantizers name cache layers the export has no past for: "
                          f"{', '.join(missing)}")
    return QuantizedCache(tuple(tensors))


# ===================================================================== the graph rewrite
def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if i == old else i for i in node.input]


def _quantization_params(graph: onnx.GraphProto, tensor: CacheTensor) -> tuple[str, str, dict[str, int]]:
    base = tensor.past.replace("past_key_values.", "kv_cache.")
    scale, zero = f"{base}.scale", f"{base}.zero_point"
    values = tensor.scale.numpy().astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(values, scale))
    zeros = [0] * int(values.size) if values.ndim else [0]
    graph.initializer.append(helper.make_tensor(zero, ELEMENT_TYPES[tensor.fmt], list(values.shape), zeros))
    return scale, zero, ({"axis": 1} if values.ndim else {})


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes]  # copies: the field is cleared below
    del graph.node[:]
    graph.node.extend(nodes)


def _producer(graph: onnx.GraphProto, name: str) -> onnx.NodeProto | None:
    return next((n for n in graph.node if name in n.output), None)


def rewrite(proto: onnx.ModelProto, cache: QuantizedCache) -> None:
    """Store ``cache``'s tensors as codes in ``proto`` (in place; see the module docstring)."""
    graph = proto.graph
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    front: list[onnx.NodeProto] = []
    for tensor in cache.tensors:
        if tensor.past not in inputs or tensor.present not in outputs:
            raise ExportError(f"the traced graph has no {tensor.past} input or {tensor.present} output "
                              f"({tensor.target}); cannot store it quantized")
        scale, zero, axis = _quantization_params(graph, tensor)
        past_float = f"{tensor.past}.dequantized"
        _rename_uses(graph, tensor.past, past_float)
        front.append(helper.make_node("DequantizeLinear", [tensor.past, scale, zero], [past_float],
                                      name=f"{tensor.past}.DequantizeLinear", **axis))
        inputs[tensor.past].type.tensor_type.elem_type = ELEMENT_TYPES[tensor.fmt]
        present_float = f"{tensor.present}.dequantized"
        producer = _producer(graph, tensor.present)
        if producer is None:
            raise ExportError(f"no node of the traced graph computes {tensor.present}")
        producer.output[:] = [present_float if o == tensor.present else o for o in producer.output]
        _rename_uses(graph, tensor.present, present_float)
        graph.node.append(helper.make_node("QuantizeLinear", [present_float, scale, zero], [tensor.present],
                                           name=f"{tensor.present}.QuantizeLinear", **axis))
        outputs[tensor.present].type.tensor_type.elem_type = ELEMENT_TYPES[tensor.fmt]
    _set_nodes(graph, [*front, *graph.node])
    concatenated = sum(_concat_codes(graph, t) for t in cache.tensors if t.fmt == "int8")
    logger.info("KV cache stored quantized: %d of the cache tensors as codes (%s), %d concatenated as int8 codes",
                len(cache.tensors), ", ".join(sorted({t.fmt for t in cache.tensors})), concatenated)


def _concat_codes(graph: onnx.GraphProto, tensor: CacheTensor) -> int:
    """``Q(Concat(DQ(past), new))`` -> ``Concat(past, Q(new))`` with the attention reading ``DQ`` of it: the int8
    past codes are copied, not re-quantized. Left alone (0) unless the present is exactly that concatenation."""
    quantize = _producer(graph, tensor.present)
    concat = _producer(graph, quantize.input[0]) if quantize is not None else None
    if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
        return 0
    first = _producer(graph, concat.input[0])
    source = concat.input[0]
    while first is not None and (first.op_type == "Identity" or (first.op_type == "Concat" and len(first.input) == 1)):
        source = first.input[0]  # the cache's first layer passes through a one-input Concat (torch.cat of [past])
        first = _producer(graph, source)
    if source != f"{tensor.past}.dequantized":
        return 0
    float_present = concat.output[0]
    new_codes = f"{tensor.present}.new_codes"
    scale, zero = quantize.input[1], quantize.input[2]
    axis = [a for a in quantize.attribute if a.name == "axis"]
    quantize_new = helper.make_node("QuantizeLinear", [concat.input[1], scale, zero], [new_codes],
                                    name=f"{tensor.present}.QuantizeLinear.new")
    quantize_new.attribute.extend(axis)
    codes_concat = helper.make_node("Concat", [tensor.past, new_codes], [tensor.present],
                                    name=f"{tensor.present}.Concat")
    codes_concat.attribute.extend(concat.attribute)
    dequantize = helper.make_node("DequantizeLinear", [tensor.present, scale, zero], [float_present],
                                  name=f"{tensor.present}.DequantizeLinear")
    dequantize.attribute.extend(axis)
    nodes = list(graph.node)
    at = nodes.index(concat)
    nodes[at:at + 1] = [quantize_new, codes_concat, dequantize]
    nodes.remove(quantize)
    if not any(f"{tensor.past}.dequantized" in n.input for n in nodes):
        nodes = [n for n in nodes if f"{tensor.past}.dequantized" not in n.output]
    _set_nodes(graph, nodes)
    return 1


# ===================================================================== running the file
def _ort_value(value: torch.Tensor | np.ndarray, ort_type: str) -> Any:
    import onnxruntime as ort

    if ort_type == "tensor(float8e4m3fn)":
        codes = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        if codes.dtype != torch.float8_e4m3fn:
            raise ExportError(f"a FLOAT8E4M3FN input needs torch.float8_e4m3fn codes; got {codes.dtype}")
        bits = codes.detach().cpu().contiguous().view(torch.uint8).numpy()
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.FLOAT8E4M3FN)
    from quark_brevitas.export.onnx.runtime import feed_array

    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feed_array(value, ort_type)))


def to_torch(value: Any) -> torch.Tensor:
    """An onnxruntime output (numpy array or OrtValue, FP8 included) as a torch tensor of its own dtype."""
    if hasattr(value, "data_type") and value.data_type() == "tensor(float8e4m3fn)":
        return torch.from_numpy(np.array(value.numpy(), dtype=np.uint8)).view(torch.float8_e4m3fn)
    array = value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value
    return torch.from_numpy(np.array(array))


def run_session(session: Any, feed: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``session`` on named inputs (torch tensors, numpy arrays or OrtValues; FP8 codes as
    ``torch.float8_e4m3fn``), returning OrtValues by output name: what a decoding loop feeds back as is."""
    import onnxruntime as ort

    types_ = {i.name: i.type for i in session.get_inputs()}
    values = {name: v if isinstance(v, ort.OrtValue) else _ort_value(v, types_[name]) for name, v in feed.items()}
    names = [o.name for o in session.get_outputs()]
    try:
        outputs = session.run_with_ort_values(names, values)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime failed to run the ONNX graph: {exc}") from exc
    return dict(zip(names, outputs))


def float_runner(cache: QuantizedCache, names: Sequence[str]
                 ) -> tuple[Callable[[Any, tuple[torch.Tensor, ...]], list[np.ndarray]],
                            Callable[[onnx.ModelProto, dict[str, np.ndarray]], dict[str, np.ndarray]]]:
    """Runners for the verification: float pasts in (encoded to codes), presents out as float values (decoded),
    so the file is compared with the float reference of :class:`~quark_brevitas.export.onnx.kv.CachedDecoder`.
    The first runs a file on positional tensors, the second an in-memory graph on named arrays (the pinned check)."""
    from quark_brevitas.export.onnx.runtime import cached_session, create_ort_session

    by_past, by_present = cache.by_past, cache.by_present

    def encode(name: str, value: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if name not in by_past:
            return value
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        return by_past[name].codes(tensor)

    def decode(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
        return {n: (by_present[n].values(to_torch(v)) if n in by_present else to_torch(v)).numpy()
                for n, v in outputs.items()}

    def run(path: Any, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        session = cached_session(path)
        outputs = decode(run_session(session, {n: encode(n, a) for n, a in zip(names, args)}))
        return [outputs[o.name] for o in session.get_outputs()]

    def run_proto(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import pathlib
        import tempfile

        with tempfile.TemporaryDirectory(prefix="quark_brevitas_run_") as tmp:
            file = pathlib.Path(tmp) / "model.onnx"
            onnx.save_model(proto, str(file), save_as_external_data=False)
            session = create_ort_session(file)
        return decode(run_session(session, {n: encode(n, v) for n, v in feed.items()}))

    return run, run_proto
