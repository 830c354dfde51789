"""The one export procedure that every file format (QCDQ, QONNX) runs through.

Exporting a Brevitas model to a verified ONNX file takes the same steps whatever the format: check the
arguments, run the model in eval mode (restored afterwards, also on failure), reject the quantizers the
format cannot hold, record the PyTorch reference outputs, name the graph inputs and outputs, flatten
nested outputs, let Brevitas write the graph in a private temporary directory, post-process it, save
one self-contained file, verify it against the reference and report. :func:`export_verified` does these
steps, in this order, for every format; an :class:`ExportFormat` supplies only what differs (its
quantizer rules, the Brevitas call and post-processing, the runner used for verification, what to do
about a mismatch, its report). Keeping one procedure keeps the guarantees of the formats identical.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import onnx
import torch
from torch import nn

from quark_brevitas.brevitas_adapter import require_onnxoptimizer, reset_export_mode
from quark_brevitas.calibration.data import takes
from quark_brevitas.errors import QuarkBrevitasError
from quark_brevitas.export.args import (
    Example,
    PathLike,
    TensorArgs,
    check_model,
    check_path,
    normalize_example,
    with_attention_mask,
)
from quark_brevitas.export.errors import ExportError, ExportMismatchError
from quark_brevitas.export.onnx.kv import export_module, with_past
from quark_brevitas.export.onnx.kv_quant import (
    QuantizedCache,
    exportable_kv_quantizers,
    float_runner,
    kv_min_opset,
    rewrite,
)
from quark_brevitas.export.onnx.kv_quant import quantized_cache as cache_plan
from quark_brevitas.export.onnx.pinned import PinnedSummary, check_pinned
from quark_brevitas.export.onnx.precision import float32_for_export
from quark_brevitas.export.onnx.runtime import forget_session
from quark_brevitas.export.onnx.verify import (
    Reference,
    VerificationResult,
    accept,
    compute_reference,
    eval_mode,
    exported_module,
    measure,
    mismatch_error,
    unique_names,
    validate_tolerance,
)
from quark_brevitas.outputs import write_file

logger = logging.getLogger(__name__)

ReportT = TypeVar("ReportT")


@dataclass(frozen=True)
class GraphNames:
    """The graph's input names (in the order of the example args) and output names (in flattening order)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class ExportFormat(abc.ABC, Generic[ReportT]):
    """What one file format supplies to :func:`export_verified`.

    An instance serves one export call and may keep what its steps learn (chosen opset, applied
    rewrites, ...) for its report. Hooks run in the order they are listed here.
    """

    #: Prefix of the private temporary directory Brevitas writes into.
    temp_prefix: ClassVar[str]

    def check_options(self) -> None:  # noqa: B027 - an optional hook: most formats have no options to check
        """Check the format's own options (after the argument types, before the output path is examined)."""

    def require_tools(self) -> None:  # noqa: B027 - an optional hook
        """Raise :class:`ExportError` if a package the format needs is missing."""

    @abc.abstractmethod
    def inspect(self, model: nn.Module) -> None:
        """Reject quantizers the format cannot write (model in eval mode, before the reference run)."""

    def prepare(self, model: nn.Module) -> None:  # noqa: B027 - an optional hook
        """Work that needs the model after its reference run."""

    def require_opset(self, opset: int) -> None:  # noqa: B027 - an optional hook
        """The reference run found an operation (e.g. ``scaled_dot_product_attention``) that exports only from
        ``opset`` on: raise the format's opset to it, or raise :class:`ExportError` if the caller fixed a lower one."""

    @abc.abstractmethod
    def write(self, model: nn.Module, example: Example, names: GraphNames,
              workdir: pathlib.Path) -> onnx.ModelProto:
        """Let Brevitas export ``model`` (outputs already flat) inside ``workdir`` and post-process the graph."""

    def check_written(self, proto: onnx.ModelProto, path: pathlib.Path) -> None:  # noqa: B027 - an optional hook
        """Checks of the final graph before it is saved to ``path``."""

    @abc.abstractmethod
    def run(self, path: pathlib.Path, args: tuple[torch.Tensor, ...]) -> Sequence[np.ndarray]:
        """Execute the saved file on ``args`` with the format's runtime; outputs in graph order."""

    #: Whether :meth:`run_proto` works, so that a file failing the output comparison gets the pinned check
    #: of :mod:`~quark_brevitas.export.onnx.pinned`.
    can_pin: ClassVar[bool] = False

    def run_proto(self, proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute an in-memory variant of the file on named feeds (named outputs), as :meth:`run` does."""
        raise NotImplementedError

    def pinnable(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """The graph the pinned check runs: ``proto`` itself unless the format computes some activation codes
        inside a kernel, where it can add ops computing the same codes in front of it to pin them."""
        return proto

    def recover(self, proto: onnx.ModelProto, mismatch: ExportMismatchError) -> bool:
        """After a failed verification: change ``proto`` so that it may pass (``True``: it is saved and
        verified once more) or give up (``False``)."""
        return False

    def explain(self, mismatch: ExportMismatchError) -> ExportMismatchError:
        """The error to raise for a final mismatch (by default ``mismatch`` itself)."""
        return mismatch

    @abc.abstractmethod
    def report(self, proto: onnx.ModelProto, path: pathlib.Path, result: VerificationResult,
               names: GraphNames) -> ReportT:
        """The report of a verified file."""


def export_verified(fmt: ExportFormat[ReportT], model: nn.Module, args: TensorArgs, path: PathLike,
                    tolerance: float | None, *, past_key_values: bool = False,
                    quantized_cache: bool | None = None) -> ReportT:
    """Export ``model`` in ``fmt`` to the self-contained file ``path``, verify it, return ``fmt``'s report.

    With ``past_key_values`` (or an example holding ``past_key_values.{i}.key`` tensors) the decoder's key/value
    cache becomes graph inputs and outputs (:mod:`~quark_brevitas.export.onnx.kv`); ``quantized_cache`` says whether
    a model with a quantized KV cache stores it as codes there (:mod:`~quark_brevitas.export.onnx.kv_quant`).

    The file is saved under a temporary name beside ``path``, run from disk by the format's runtime, and renamed
    to ``path`` only once it is verified: ``path`` never holds a file that failed (an earlier file there stays).

    Raises :class:`~quark_brevitas.export.errors.ExportArgumentError` for arguments of the wrong type,
    :class:`ExportError` for what cannot be exported and :class:`ExportMismatchError` when the file
    disagrees with PyTorch beyond the tolerance (the file is kept for inspection as :func:`rejected_path`,
    ``model.rejected.onnx``, which the error names).
    """
    check_model(model)
    inputs = normalize_example(args)
    out_path = check_path(path)
    fmt.check_options()
    if out_path.is_dir():
        raise ExportError(f"path {out_path} is a directory; give the .onnx file to write")
    tol = validate_tolerance(tolerance)
    fmt.require_tools()
    _require_brevitas_exporter()
    model, inputs = float32_for_export(model, inputs)  # half-precision models export as float32

    with eval_mode(model):
        fmt.inspect(model)
        inputs = with_past(model, inputs) if past_key_values or inputs.past else with_attention_mask(model, inputs)
        cache = cache_plan(model, inputs, quantized_cache)
        if cache is not None:
            inputs = cache.on_grid(inputs)
        called = export_module(model, inputs)
        reference = compute_reference(called, inputs.tensors)
        fmt.prepare(model)
        fmt.require_opset(reference.min_opset)
        _require_cache_opset(fmt, max(kv_min_opset(model), cache.min_opset if cache is not None else 0))
        names = _graph_names(reference, inputs)
        flat = exported_module(called, reference)

        out_dir = out_path.parent
        before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
        with tempfile.TemporaryDirectory(prefix=fmt.temp_prefix) as tmp, _keyword_hint(model, inputs), \
                exportable_kv_quantizers(model):
            proto = fmt.write(flat, inputs, names, pathlib.Path(tmp))
        if cache is not None:
            rewrite(proto, cache)
        fmt.check_written(proto, out_path)
        out_dir.mkdir(parents=True, exist_ok=True)
        with _staged(out_path) as staged:
            save_model(proto, staged)
            stray = sorted(set(os.listdir(out_dir)) - before - {out_path.name, staged.name})
            if stray:
                logger.warning("files appeared in %s during export (not written by this export): %s", out_dir, stray)
            result = _verify(fmt, proto, reference, flat, inputs.tensors, names, staged, rejected_path(out_path), tol,
                             cache)
    return fmt.report(proto, out_path, result, names)


def rejected_path(path: pathlib.Path) -> pathlib.Path:
    """Where a file that failed its verification is kept for inspection (``model.onnx`` -> ``model.rejected.onnx``):
    beside the output, never under its name."""
    return path.with_name(f"{path.stem}.rejected{path.suffix}")


@contextlib.contextmanager
def _staged(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary name beside ``path`` for the file while it is verified (run from disk by the format's runtime):
    renamed to ``path`` when the block succeeds, so ``path`` only ever holds a verified file (an earlier one stays
    until then). A file that fails the comparison (:class:`ExportMismatchError`) is kept as :func:`rejected_path`,
    which its error names; after any other failure it is removed."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".verifying")
    os.close(handle)
    staged = pathlib.Path(name)
    try:
        yield staged
        os.replace(staged, path)
    except ExportMismatchError:
        os.replace(staged, rejected_path(path))
        raise
    finally:
        staged.unlink(missing_ok=True)
        forget_session(staged)
        forget_session(path)


@contextlib.contextmanager
def _keyword_hint(model: nn.Module, inputs: Example) -> Iterator[None]:
    """An exporter failure on a Hugging Face model given positional tensors says how to give the example: transformers
    builds its masks along paths the TorchScript exporter cannot write when no ``attention_mask`` comes with
    ``input_ids`` (5.x: ``aten::diff``), and only a keyword example gets one added (:func:`with_attention_mask`).
    Refusals of the format itself (raised without an underlying exception) pass unchanged."""
    try:
        yield
    except ExportError as exc:
        hugging_face = takes(model, "input_ids") and takes(model, "attention_mask")
        if inputs.keyword or exc.__cause__ is None or not hugging_face:
            raise
        raise ExportError(f"{exc}. {type(model).__name__} takes input_ids and attention_mask and was given positional "
                          "tensors: give the example as a dict, e.g. {'input_ids': ids, 'attention_mask': mask} or "
                          "the tokenizer's output") from exc


def _require_cache_opset(fmt: ExportFormat[Any], opset: int) -> None:
    """A quantized KV cache in the file needs ``opset`` (19 for FP8 codes and casts): raise the format's opsets to
    it, or say why the caller's opset cannot hold the cache."""
    if not opset:
        return
    try:
        fmt.require_opset(opset)
    except ExportError as exc:
        raise ExportError(f"the model's quantized KV cache (kv_cache_quant_config) needs opset >= {opset} in the "
                          f"file (FP8 E4M3 casts and QuantizeLinear/DequantizeLinear from 19, per-axis int8 from "
                          f"13): use opset=None or >= {opset}") from exc


def _require_brevitas_exporter() -> None:
    """Brevitas's TorchScript exporters need onnxoptimizer: say so before the export starts."""
    try:
        require_onnxoptimizer()
    except QuarkBrevitasError as exc:
        raise ExportError(str(exc)) from exc


def _graph_names(reference: Reference, example: Example) -> GraphNames:
    return GraphNames(example.names, unique_names([name for name, _ in reference.outputs], example.names))


def _verify(fmt: ExportFormat[Any], proto: onnx.ModelProto, reference: Reference, exported: nn.Module,
            example: tuple[torch.Tensor, ...], names: GraphNames, written: pathlib.Path, path: pathlib.Path,
            tolerance: float | None, cache: QuantizedCache | None = None) -> VerificationResult:
    """Compare the outputs of the file ``written`` (run from disk) with PyTorch; on a mismatch let the format change
    the graph (``recover``) and compare again; if it still differs, the pinned check decides (see
    :mod:`~quark_brevitas.export.onnx.pinned`). Errors name ``path``, where a rejected file is kept. A file with a
    quantized ``cache`` is fed the codes of the example's pasts and its presents are compared as float values."""
    run, run_proto = (fmt.run, fmt.run_proto) if cache is None else float_runner(cache, names.inputs)
    try:
        result = measure(reference, run(written, example), path, tolerance)
        if result.max_abs_diff <= result.tolerance:
            return result
        if fmt.recover(proto, mismatch_error(result, path)):
            save_model(proto, written)  # the format changed the graph: verify the new file once more
            result = measure(reference, run(written, example), path, tolerance)

        def pin(tol: float) -> PinnedSummary:
            on_disk = onnx.load(str(written))  # the file as written, not the graph in memory: it is what is proven
            return check_pinned(fmt.pinnable(on_disk), exported, example, names.inputs, reference.outputs, tol, path,
                                run_proto)

        return accept(result, path, pin if fmt.can_pin else None)
    except ExportMismatchError as exc:
        explained = fmt.explain(exc)
        if explained is exc:
            raise
        raise explained from exc


def save_model(proto: onnx.ModelProto, path: pathlib.Path) -> None:
    """Write ``proto`` as one self-contained file (no external data) and drop a cached session of ``path``.
    Written under a temporary name and renamed (:func:`quark_brevitas.outputs.write_file`), so an existing file
    is replaced only by a complete one."""
    try:
        write_file(path, lambda tmp: onnx.save_model(proto, str(tmp), save_as_external_data=False))
    except ValueError as exc:
        raise ExportError(
            f"the exported model does not fit in a self-contained ONNX file (2 GiB protobuf limit): {exc}"
        ) from exc
    forget_session(path)


def brevitas_export(export: Callable[..., Any], manager: Any, model: nn.Module, args: tuple[torch.Tensor, ...],
                    target_path: pathlib.Path, *, opset: int, names: GraphNames, where: str,
                    **options: Any) -> None:
    """Run one of Brevitas's TorchScript exporters (``export_onnx_qcdq``, ``export_qonnx``) to ``target_path``.

    The options every format passes are set here; a failure leaves Brevitas's export mode (of ``manager``)
    and becomes an :class:`ExportError` naming ``where`` it was exporting to.
    """
    try:
        with _native_output_to_log(where):
            export(
                model,
                args=args[0] if len(args) == 1 else args,
                export_path=str(target_path),
                dynamo=False,
                opset_version=opset,
                input_names=list(names.inputs),
                output_names=list(names.outputs),
                keep_initializers_as_inputs=False,
                **options,
            )
    except Exception as exc:
        reset_export_mode(model, manager)
        message = str(exc).strip().splitlines()
        first = message[0] if message else ""
        more = f" (and {len(message) - 1} more lines, logged at DEBUG level)" if len(message) > 1 else ""
        logger.debug("full error of the export to %s: %s", where, exc)
        raise ExportError(f"Brevitas could not export the model to {where}: {type(exc).__name__}: {first}{more}") \
            from exc


@contextlib.contextmanager
def _native_output_to_log(where: str) -> Iterator[None]:
    """Send what the exporter prints at the file-descriptor level to the DEBUG log instead of the terminal.

    torch's TorchScript exporter dumps the whole Torch IR graph to stderr when a conversion fails (its ONNX
    log switch is always on: ``setup_onnx_logging`` tests the function object instead of calling it), thousands
    of lines for a transformer before the one-line error that matters.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text = sink.read().decode("utf-8", errors="replace").strip()
            if text:
                logger.debug("output of the export to %s (%d lines):\n%s", where, text.count("\n") + 1, text)
