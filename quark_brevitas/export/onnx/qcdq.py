"""The verified QCDQ export: :func:`export_onnx_qcdq` and its :class:`ExportReport`.

What is particular to QCDQ on top of the shared procedure (:mod:`~quark_brevitas.export.onnx.orchestrate`):
the quantizer rules and the opset choice (:mod:`~quark_brevitas.export.onnx.inspect`), weights Brevitas cannot
write (:mod:`~quark_brevitas.export.onnx.blocked`), Brevitas's QCDQ export tried at each candidate opset, the
graph passes (:mod:`~quark_brevitas.export.onnx.passes`), verification in onnxruntime with one retry with float
biases moved out of quantized layers, and a report of what the file stores.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from brevitas.export import export_onnx_qcdq as _brevitas_export_onnx_qcdq
from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from torch import nn

from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.args import Example, PathLike, TensorArgs, dynamic_axes, past_name
from quark_brevitas.export.errors import ExportError, ExportMismatchError
from quark_brevitas.export.onnx.blocked import (
    BLOCKED_OPSET,
    PlannedWeight,
    float_weights,
    insert_dequantize,
    pack_4bit_weights,
    plan_weights,
)
from quark_brevitas.export.onnx.dynamic import (
    DynamicInput,
    float_inputs,
    fused_layers,
    insert_dynamic_quantization,
    mark_kernel_inputs,
    pinnable,
    plan_dynamic,
)
from quark_brevitas.export.onnx.inspect import Quantizer, candidate_opsets, inspect_quantizers, raise_opsets, target
from quark_brevitas.export.onnx.kv import past_axes
from quark_brevitas.export.onnx.onnx_types import uses_float8
from quark_brevitas.export.onnx.orchestrate import ExportFormat, GraphNames, brevitas_export, export_verified
from quark_brevitas.export.onnx.passes.float8 import relu_as_max_before_float8_quantizers
from quark_brevitas.export.onnx.passes.float_bias import FLOAT_BIAS_REWRITE, move_float_biases_out
from quark_brevitas.export.onnx.passes.folding import fold_constant_quantization
from quark_brevitas.export.onnx.passes.graph import clean_graph, opset_of, traced_module_paths
from quark_brevitas.export.onnx.passes.kernels import rewrite_for_integer_kernels, rewrite_for_weight_only_kernels
from quark_brevitas.export.onnx.runtime import create_ort_session, run_model_proto, run_onnx
from quark_brevitas.export.onnx.summary import bias_dtypes, count_ops, float_initializer_bytes, weight_dtypes
from quark_brevitas.export.onnx.verify import VerificationResult

logger = logging.getLogger(__name__)

Rewrites = tuple[tuple[str, int], ...]

#: How per-group 4-bit weights reach onnxruntime (``export_onnx_qcdq(int4_kernel=...)``).
INT4_KERNELS = ("matmulnbits", "dequantize")


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_onnx_qcdq` wrote and how well it matched PyTorch.

    Attributes:
        path: The written ``.onnx`` file (self-contained).
        opset: ONNX default-domain opset of the file.
        file_size: Size of the file in bytes.
        max_abs_diff: Largest ``|onnxruntime - PyTorch|`` over all outputs on the example args.
        tolerance: The tolerance ``max_abs_diff`` was checked against.
        tolerance_source: How ``tolerance`` was obtained (user value, output quantizer, range).
        formats: Quantization formats found in the model, e.g. ``"int8 weight"``.
        weight_dtypes: ONNX types of the initializers feeding the weight operand of
            Conv/ConvTranspose/Gemm/MatMul (directly or through DequantizeLinear), e.g. ``("INT8",)``.
        bias_dtypes: Same for the bias operand of Conv/ConvTranspose/Gemm, e.g. ``("INT32",)``.
        n_quantize_nodes: Number of ``QuantizeLinear`` nodes in the file.
        n_dequantize_nodes: Number of ``DequantizeLinear`` nodes in the file.
        n_folded_nodes: Constant ``QuantizeLinear``/``Clip`` nodes folded into initializers.
        float_initializer_bytes: Bytes held by floating-point initializers (scales, float layers).
        input_names: Graph input names, in the order of ``args``.
        output_names: Graph output names, in flattening order of the model's output.
        dynamic_batch: Whether dimension 0 of every input is symbolic (``"batch"``).
        uses_float8: Whether the file holds float8 tensors (opset >= 19; run it with
            :func:`create_ort_session` / :func:`run_onnx`, see the module docstring).
        rewrites: The integer-kernel rewrites applied, as ``(description, count)`` pairs, e.g.
            ``("ReLUs moved into the integer domain", 3)``; empty with ``integer_kernels=False``.
        dynamic_sequence: Whether dimension 1 of token inputs is symbolic (``"sequence"``).
        verified_by: ``"outputs"`` (``max_abs_diff <= tolerance``) or ``"pinned"``: the outputs differed by more
            (rounding flips propagated through a deep model) and the file was accepted because, with every
            activation quantizer pinned to PyTorch's codes, every quantizer and output matched
            (:mod:`quark_brevitas.export.onnx.pinned`); then ``max_abs_diff`` exceeds ``tolerance``.
        rounding_ties: With ``verified_by == "pinned"``: elements whose code differed at a rounding tie.
        n_4bit_weights: Weights of 2-4 bit per-tensor / per-channel quantizers stored as ``INT4``/``UINT4``
            (two codes a byte; the file is then opset 21).
        cache_dtypes: With ``past_key_values=True``: the ONNX element types of the ``past_key_values.*`` inputs,
            e.g. ``("INT8",)`` for a cache stored quantized (``quantized_cache``), ``("FLOAT",)`` for a float one.
    """

    path: pathlib.Path
    opset: int
    file_size: int
    max_abs_diff: float
    tolerance: float
    tolerance_source: str = ""
    formats: tuple[str, ...] = ()
    weight_dtypes: tuple[str, ...] = ()
    bias_dtypes: tuple[str, ...] = ()
    n_quantize_nodes: int = 0
    n_dequantize_nodes: int = 0
    n_folded_nodes: int = 0
    float_initializer_bytes: int = 0
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    dynamic_batch: bool = True
    uses_float8: bool = False
    rewrites: tuple[tuple[str, int], ...] = ()
    dynamic_sequence: bool = True
    verified_by: str = "outputs"
    rounding_ties: int = 0
    n_4bit_weights: int = 0
    cache_dtypes: tuple[str, ...] = ()


class QCDQFormat(ExportFormat[ExportReport]):
    """The QCDQ steps of one :func:`export_onnx_qcdq` call (see :class:`ExportFormat` for the order)."""

    temp_prefix = "quark_brevitas_export_"

    can_pin = True

    def __init__(self, *, opset: int | None, dynamic_batch: bool, dynamic_sequence: bool,
                 integer_kernels: bool, int4_weights: bool | None = None,
                 int4_kernel: str = "matmulnbits") -> None:
        if int4_kernel not in INT4_KERNELS:
            raise ExportError(f"int4_kernel must be one of {', '.join(map(repr, INT4_KERNELS))}; "
                              f"got {int4_kernel!r}")
        self.int4_kernel = int4_kernel
        self.int4_weights = int4_weights
        self.requested_opset = opset
        self.dynamic_batch = dynamic_batch
        self.dynamic_sequence = dynamic_sequence
        self.integer_kernels = integer_kernels
        self.quantizers: list[Quantizer] = []
        self.opsets: list[int] = []
        self.plans: list[PlannedWeight] = []
        self.dynamic: list[DynamicInput] = []
        self.written_dynamic: tuple[list[DynamicInput], dict[int, str]] = ([], {})  # of the file written
        self.packed = 0
        self.model_modules: dict[str, nn.Module] = {}
        self.chosen_opset = 0
        self.folded = 0
        self.rewrites: Rewrites = ()

    def inspect(self, model: nn.Module) -> None:
        self.quantizers = inspect_quantizers(model)
        self.model_modules = dict(model.named_modules())
        self.opsets = candidate_opsets(self.requested_opset, self.quantizers)

    def require_opset(self, opset: int) -> None:
        self.opsets = raise_opsets(self.opsets, opset, requested=self.requested_opset)

    def run_proto(self, proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_model_proto(proto, feed)

    def prepare(self, model: nn.Module) -> None:
        try:
            self.plans = plan_weights(model, [q.name for q in self.quantizers if q.planned])
        except QuarkBrevitasError as exc:
            raise ExportError(f"cannot export to {target(BLOCKED_OPSET)}: {exc}") from exc
        self.dynamic = plan_dynamic(model, [q.name for q in self.quantizers if q.dynamic])

    def write(self, model: nn.Module, example: Example, names: GraphNames,
              workdir: pathlib.Path) -> onnx.ModelProto:
        """Try the candidate opsets in turn; the first that exports (and, if there is a choice, loads in
        onnxruntime) wins."""
        errors: list[str] = []
        last: ExportError | None = None
        for candidate in self.opsets:
            try:
                proto = self._write_at(candidate, model, example, names, workdir)
            except ExportError as exc:
                errors.append(f"opset {candidate}: {exc}")
                logger.debug("export attempt at opset %d failed: %s", candidate, exc)
                last = exc
                continue
            self.chosen_opset = candidate
            return proto
        formats = sorted({q.fmt for q in self.quantizers}) or ["float"]
        raise ExportError(
            f"cannot export {', '.join(formats)} to {target('/'.join(map(str, self.opsets)))}: " + "; ".join(errors)
        ) from (last.__cause__ if last is not None else None)

    def _write_at(self, opset: int, model: nn.Module, example: Example, names: GraphNames,
                  workdir: pathlib.Path) -> onnx.ModelProto:
        raw_path = workdir / f"brevitas_opset{opset}.onnx"
        args = example.tensors
        axes = past_axes(example, names.outputs, batch=self.dynamic_batch, sequence=self.dynamic_sequence) \
            if example.past else dynamic_axes(example, batch=self.dynamic_batch, sequence=self.dynamic_sequence)
        weight_q_node = any(q.is_float8 and q.role == "weight" for q in self.quantizers)
        with float_weights(self.plans), float_inputs(self.dynamic):
            brevitas_export(_brevitas_export_onnx_qcdq, StdQCDQONNXManager, model, args, raw_path, opset=opset,
                            names=names, where=target(opset), export_weight_q_node=weight_q_node,
                            dynamic_axes=axes)
            proto = onnx.load(str(raw_path))
        paths = {id(module): name for name, module in model.named_modules()}  # module paths in the traced module
        dynamic, plans = _in_graph(proto, paths, self.dynamic, self.plans)
        self.folded = fold_constant_quantization(proto.graph)
        self.rewrites = rewrite_for_integer_kernels(proto) if self.integer_kernels else ()
        relus = relu_as_max_before_float8_quantizers(proto) if uses_float8(proto) else 0
        if relus:  # onnxruntime's default session would drop them (passes/float8.py)
            self.rewrites = (*self.rewrites, ("Relu before float8 QuantizeLinear written as Max(x, 0)", relus))
        if dynamic:
            done = insert_dynamic_quantization(proto, dynamic, paths)
            grouped = sum(1 for d in dynamic if d.group_size)
            fused = sum(1 for d in dynamic if d.fused)
            counts = (("Linear inputs quantized dynamically (MatMulInteger)", done - grouped),
                      ("Linear inputs quantized dynamically per group (in front of MatMulNBits)", grouped - fused))
            self.rewrites = (*self.rewrites, *((what, n) for what, n in counts if n))
        clean_graph(proto.graph)
        if plans:
            try:
                proto = insert_dequantize(proto, plans)
            except QuarkBrevitasError as exc:
                raise ExportError(str(exc)) from exc
            clean_graph(proto.graph)
        four_bit = [paths[id(self.model_modules[q.name])] for q in self.quantizers if q.role == "weight"
                    and not q.planned and q.fmt in ("int2", "int3", "int4", "uint2", "uint3", "uint4")
                    and id(self.model_modules.get(q.name)) in paths]
        if four_bit and self.int4_weights is not False:
            try:
                proto, packed = pack_4bit_weights(proto, four_bit, integer_layers=self.int4_weights is True)
            except QuarkBrevitasError as exc:
                raise ExportError(f"cannot store the 4-bit weights as INT4 ({target(BLOCKED_OPSET)}): {exc}") from exc
            self.packed = packed
            if packed:
                clean_graph(proto.graph)
        if self.int4_kernel == "matmulnbits":
            self.rewrites = (*self.rewrites, *rewrite_for_weight_only_kernels(proto))
            clean_graph(proto.graph)
        if any(d.group_size for d in dynamic):  # after the MatMulNBits rewrite: its kernel quantizes the inputs
            done = mark_kernel_inputs(proto, dynamic, paths)
            fused = len(fused_layers(proto, dynamic, paths))
            counts = (("per-group int8 inputs multiplied by MatMulNBits at accuracy_level 4 "
                       "(int8 x int4 block products)", done),
                      ("of them quantized inside the kernel (raw float input, no quantization ops)", fused))
            self.rewrites = (*self.rewrites, *((what, n) for what, n in counts if n))
        self.written_dynamic = (dynamic, paths)
        if len(self.opsets) > 1:  # "lowest working opset": onnxruntime must accept the file
            staged = workdir / f"staged_opset{opset}.onnx"
            onnx.save_model(proto, str(staged))
            create_ort_session(staged)
        return proto

    def pinnable(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """Per-group int8 inputs quantized inside ``MatMulNBits`` get their explicit quantization ops for the pinned
        run (:func:`quark_brevitas.export.onnx.dynamic.pinnable`: the same function, with code nodes to pin)."""
        dynamic, paths = self.written_dynamic
        return pinnable(proto, dynamic, paths) if any(d.fused for d in dynamic) else proto

    def check_written(self, proto: onnx.ModelProto, path: pathlib.Path) -> None:
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as exc:
            logger.warning("onnx.checker reports a problem with %s: %s", path, exc)

    def run(self, path: pathlib.Path, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        return run_onnx(path, args)

    def recover(self, proto: onnx.ModelProto, mismatch: ExportMismatchError) -> bool:
        """onnxruntime's int32 rounding of float biases may be what broke the tolerance: move them out."""
        moved = move_float_biases_out(proto) if self.integer_kernels else 0
        if moved:
            logger.info("%s; retrying with the float biases of %d quantized layers outside them", mismatch, moved)
            self.rewrites = (*self.rewrites, (FLOAT_BIAS_REWRITE, moved))
        return bool(moved)

    def report(self, proto: onnx.ModelProto, path: pathlib.Path, result: VerificationResult,
               names: GraphNames) -> ExportReport:
        graph = proto.graph
        report = ExportReport(
            path=path,
            opset=opset_of(proto),
            file_size=path.stat().st_size,
            max_abs_diff=result.max_abs_diff,
            tolerance=result.tolerance,
            tolerance_source=result.tolerance_source,
            formats=tuple(sorted({f"{q.fmt} {q.role}" for q in self.quantizers})),
            weight_dtypes=weight_dtypes(graph),
            bias_dtypes=bias_dtypes(graph),
            n_quantize_nodes=count_ops(graph, "QuantizeLinear"),
            n_dequantize_nodes=count_ops(graph, "DequantizeLinear"),
            n_folded_nodes=self.folded,
            rewrites=self.rewrites,
            float_initializer_bytes=float_initializer_bytes(graph),
            input_names=tuple(i.name for i in graph.input),
            output_names=tuple(o.name for o in graph.output),
            dynamic_batch=self.dynamic_batch,
            dynamic_sequence=self.dynamic_sequence,
            uses_float8=uses_float8(proto),
            verified_by="pinned" if result.pinned is not None else "outputs",
            rounding_ties=result.pinned.tie_elements if result.pinned is not None else 0,
            n_4bit_weights=self.packed,
            cache_dtypes=tuple(sorted({onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type)
                                       for i in graph.input if past_name(i.name) is not None})),
        )
        logger.info(
            "exported %s (opset %d, %d bytes, weights %s): max |ORT - PyTorch| = %.3g, %s tolerance %.3g",
            path,
            report.opset,
            report.file_size,
            ",".join(report.weight_dtypes) or "-",
            report.max_abs_diff,
            "within" if report.verified_by == "outputs" else "rounding flips beyond (pinned check passed),",
            report.tolerance,
        )
        if self.chosen_opset != report.opset and not self.plans and not self.packed:  # pragma: no cover
            logger.warning("asked for opset %d, file declares %d", self.chosen_opset, report.opset)
        return report


def _in_graph(proto: onnx.ModelProto, paths: dict[int, str], dynamic: Sequence[DynamicInput],
              plans: Sequence[PlannedWeight]) -> tuple[list[DynamicInput], list[PlannedWeight]]:
    """The dynamic inputs and planned weights whose layer the traced graph uses. A quantized layer whose result
    nothing reads (a pooler behind a wrapper that returns only ``last_hidden_state``) has no node in the graph:
    it is not an error, there is just nothing to rewrite; logged at INFO level, naming the layers."""
    used = traced_module_paths(proto.graph)

    def in_graph(layer: nn.Module) -> bool:
        path = paths.get(id(layer))
        return path is None or path == "" or path in used  # the model itself (path "") is always traced

    unused = sorted({paths[id(item.layer)] for item in (*dynamic, *plans) if not in_graph(item.layer)})
    if unused:
        logger.info("quantized layer(s) not used by the traced graph, left out of the file: %s", ", ".join(unused))
    return [d for d in dynamic if in_graph(d.layer)], [p for p in plans if in_graph(p.layer)]


def export_onnx_qcdq(
    model: nn.Module,
    args: TensorArgs,
    path: PathLike,
    *,
    opset: int | None = None,
    tolerance: float | None = None,
    dynamic_batch: bool = True,
    integer_kernels: bool = True,
    dynamic_sequence: bool = True,
    int4_weights: bool | None = None,
    past_key_values: bool = False,
    int4_kernel: str = "matmulnbits",
    quantized_cache: bool | None = None,
) -> ExportReport:
    """Export a Brevitas-quantized model to a verified, self-contained ONNX QCDQ file.

    Args:
        model: The (calibrated) Brevitas-quantized model. It is run in eval mode under
            ``torch.no_grad()``; its training mode is restored afterwards.
        args: Example input: a tensor or a tuple/list of tensors (positional model inputs), or a
            mapping of keyword tensors, e.g. a Hugging Face tokenizer's output (the model is called
            as ``model(**args)``; the graph inputs are named after the keys, in their order).
        path: Output ``.onnx`` file; its parent directory is created if missing. Only this file
            is written there.
        opset: ONNX opset. Default: 13 for integer-only models (14 if the model calls
            ``scaled_dot_product_attention``, as Hugging Face models do by default), the lowest
            opset >= 19 that exports and loads in onnxruntime when any float8 quantizer is present.
        tolerance: Largest accepted ``|onnxruntime - PyTorch|``. Default: one quantization step
            of the output, i.e.

            * if the last quantized op executed by the model (a Brevitas ``QuantLayer``) has an
              enabled output quantizer (``output_quant``, or ``act_quant`` of QuantReLU /
              QuantIdentity / ...): the largest scale of that quantizer; for an fp8 output
              quantizer one step of the format's top binade (scale x 32 for e4m3, x 8192 for
              e5m2), the largest spacing between its representable values;
            * otherwise one 8-bit step of the reference output's range,
              ``(max - min) / 255`` over all (flattened) reference outputs;

            plus an epsilon of ``1e-6 * max(1, max |reference|)``.

            **Deep models.** A float difference of one unit in the last place can move one
            activation across a rounding boundary; deeper layers spread that step until a correct
            file differs from PyTorch by many output steps. When the outputs differ by more than
            the tolerance and the model quantizes activations, the file is run once more with the
            output of every activation quantizer *pinned* to PyTorch's codes while the file's own
            codes are recorded: it is accepted only if every quantizer's codes match PyTorch's
            except at rounding ties (PyTorch's input within 1 % of a step of the midpoint) and the
            pinned outputs are within the tolerance (``report.verified_by == "pinned"``). A wrong
            scale, a dropped op or a kernel with other numerics is still rejected, naming the
            first quantizer whose input it changed. See :mod:`quark_brevitas.export.onnx.pinned`.
        dynamic_batch: Make dimension 0 of every input symbolic (``"batch"``), so the file runs
            on other batch sizes than the example's.
        integer_kernels: Apply the exact graph rewrites that let onnxruntime run the 8-bit integer
            layers with its integer kernels (QGemm, QLinearConv, ...; see :mod:`quark_brevitas.export`;
            opset >= 13, graphs with control flow are left alone). ``False`` keeps the graph as
            Brevitas writes it (constant folding only). Either way the file is verified.
        dynamic_sequence: Make dimension 1 of token inputs symbolic (``"sequence"``): rank-2
            integer inputs such as ``input_ids`` / ``attention_mask``, and inputs of rank >= 2
            whose dimension 1 has their length, so a padded batch of any length runs.
        int4_weights: How per-tensor / per-channel 2-4 bit weights are stored. ``None`` (default):
            as ``INT4``/``UINT4`` (two codes a byte, opset 21) in layers whose input is not
            quantized (weight-only), as int8 codes where the input is 8-bit quantized, because
            onnxruntime runs those layers on its integer kernels only with 8-bit weights. ``True``:
            every such weight as INT4 (smallest file; W4A8 layers then run unfused). ``False``:
            int8 codes everywhere.
        past_key_values: Export a decoder LM (GPT-2, OPT, Llama, ...) with its key/value cache as graph inputs
            and outputs, for incremental decoding in onnxruntime. ``args`` is then the prompt batch, a dict with
            ``input_ids`` (at least 3 tokens) and optionally ``attention_mask``: the model runs on the first
            ``min(n // 2, n - 2)`` tokens to make a past, the rest is the traced and verified step. A dict that
            already holds ``past_key_values.{i}.key`` / ``.value`` tensors (then at least 2 current tokens) is used
            as is. Graph inputs: the dict's keys (``input_ids``, ``attention_mask`` over past + current tokens),
            then ``past_key_values.{i}.key`` / ``.value`` ``[batch, kv_heads, past_sequence, head_dim]`` per layer;
            outputs: ``logits`` then ``present.{i}.key`` / ``.value`` (past + current tokens). Feed the presents
            back as the next step's pasts; a first step takes pasts of length 0. Models whose forward takes no
            cache, or returns none with ``use_cache=True`` (BERT, ...), raise :class:`ExportError`.
        quantized_cache: With ``past_key_values=True``, whether the pasts and presents of a model with a quantized
            KV cache (``kv_cache_quant_config`` with ``kv_cache_post_rope=True``) are stored as codes: ``INT8`` or
            ``FLOAT8E4M3FN`` with the calibrated scale (``DequantizeLinear`` after each past input,
            ``QuantizeLinear`` before each present output; 1 byte per element between steps). ``None`` (default):
            where the model's cache is quantized after RoPE; ``True``: required (:class:`ExportError` otherwise, e.g.
            for a cache quantized before RoPE); ``False``: a float cache. The file is verified on the codes of the
            example's pasts. See :mod:`quark_brevitas.export.onnx.kv_quant`.
        int4_kernel: How per-group (and MX) 4-bit weights of Linear layers reach onnxruntime. ``"matmulnbits"``
            (default; onnxruntime is this function's target): as its ``MatMulNBits`` kernel (com.microsoft, 4-bit
            codes packed two a byte, the same codes, scales and zero points, ``accuracy_level`` 1 = float32
            arithmetic), which reads the packed weight directly and decodes several times faster than float;
            weights it cannot take (a group size that is not a power of two >= 16, a weight shared with an
            embedding) stay in the ``"dequantize"`` form, named in an INFO log. ``"dequantize"``: standard ONNX
            only, ``INT4``/``UINT4`` codes and a blocked ``DequantizeLinear`` (opset 21) in front of a float
            ``MatMul``/``Gemm``, for other runtimes; onnxruntime's default session fuses that into its own
            ``MatMulNBits`` at accuracy level 4 (int8 activations on the fly), which changes the results a little.

    Returns:
        An :class:`ExportReport` with the file's path, opset, size, the verified difference and
        what the file stores.

    Raises:
        ExportArgumentError: ``args`` (or another argument) has the wrong type.
        ExportError: A quantization format or opset cannot be exported, Brevitas or onnxruntime
            fail on the model, or onnxoptimizer (which Brevitas's exporter needs) is missing.
        ExportMismatchError: onnxruntime disagrees with PyTorch by more than ``tolerance``
            (the file is kept for inspection).

    Outputs (tensors, QuantTensors, nested tuples/lists/dicts, Hugging Face ``ModelOutput``)
    are flattened in a deterministic order -- sequences in order, mappings in insertion order,
    ``None`` skipped -- and become the graph outputs in that order.
    """
    fmt = QCDQFormat(opset=opset, dynamic_batch=dynamic_batch, dynamic_sequence=dynamic_sequence,
                     integer_kernels=integer_kernels, int4_weights=int4_weights, int4_kernel=int4_kernel)
    return export_verified(fmt, model, args, path, tolerance, past_key_values=past_key_values,
                           quantized_cache=quantized_cache)
