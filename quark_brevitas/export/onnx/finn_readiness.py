"""Will FINN turn this QONNX file into integer hardware? A static check of the file, without FINN.

FINN's front end (``ConvertQONNXtoFINN`` + ``Streamline``) maps a Conv/MatMul to hardware only when its input is
an integer tensor, i.e. the output of a quantizer (possibly through ops that keep the grid: max pooling,
reshapes, nearest upsampling), and converts activation quantizers under rules of its own. :func:`finn_readiness`
names, for each place that breaks them, the node, the tensor and the config change that fixes it
(docs/how-to/graph-finn.md):

- ``float_input``: a compute op whose data input is not quantized (a layerwise-quantized network's skip paths);
- ``float_weight``: a compute op whose weight is not a quantizer's output;
- ``scale_mismatch``: an add/concat whose inputs do not come from one quantizer with one scale;
- ``refused_quant``: a quantizer FINN refuses (zero point not 0, a signed or narrow one behind a ReLU, an unsigned
  one elsewhere, a bit width that is not constant);
- ``fork``: a quantized value read by a compute op and by something else, whose scale FINN's streamlining cannot
  move past the fork, leaving the compute op a float input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from quark_brevitas.export.errors import ExportError
from quark_brevitas.export.onnx.passes.graph import GRID_KEEPING_OPS

_COMPUTE = {"Conv", "MatMul", "Gemm", "ConvTranspose"}
_MERGE = {"Add", "Sub", "Concat"}
_QUANT = {"Quant", "BipolarQuant"}
_GRAPH_FIX = "quantize the whole network: Config(..., backend=Backend.graph) or a finn_w*a* preset"


@dataclass(frozen=True)
class FinnFinding:
    """One obstacle: ``kind`` (module docstring), the ONNX ``node`` and ``tensor`` at fault, the ``layer`` (the
    node's name, which Brevitas's export derives from the module), what is wrong and the config change that
    fixes it."""

    kind: str
    node: str
    tensor: str
    layer: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.node} ({self.tensor}): {self.message}; fix: {self.fix}"


def finn_readiness(path: str | os.PathLike[str] | Any) -> list[FinnFinding]:
    """The obstacles to FINN's conversion of the QONNX file at ``path`` (or an ``onnx.ModelProto``); ``[]``
    when none is found."""
    import onnx
    from onnx import numpy_helper

    try:
        model = path if isinstance(path, onnx.ModelProto) else onnx.load(os.fspath(path))
    except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError, Exception) as exc:  # noqa: BLE001
        raise ExportError(f"{path}: cannot read as an ONNX file ({type(exc).__name__}: {exc})") from exc
    graph = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for node in graph.node:  # Constant nodes hold parameters too
        if node.op_type == "Constant" and node.attribute:
            inits[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    def source(tensor: str) -> tuple[Any | None, list[str]]:
        """The quantizer a tensor comes from through grid-keeping ops (or None), and the tensors on the way."""
        chain = [tensor]
        node = producer.get(tensor)
        while node is not None and node.op_type in GRID_KEEPING_OPS:
            tensor = node.input[0]
            chain.append(tensor)
            node = producer.get(tensor)
        return (node if node is not None and node.op_type in _QUANT else None), chain

    def attr(node: Any, name: str, default: int = 0) -> int:
        return next((int(a.i) for a in node.attribute if a.name == name), default)

    findings: list[FinnFinding] = []
    for node in graph.node:
        label = node.name or node.op_type
        if node.op_type in _COMPUTE:
            if node.input[0] in inits:
                continue
            quant, chain = source(node.input[0])
            if quant is None:
                findings.append(FinnFinding("float_input", label, node.input[0], label, (
                    f"{node.op_type} reads float tensor {node.input[0]!r}, which no quantizer produces"), _GRAPH_FIX))
            elif any(len(consumers.get(t, [])) > 1 for t in chain[1:] + list(quant.output)):
                findings.append(FinnFinding("fork", label, node.input[0], label, (
                    "its quantized input also feeds other nodes; FINN's Streamline cannot move the scale past "
                    "the fork and leaves this op a float input"),
                    "use Backend.graph, which gives each compute layer its own call of the input's quantizer"))
            weight = node.input[1] if len(node.input) > 1 else ""
            wnode = producer.get(weight)
            if weight and not (wnode is not None and wnode.op_type in _QUANT) and weight not in inits:
                findings.append(FinnFinding("float_weight", label, weight, label,
                                            f"weight {weight!r} is computed in float", "give the layer a weight spec"))
            elif weight in inits and not np.array_equal(inits[weight], np.round(inits[weight])):
                findings.append(FinnFinding("float_weight", label, weight, label, f"weight {weight!r} is float",
                                            "give the layer a weight spec (QuantizationConfig.weight)"))
        elif node.op_type in _MERGE:
            dynamic = [name for name in node.input if name and name not in inits]
            if len(dynamic) < 2:  # one tensor and a constant (a bias, the ties-up offset): FINN's Streamline
                continue          # absorbs it into the next thresholds; only merged tensors need one scale
            quants = [source(name)[0] for name in dynamic]
            scales = [None if q is None else inits.get(q.input[1]) for q in quants]
            if any(q is None for q in quants):
                findings.append(FinnFinding("scale_mismatch", label, dynamic[quants.index(None)], label, (
                    f"{node.op_type} input {dynamic[quants.index(None)]!r} is not quantized, so the inputs do not "
                    "share one scale"), _GRAPH_FIX))
            elif len(scales) > 1 and any(s is None or not np.array_equal(s, scales[0]) for s in scales[1:]):
                findings.append(FinnFinding("scale_mismatch", label, dynamic[1], label, (
                    f"the inputs of {node.op_type} are quantized with different scales"),
                    "Backend.graph shares one quantizer among an add/concat's inputs"))
        elif node.op_type == "Quant" and node.input[0] not in inits:
            findings.extend(_quant_findings(node, label, producer, inits, attr))
    return findings


def _quant_findings(node: Any, label: str, producer: dict[str, Any], inits: dict[str, np.ndarray],
                    attr: Any) -> list[FinnFinding]:
    found = []
    zero = inits.get(node.input[2])
    bits = inits.get(node.input[3])
    if zero is None or np.any(zero != 0):
        found.append(FinnFinding("refused_quant", label, node.output[0], label, "zero point is not 0",
                                 "symmetric activations (QuantizationSpec(symmetric=True))"))
    if bits is None:
        found.append(FinnFinding("refused_quant", label, node.output[0], label, "bit width is not a constant",
                                 "a fixed bit_width"))
    before = producer.get(node.input[0])
    signed, narrow = attr(node, "signed", 1), attr(node, "narrow", 0)
    if before is not None and before.op_type == "Relu" and (signed or narrow):
        found.append(FinnFinding("refused_quant", label, node.output[0], label, (
            "a ReLU's quantizer must be unsigned and non-narrow for FINN"),
            "Backend.graph (unsigned quantizers behind ReLUs) or a finn_w*a* preset"))
    elif (before is None or before.op_type != "Relu") and not signed:
        found.append(FinnFinding("refused_quant", label, node.output[0], label, (
            "FINN accepts unsigned quantizers only right behind a ReLU"),
            "a signed spec here (QuantizationSpec(dtype=int*)), or Backend.graph"))
    return found


__all__ = ["FinnFinding", "finn_readiness"]
