"""The one table of export formats: what each is called, which function writes it from a model in memory and from
a checkpoint written block by block, the extra it needs, what ``--output`` names and what it can hold.

Everything that lists or dispatches formats reads this table: :meth:`quark_brevitas.api.ModelExporter.export`,
the command line's ``export --format`` and ``quantize --model --export`` choices and help, ``quark-brevitas list
formats`` and ``docs/how-to/cli.md``. Adding a format is one module (its writers) plus one row: a built-in row in
:data:`FORMATS` below, or :func:`register_format` from the user's own code::

    from quark_brevitas.export.registry import ExportFormat, register_format

    register_format(ExportFormat(
        name="npz", summary="integer codes and scales in a NumPy archive", holds="any quantized weight",
        layout="file", model_writer="my_package.npz_export:write_model"))

Why writers are named as ``"module:function"`` strings: the table is read by ``quark-brevitas --help``, which must
answer in a fraction of a second, so this module imports nothing heavy (no torch, onnx or Brevitas); a writer's
module is imported the first time the format is written.

The writer contract (every built-in writer is adapted to it in :mod:`~quark_brevitas.export.writers`):

- ``model_writer(model, output, *, example=None, overwrite=False, tokenizer_dir=None, **options)`` writes the
  quantized ``model`` to ``output`` (a file or a folder, :attr:`ExportFormat.layout`) and returns what it wrote
  (the path, or a report with a ``path``). ``example`` is the example input of formats that are traced
  (:attr:`ExportFormat.needs_example`); ``tokenizer_dir`` a folder holding the model's tokenizer; ``options`` are
  the format's own keyword arguments (for ONNX QCDQ, ``opset``, ``past_key_values``, ...).
- ``streamed_writer(checkpoint, output, *, overwrite=False, tokenizer_dir=None, **options)`` writes the same
  format from a checkpoint written block by block, one block in memory at a time, and returns the path written.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from quark_brevitas.errors import QuarkBrevitasError

__all__ = ["FORMATS", "ExportFormat", "UnknownFormatError", "format_names", "get_format", "register_format"]

#: A writer: the callable itself, or ``"module:function"`` imported on first use.
WriterRef = Callable[..., Any] | str


class UnknownFormatError(QuarkBrevitasError, ValueError):
    """A format name that no row of the table has (the message lists the formats there are)."""


def _load(ref: WriterRef, what: str) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what}: expected a callable or 'module:function', got {ref!r}")
    return getattr(importlib.import_module(module_name), attribute)


@dataclass(frozen=True)
class ExportFormat:
    """One export format (a row of :data:`FORMATS`)."""

    #: The name on the command line and in :meth:`~quark_brevitas.api.ModelExporter.export`.
    name: str
    #: One line: what the format is and which program runs or loads it.
    summary: str
    #: What it can hold (the quantization formats and model kinds it takes; the writer refuses the rest by name).
    holds: str
    #: What the output path names: one ``"file"`` or a ``"folder"`` written whole.
    layout: Literal["file", "folder"]
    #: Writes it from a quantized model in memory (see the module docstring for the contract).
    model_writer: WriterRef
    #: Writes it from a checkpoint written block by block; ``None``: the model is rebuilt in memory first.
    streamed_writer: WriterRef | None = None
    #: The ``pyproject.toml`` extra that installs what the writer needs (``None``: the base install).
    extra: str | None = None
    #: Top-level packages the writer imports (to say whether this install can write the format).
    requires: tuple[str, ...] = ()
    #: Traced with an example input and verified on the model's outputs (ONNX); the others store the weights.
    needs_example: bool = False
    #: Holds Hugging Face language models: offered by ``quantize --model DIR --export``.
    hf_lm: bool = False
    #: Other names accepted for it (``onnx`` for ``qcdq``).
    aliases: tuple[str, ...] = field(default=())
    #: A file layout's file name ending (``quantize --model --export`` writes ``OUT/<name>/model<suffix>``).
    suffix: str = ""
    #: The name in messages and tables (default: :attr:`name`).
    title: str = ""
    #: What reads the written file back to prove it (shown by ``list formats`` and the ``export`` table).
    checked_with: str = ""
    #: Whether a quantization plan can be written in this format, checked before calibration (``None``: no check):
    #: ``check(rows, skeleton, hf_config, tokenizer_dir)`` raises the ExportError the export would raise at its end
    #: (see :mod:`quark_brevitas.hf.plan_checks`).
    plan_check: WriterRef | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("file", "folder"):
            raise ValueError(f"ExportFormat {self.name!r}: layout must be 'file' or 'folder', got {self.layout!r}")

    @property
    def label(self) -> str:
        return self.title or self.name

    def write(self, model: Any, output: Any, **options: Any) -> Any:
        """Write ``model`` to ``output`` with this format's model writer; returns what the writer returns."""
        return _load(self.model_writer, f"format {self.name!r} model_writer")(model, output, **options)

    def export(self, source: Any, output: Any, **options: Any) -> Any:
        """The one entry of a format: ``source`` is a quantized model in memory (:meth:`write`) or the path of a
        checkpoint written block by block (:meth:`write_streamed`); what is written is the same either way."""
        if isinstance(source, str | os.PathLike):
            return self.write_streamed(source, output, **options)
        return self.write(source, output, **options)

    def write_streamed(self, checkpoint: Any, output: Any, **options: Any) -> Any:
        """Write the checkpoint written block by block at ``checkpoint`` to ``output``, block by block."""
        if self.streamed_writer is None:
            from quark_brevitas.export.errors import ExportError

            raise ExportError(f"format {self.name!r} has no block-by-block writer; rebuild the model and write it "
                              "from memory")
        return _load(self.streamed_writer, f"format {self.name!r} streamed_writer")(checkpoint, output, **options)

    def check_plan(self, rows: Any, skeleton: Any, hf_config: Any, tokenizer_dir: Any) -> None:
        """Raise now what writing this plan in this format would raise after calibration (nothing if the row has
        no :attr:`plan_check`)."""
        if self.plan_check is not None:
            _load(self.plan_check, f"format {self.name!r} plan_check")(rows, skeleton, hf_config, tokenizer_dir)

    def installed(self) -> bool:
        """Whether every package the writer needs can be imported here."""
        return all(importlib.util.find_spec(package) is not None for package in self.requires)


_WRITERS = "quark_brevitas.export.writers"
#: The block-by-block writers rebuild each block from the checkpoint (the checkpoint room, above this one): they are
#: named here, imported only when a row writes (as every writer is), so the export room imports nothing above it.
_STREAMED = "quark_brevitas.hf.export_streamed"
#: The checks before calibration quantize stand-in layers with the api (above this room): named here the same way.
_CHECKS = "quark_brevitas.hf.plan_checks"

#: Every format by name, in the order the command line lists them. :func:`register_format` adds rows.
FORMATS: dict[str, ExportFormat] = {
    row.name: row for row in (
        ExportFormat(
            name="qcdq", aliases=("onnx",), layout="file", needs_example=True, hf_lm=True, title="ONNX QCDQ",
            suffix=".onnx", checked_with="onnxruntime",
            summary="ONNX QuantizeLinear/Clip/DequantizeLinear, verified in onnxruntime (CPU)",
            holds="integer (up to 8 bits) and fp8 weights and activations per tensor/channel; per-group, MX, fp6 "
                  "and fp4 weights; int4 weight-only Linear as MatMulNBits; CNNs, encoders and decoders",
            model_writer=f"{_WRITERS}:write_qcdq", plan_check=f"{_CHECKS}:check_qcdq_plan"),
        ExportFormat(
            name="qonnx", layout="file", needs_example=True, extra="qonnx", requires=("qonnx",), title="QONNX",
            suffix=".onnx", checked_with="qonnx",
            summary="ONNX with Quant/FloatQuant nodes, verified by executing it with qonnx (FINN, hls4ml)",
            holds="integer and minifloat weights and activations of any width; static input shapes",
            model_writer=f"{_WRITERS}:write_qonnx"),
        ExportFormat(
            name="gguf", layout="folder", hf_lm=True, extra="gguf", requires=("gguf",), title="GGUF",
            checked_with="gguf's dequantization of every block",
            summary="llama.cpp's GGUF (and transformers' gguf_file=), every block proven to dequantize exactly",
            holds="weight-only Q8_0, Q4_0, Q4_1 (int8/int4 per group of 32, fp16 scales) of Llama, Mistral, "
                  "Qwen2 and GPT-2 decoders",
            model_writer=f"{_WRITERS}:write_gguf", streamed_writer=f"{_STREAMED}:write_gguf_streamed",
            plan_check=f"{_CHECKS}:check_gguf_plan"),
        ExportFormat(
            name="compressed-tensors", layout="folder", hf_lm=True, extra="deploy",
            requires=("compressed_tensors",),
            summary="Hugging Face folder in the compressed-tensors format (transformers, vLLM)",
            holds="int4/int8 weights per channel/group, int8/fp8 e4m3 activations, of Linear layers",
            model_writer=f"{_WRITERS}:write_compressed_tensors",
            streamed_writer=f"{_STREAMED}:write_compressed_tensors_streamed",
            plan_check=f"{_CHECKS}:check_compressed_tensors_plan"),
        ExportFormat(
            name="quark", layout="folder", hf_lm=True, extra="hf", requires=("transformers",),
            summary="Hugging Face folder in AMD Quark 0.13's format (transformers with amd-quark, vLLM)",
            holds="int4/int8/fp8 weights per tensor/channel/group, int8/fp8 activations, of Linear layers",
            model_writer=f"{_WRITERS}:write_quark", streamed_writer=f"{_STREAMED}:write_quark_streamed",
            plan_check=f"{_CHECKS}:check_quark_plan"),
    )
}


def register_format(row: ExportFormat, *, replace: bool = False) -> ExportFormat:
    """Add ``row`` to :data:`FORMATS` (the command line, ``ModelExporter.export`` and ``list formats`` see it at
    once). A name or alias already taken is a :class:`ValueError` unless ``replace``."""
    if not isinstance(row, ExportFormat):
        raise TypeError(f"register_format takes an ExportFormat, got {type(row).__name__}")
    taken = {alias: name for name, existing in FORMATS.items() for alias in (name, *existing.aliases)
             if not (replace and name == row.name)}
    clashes = sorted(name for name in (row.name, *row.aliases) if name in taken)
    if clashes:
        raise ValueError(f"export format name(s) {', '.join(map(repr, clashes))} already registered (format "
                         f"{taken[clashes[0]]!r}); pass replace=True to replace a row")
    FORMATS[row.name] = row
    return row


def get_format(name: str, table: Mapping[str, ExportFormat] | None = None) -> ExportFormat:
    """The row called ``name`` (or one of its aliases) in ``table`` (default :data:`FORMATS`; a
    :class:`~quark_brevitas.container.Container` may provide another); :class:`UnknownFormatError` listing the
    formats if none."""
    table = FORMATS if table is None else table
    if name in table:
        return table[name]
    for row in table.values():
        if name in row.aliases:
            return row
    names = [alias for row in table.values() for alias in (row.name, *row.aliases)]
    raise UnknownFormatError(f"unknown export format {name!r}; formats: {', '.join(names)}")


def format_names(*, aliases: bool = False, hf_lm: bool | None = None) -> list[str]:
    """The names in the table's order (with their aliases after them if ``aliases``); ``hf_lm``: only the formats
    that hold (``True``) or do not hold (``False``) Hugging Face language models."""
    names: list[str] = []
    for row in FORMATS.values():
        if hf_lm is None or row.hf_lm == hf_lm:
            names += [row.name, *(row.aliases if aliases else ())]
    return names
