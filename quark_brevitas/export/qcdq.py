"""The verified QCDQ export: :func:`export_onnx_qcdq` and its :class:`ExportReport`.

Orchestrates the export: checks the arguments, inspects the quantizers and chooses the opset, runs
Brevitas' TorchScript QCDQ export in a private temporary directory, applies the graph passes, writes the
self-contained file, verifies it in onnxruntime against PyTorch and reports what was written.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass

import onnx
import torch
from brevitas.export import export_onnx_qcdq as _brevitas_export_onnx_qcdq
from brevitas.export.onnx.standard.qcdq.manager import StdQCDQONNXManager
from onnx import TensorProto, numpy_helper
from torch import nn

from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.args import PathLike, TensorArgs, _input_names, _normalize_args, _type_name
from quark_brevitas.export.blocked import (
    BLOCKED_OPSET,
    float_weights,
    insert_dequantize,
    plan_weights,
)
from quark_brevitas.export.errors import ExportArgumentError, ExportError, ExportMismatchError
from quark_brevitas.export.inspect import _candidate_opsets, _inspect_quantizers, _target
from quark_brevitas.export.passes import (
    _BIAS_CONSUMERS,
    _FLOAT_BIAS_REWRITE,
    _WEIGHT_CONSUMERS,
    _clean_graph,
    _move_float_biases_out,
    _operand_dtypes,
    _opset_of,
    _postprocess,
)
from quark_brevitas.export.runtime import _forget_session, _model_uses_float8, create_ort_session, run_onnx
from quark_brevitas.export.verify import _compare, _FlatOutputs, _reference, _unique_names, _validate_tolerance

logger = logging.getLogger(__name__)

#: A self-contained ONNX file is a single protobuf, limited to 2 GiB.
_PROTOBUF_LIMIT = 2**31 - 1


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


def _reset_export_state(model: nn.Module) -> None:
    """Best-effort cleanup after a failed Brevitas export (export mode must not leak)."""
    try:
        StdQCDQONNXManager.set_export_mode(model, enabled=False)
    except Exception:  # noqa: BLE001 - cleanup must not mask the original error
        logger.debug("could not reset Brevitas export mode", exc_info=True)
    for module in model.modules():
        if hasattr(module, "cache_inference_quant_act_backup"):
            module.cache_inference_quant_act = module.cache_inference_quant_act_backup
            del module.cache_inference_quant_act_backup


def _brevitas_export(
    wrapped: nn.Module,
    args: tuple[torch.Tensor, ...],
    target: pathlib.Path,
    *,
    opset: int,
    weight_q_node: bool,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    dynamic_batch: bool,
) -> onnx.ModelProto:
    dynamic_axes = (
        {name: {0: "batch"} for name, arg in zip(input_names, args) if arg.ndim > 0}
        if dynamic_batch
        else None
    )
    try:
        _brevitas_export_onnx_qcdq(
            wrapped,
            args=args[0] if len(args) == 1 else args,
            export_path=str(target),
            dynamo=False,
            opset_version=opset,
            export_weight_q_node=weight_q_node,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            keep_initializers_as_inputs=False,
        )
    except Exception as exc:
        _reset_export_state(wrapped)
        raise ExportError(
            f"Brevitas could not export the model to {_target(opset)}: {type(exc).__name__}: {exc}"
        ) from exc
    return onnx.load(str(target))


def _save(proto: onnx.ModelProto, path: pathlib.Path) -> None:
    try:
        onnx.save_model(proto, str(path), save_as_external_data=False)
    except ValueError as exc:
        raise ExportError(
            f"the exported model does not fit in a self-contained ONNX file (2 GiB protobuf limit): {exc}"
        ) from exc
    _forget_session(path)


def export_onnx_qcdq(
    model: nn.Module,
    args: TensorArgs,
    path: PathLike,
    *,
    opset: int | None = None,
    tolerance: float | None = None,
    dynamic_batch: bool = True,
    integer_kernels: bool = True,
) -> ExportReport:
    """Export a Brevitas-quantized model to a verified, self-contained ONNX QCDQ file.

    Args:
        model: The (calibrated) Brevitas-quantized model. It is run in eval mode under
            ``torch.no_grad()``; its training mode is restored afterwards.
        args: Example input: a tensor or a tuple/list of tensors (positional model inputs).
        path: Output ``.onnx`` file; its parent directory is created if missing. Only this file
            is written there.
        opset: ONNX opset. Default: 13 for integer-only models, the lowest opset >= 19 that
            exports and loads in onnxruntime when any float8 quantizer is present.
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
        dynamic_batch: Make dimension 0 of every input symbolic (``"batch"``), so the file runs
            on other batch sizes than the example's.
        integer_kernels: Apply the exact graph rewrites that let onnxruntime run the 8-bit integer
            layers with its integer kernels (QGemm, QLinearConv, ...; see the module docstring;
            opset >= 13, graphs with control flow are left alone). ``False`` keeps the graph as
            Brevitas writes it (constant folding only). Either way the file is verified.

    Returns:
        An :class:`ExportReport` with the file's path, opset, size, the verified difference and
        what the file stores.

    Raises:
        ExportArgumentError: ``args`` (or another argument) has the wrong type.
        ExportError: A quantization format or opset cannot be exported, Brevitas or onnxruntime
            fail on the model.
        ExportMismatchError: onnxruntime disagrees with PyTorch by more than ``tolerance``
            (the file is kept for inspection).

    Outputs (tensors, QuantTensors, nested tuples/lists/dicts, Hugging Face ``ModelOutput``)
    are flattened in a deterministic order -- sequences in order, mappings in insertion order,
    ``None`` skipped -- and become the graph outputs in that order.
    """
    if not isinstance(model, nn.Module):
        raise ExportArgumentError(f"model must be a torch.nn.Module; got {_type_name(model)}")
    example = _normalize_args(args)
    if not isinstance(path, (str, os.PathLike)):
        raise ExportArgumentError(f"path must be a str or os.PathLike; got {_type_name(path)}")
    out_path = pathlib.Path(path)
    if out_path.is_dir():
        raise ExportError(f"path {out_path} is a directory; give the .onnx file to write")
    tol = _validate_tolerance(tolerance)

    was_training = model.training
    model.eval()
    try:
        quantizers = _inspect_quantizers(model)
        opsets = _candidate_opsets(opset, quantizers)
        weight_q_node = any(q.is_float8 and q.role == "weight" for q in quantizers)
        reference = _reference(model, example)
        try:
            plans = plan_weights(model, [q.name for q in quantizers if q.planned])
        except QuarkBrevitasError as exc:
            raise ExportError(f"cannot export to {_target(BLOCKED_OPSET)}: {exc}") from exc
        input_names = _input_names(len(example))
        raw_names = [n for n, _ in reference.outputs]
        output_names = _unique_names(raw_names, input_names)
        single_tensor = len(raw_names) == 1 and raw_names[0] == "output"
        wrapped = model if single_tensor else _FlatOutputs(model)

        out_dir = out_path.parent
        before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
        errors: list[str] = []
        chosen: tuple[int, onnx.ModelProto, int, tuple[tuple[str, int], ...]] | None = None
        with tempfile.TemporaryDirectory(prefix="quark_brevitas_export_") as tmp:
            for candidate in opsets:
                try:
                    with float_weights(plans):
                        proto = _brevitas_export(
                            wrapped,
                            example,
                            pathlib.Path(tmp) / f"brevitas_opset{candidate}.onnx",
                            opset=candidate,
                            weight_q_node=weight_q_node,
                            input_names=input_names,
                            output_names=output_names,
                            dynamic_batch=dynamic_batch,
                        )
                    folded, rewrites = _postprocess(proto, integer_kernels=integer_kernels)
                    if plans:
                        try:
                            proto = insert_dequantize(proto, plans)
                        except QuarkBrevitasError as exc:
                            raise ExportError(str(exc)) from exc
                        _clean_graph(proto.graph)
                    if len(opsets) > 1:  # "lowest working opset": onnxruntime must accept the file
                        staged = pathlib.Path(tmp) / f"staged_opset{candidate}.onnx"
                        onnx.save_model(proto, str(staged))
                        create_ort_session(staged)
                except ExportError as exc:
                    errors.append(f"opset {candidate}: {exc}")
                    logger.debug("export attempt at opset %d failed: %s", candidate, exc)
                    continue
                chosen = (candidate, proto, folded, rewrites)
                break
        if chosen is None:
            formats = sorted({q.fmt for q in quantizers}) or ["float"]
            raise ExportError(
                f"cannot export {', '.join(formats)} to {_target('/'.join(map(str, opsets)))}: "
                + "; ".join(errors)
            )
        chosen_opset, proto, folded, rewrites = chosen
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as exc:
            logger.warning("onnx.checker reports a problem with %s: %s", out_path, exc)
        out_dir.mkdir(parents=True, exist_ok=True)
        _save(proto, out_path)
        stray = sorted(set(os.listdir(out_dir)) - before - {out_path.name})
        if stray:
            logger.warning(
                "files appeared in %s during export (not written by this export): %s", out_dir, stray
            )

        try:
            result = _compare(reference, run_onnx(out_path, example), out_path, tol)
        except ExportMismatchError as exc:
            moved = _move_float_biases_out(proto) if integer_kernels else 0
            if not moved:
                raise
            logger.info("%s; retrying with the float biases of %d quantized layers outside them", exc, moved)
            rewrites = (*rewrites, (_FLOAT_BIAS_REWRITE, moved))
            _save(proto, out_path)
            result = _compare(reference, run_onnx(out_path, example), out_path, tol)
    finally:
        model.train(was_training)

    graph = proto.graph
    float_types = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
    report = ExportReport(
        path=out_path,
        opset=_opset_of(proto),
        file_size=out_path.stat().st_size,
        max_abs_diff=result.max_abs_diff,
        tolerance=result.tolerance,
        tolerance_source=result.tolerance_source,
        formats=tuple(sorted({f"{q.fmt} {q.role}" for q in quantizers})),
        weight_dtypes=_operand_dtypes(graph, _WEIGHT_CONSUMERS, 1),
        bias_dtypes=_operand_dtypes(graph, _BIAS_CONSUMERS, 2),
        n_quantize_nodes=sum(n.op_type == "QuantizeLinear" for n in graph.node),
        n_dequantize_nodes=sum(n.op_type == "DequantizeLinear" for n in graph.node),
        n_folded_nodes=folded,
        rewrites=rewrites,
        float_initializer_bytes=sum(
            numpy_helper.to_array(i).nbytes for i in graph.initializer if i.data_type in float_types
        ),
        input_names=tuple(i.name for i in graph.input),
        output_names=tuple(o.name for o in graph.output),
        dynamic_batch=dynamic_batch,
        uses_float8=_model_uses_float8(proto),
    )
    logger.info(
        "exported %s (opset %d, %d bytes, weights %s): max |ORT - PyTorch| = %.3g <= %.3g",
        out_path,
        report.opset,
        report.file_size,
        ",".join(report.weight_dtypes) or "-",
        report.max_abs_diff,
        report.tolerance,
    )
    if chosen_opset != report.opset and not plans:  # pragma: no cover - defensive, torch writes what it is asked
        logger.warning("asked for opset %d, file declares %d", chosen_opset, report.opset)
    return report
