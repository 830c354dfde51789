"""The ``quark-brevitas`` command line: quantize, export and check the built-in digits CNN.

Subcommands:

- ``quantize``: train the digits CNN (seconds), quantize it with a preset or a config file, export
  it to ONNX QCDQ, run the file in onnxruntime on the test set and print a results table; the
  numbers also go to ``OUTPUT/report.json`` and the config used to ``OUTPUT/config.json``;
  ``--save-checkpoint DIR`` also saves the quantized model (see :mod:`quark_brevitas.checkpoint`).
  With ``--model DIR --calib-text FILE``: quantize a Hugging Face folder (a causal LM or an encoder)
  into the checkpoint ``OUTPUT`` instead, block by block when it is made of blocks, and report
  perplexity (or embedding cosine) before and after on held-out text (:mod:`quark_brevitas.hf.lm`);
  ``--export onnx|gguf|compressed-tensors|quark`` also writes that format into ``OUTPUT/<format>/``.
- ``export``: rebuild a saved checkpoint and export it to ONNX QCDQ or QONNX, verified against the
  rebuilt PyTorch model; or write it as GGUF, compressed-tensors or Quark's format
  (:mod:`quark_brevitas.cli.deploy`), block by block for a checkpoint written block by block.
- ``plan``: which layers of the digits CNN a config quantizes, and how.
- ``presets``: the named configs ``--preset`` accepts.
- ``analyze``: where accuracy goes: the layer-by-layer comparison and the sensitivity ranking of a config,
  printed and written as JSON, CSV and PNG (see :mod:`quark_brevitas.analysis`).
- ``autoconfig``: a mixed-precision config (one candidate format per layer) under an average-weight-bits or
  bytes budget or a metric target, written as YAML for ``quantize --config`` and ``plan --config``.

Bad user input (any :class:`~quark_brevitas.errors.QuarkBrevitasError` or export error) is
reported as ``error: <message>`` on stderr with exit status 2, without a traceback; anything else
is a bug and propagates. Progress goes through :mod:`logging` (``-v`` for debug, ``-q`` for
warnings only); only the final table or listing is printed to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from quark_brevitas.cli.analysis import add_analysis_commands
from quark_brevitas.cli.export import cmd_export
from quark_brevitas.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_OUTPUT,
    DEFAULT_TOKEN_SHAPE,
    EXPORT_FORMATS,
    QUANTIZE_EXPORTS,
    positive_int,
    shape_option,
)
from quark_brevitas.cli.plan import cmd_plan, cmd_presets, run_order_lines
from quark_brevitas.cli.quantize import cmd_quantize
from quark_brevitas.config.presets import DEFAULT_PRESET
from quark_brevitas.errors import QuarkBrevitasError

__all__ = ["main", "run_order_lines"]

logger = logging.getLogger("quark_brevitas.cli")


def _build_parser() -> argparse.ArgumentParser:
    # -v/-q are accepted before and after the subcommand; SUPPRESS keeps a subcommand's absent flag
    # from overwriting one given before it.
    verbosity = argparse.ArgumentParser(add_help=False)
    group = verbosity.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    group.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="warnings only")

    parser = argparse.ArgumentParser(
        prog="quark-brevitas",
        description="Quark's Brevitas-flavoured quantization API, executed by Brevitas.",
        parents=[verbosity],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    config_args = argparse.ArgumentParser(add_help=False)
    source = config_args.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="a .json/.yaml/.yml Config file")
    source.add_argument("--preset", metavar="NAME", help=f"a named config (default {DEFAULT_PRESET}); see 'presets'")

    quantize = sub.add_parser(
        "quantize", parents=[verbosity, config_args],
        help="train, quantize, export and check the digits CNN",
        description="Train the digits CNN, quantize it, export ONNX QCDQ and check the file in onnxruntime.",
    )
    quantize.add_argument("--output", metavar="DIR", default=DEFAULT_OUTPUT,
                          help=f"output directory (default {DEFAULT_OUTPUT})")
    quantize.add_argument("--epochs", type=positive_int, default=15, help="training epochs (default 15)")
    quantize.add_argument("--seed", type=int, default=0, help="data split and training seed (default 0)")
    quantize.add_argument("--save-checkpoint", metavar="DIR", default=None,
                          help="also save the quantized model as a checkpoint directory (for 'export' and reloading)")
    quantize.add_argument("--overwrite", action="store_true",
                          help="write into --output (and --save-checkpoint) even if it holds files quark_brevitas did "
                               "not write; only the entries this run writes are replaced (never the --model folder)")
    llm = quantize.add_argument_group("a Hugging Face model instead of the digits CNN")
    llm.add_argument("--model", metavar="DIR", default=None,
                     help="a Hugging Face model folder (from_pretrained, safetensors): quantize it into the "
                          "checkpoint --output, block by block when it is made of blocks")
    llm.add_argument("--calib-text", metavar="FILE", default=None, help="plain-text calibration file (with --model)")
    llm.add_argument("--tokenizer", metavar="DIR", default=None,
                     help="a folder holding the model's tokenizer (default: --model, which then must hold it)")
    llm.add_argument("--eval-text", metavar="FILE", default=None,
                     help="held-out text for perplexity / embedding cosine (default: the last tenth of --calib-text)")
    llm.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence (default 128)")
    llm.add_argument("--batch-size", type=positive_int, default=4, help="sequences per batch (default 4)")
    llm.add_argument("--calib-sequences", type=positive_int, default=128,
                     help="calibration sequences (default 128)")
    llm.add_argument("--eval-sequences", type=positive_int, default=32, help="evaluation sequences (default 32)")
    llm.add_argument("--prompt", default=None, help="also generate a continuation of this prompt (causal LMs)")
    llm.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    llm.add_argument("--offload", choices=("disk",), default=None,
                     help="keep cached activations on disk instead of in memory")
    llm.add_argument("--export", choices=QUANTIZE_EXPORTS, default=None,
                     help="also write the quantized model as ONNX QCDQ (verified in onnxruntime), GGUF (llama.cpp; "
                          "needs a gguf_* preset: q4_0/q4_1/q8_0, K-quants q2_k..q6_k), compressed-tensors or "
                          "quark (AMD Quark's format; both for transformers and vLLM) into "
                          "--output/<format>/")
    llm.add_argument("--no-resume", action="store_true",
                     help="start over even if --output holds an interrupted run of the same job")
    quantize.set_defaults(func=cmd_quantize)

    export = sub.add_parser(
        "export", parents=[verbosity],
        help="export a saved checkpoint to ONNX QCDQ, QONNX, GGUF, compressed-tensors or Quark's format",
        description="Rebuild a checkpoint written by 'quantize --save-checkpoint', 'quantize --model' (a Hugging "
                    "Face model) or save_quantized and export it; the file is checked against the rebuilt PyTorch "
                    "model (onnxruntime for QCDQ, qonnx for QONNX); GGUF blocks are proven to dequantize to the "
                    "quantized weights exactly.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint directory")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="qcdq",
                        help="qcdq (default), qonnx, gguf, compressed-tensors or quark")
    export.add_argument("--output", metavar="PATH", required=True,
                        help="the .onnx file to write; for gguf, compressed-tensors and quark the folder to write")
    export.add_argument("--overwrite", action="store_true",
                        help="gguf / compressed-tensors / quark: write into --output even if it holds files "
                             "quark_brevitas did not write (only the entries this run writes are replaced)")
    export.add_argument("--input-shape", metavar="SHAPE", type=shape_option, default=None,
                        help="example input shape such as 1,1,8,8 (random values; for a Hugging Face model "
                             "BATCH,SEQUENCE of random token ids; default: the checkpoint's stored example input, "
                             "for a Hugging Face model without one a sentence through its saved tokenizer, else "
                             f"random token ids of shape {','.join(map(str, DEFAULT_TOKEN_SHAPE))})")
    export.add_argument("--model", metavar="MODULE:CALLABLE", default=None,
                        help="callable returning the float architecture (default: the Hugging Face class and "
                             f"config recorded in the checkpoint, else {DEFAULT_MODEL})")
    export.set_defaults(func=cmd_export)

    plan = sub.add_parser("plan", parents=[verbosity, config_args],
                          help="show which layers of the digits CNN (or of a Hugging Face model) get quantized")
    plan.add_argument("--model", metavar="DIR", default=None,
                      help="a Hugging Face model folder: its plan, built without reading the weights (default "
                           "config: the one 'quantize --model' uses)")
    template = plan.add_argument_group("a Quark 0.13 LLMTemplate instead of --config / --preset")
    template.add_argument("--template", metavar="MODEL_TYPE", default=None,
                          help="the template's model type (llama, mistral, qwen2, opt, gpt2, bert)")
    template.add_argument("--scheme", default=None, help="the template's scheme (e.g. int4_wo_128, int8, fp8, mxfp4)")
    template.add_argument("--algorithm", metavar="NAME", action="append", default=None,
                          help="an algorithm (awq, gptq, smoothquant, qronos, autoround); repeat it for several, "
                               "applied in that order")
    plan.set_defaults(func=cmd_plan)

    presets = sub.add_parser("presets", parents=[verbosity], help="list the presets")
    presets.set_defaults(func=cmd_presets)
    add_analysis_commands(sub, verbosity, config_args)
    return parser


@contextmanager
def _logging_setup(level: int) -> Iterator[None]:
    """Compact logging to stderr (and Python warnings through it) for the duration of one command."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(asctime)s %(levelname)-7s %(name)s: %(message)s" if level <= logging.DEBUG else \
        "%(asctime)s %(levelname)-7s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            if level > logging.DEBUG:
                # Deprecation notices from inside Brevitas/PyTorch are not actionable for the user.
                for category in (DeprecationWarning, FutureWarning):
                    warnings.filterwarnings("ignore", category=category, module=r"(brevitas|torch)(\.|$)")
            yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(previous_level)


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, then restore the previous setting.

    The digits CNN is far too small to profit from intra-op parallelism; on a busy 2-core machine two
    threads made evaluation and calibration 5-20x slower (OpenMP spin-waiting), see
    :func:`quark_brevitas.cli.digits.train_digits_cnn`.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    level = logging.INFO
    if getattr(args, "quiet", False):
        level = logging.WARNING
    elif getattr(args, "verbose", False):
        level = logging.DEBUG

    from quark_brevitas.export import ExportError

    with _logging_setup(level), _torch_threads(1):
        try:
            return int(args.func(args))
        except (QuarkBrevitasError, ExportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
