"""The ``quark-brevitas`` argument parser, built without torch, Brevitas or transformers.

Why a module of its own: ``quark-brevitas --help`` (and every subcommand's ``--help``) should answer at once, so
the parser imports only plain-data modules (the option helpers, the format table
:mod:`quark_brevitas.export.registry`, the topics of :mod:`quark_brevitas.cli.listing`; not even the config
package); each subcommand names its
function as ``"module:function"``, imported when that command runs (``tests/cli/test_cli_help.py`` checks that
``--help`` imports no torch).
"""

from __future__ import annotations

import argparse
from typing import Any

from quark_brevitas.cli.listing import TOPICS
from quark_brevitas.cli.options import (
    DEFAULT_ANALYSIS_OUTPUT,
    DEFAULT_AUTOCONFIG_OUTPUT,
    DEFAULT_MODEL,
    DEFAULT_OUTPUT,
    DEFAULT_TOKEN_SHAPE,
    positive_int,
    shape_option,
)
from quark_brevitas.export.registry import FORMATS, format_names

__all__ = ["build_parser"]


def _format_help(names: list[str]) -> str:
    """``name`` (aliases) per format of the table, in its order."""
    return ", ".join(name + (f" (or {'/'.join(FORMATS[name].aliases)})" if FORMATS[name].aliases else "")
                     for name in names)


def _layout(layout: str) -> list[str]:
    return [row.name for row in FORMATS.values() if row.layout == layout]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Each subcommand's ``func`` is ``"module:function"``, imported by
    :func:`quark_brevitas.cli.main` only when that command runs."""
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
    source.add_argument("--preset", metavar="NAME",
                        help="a named config (default: the one marked default by 'quark-brevitas list presets')")

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
    llm.add_argument("--export", choices=format_names(aliases=True, hf_lm=True), default=None, metavar="FORMAT",
                     help="also write the quantized model in FORMAT into --output/<FORMAT>/: "
                          + _format_help(format_names(hf_lm=True)) + " ('quark-brevitas list formats')")
    llm.add_argument("--no-resume", action="store_true",
                     help="start over even if --output holds an interrupted run of the same job")
    quantize.set_defaults(func="quark_brevitas.cli.quantize:cmd_quantize")

    export = sub.add_parser(
        "export", parents=[verbosity],
        help=f"export a saved checkpoint ({', '.join(format_names())})",
        description="Rebuild a checkpoint written by 'quantize --save-checkpoint', 'quantize --model' (a Hugging "
                    "Face model) or save_quantized and export it; every file is read back and checked before it is "
                    "moved into place: " + "; ".join(f"{row.name} by {row.checked_with}" for row in FORMATS.values()
                                                     if row.checked_with) + ".",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint directory")
    export.add_argument("--format", choices=format_names(aliases=True), default="qcdq", metavar="FORMAT",
                        help=_format_help(format_names()) + "; default qcdq")
    export.add_argument("--output", metavar="PATH", required=True,
                        help="the file to write (" + ", ".join(_layout("file")) + ") or the folder to write ("
                             + ", ".join(_layout("folder")) + ")")
    export.add_argument("--overwrite", action="store_true",
                        help="folder formats: write into --output even if it holds files "
                             "quark_brevitas did not write (only the entries this run writes are replaced)")
    export.add_argument("--input-shape", metavar="SHAPE", type=shape_option, default=None,
                        help="example input shape such as 1,1,8,8 (random values; for a Hugging Face model "
                             "BATCH,SEQUENCE of random token ids; default: the checkpoint's stored example input, "
                             "for a Hugging Face model without one a sentence through its saved tokenizer, else "
                             f"random token ids of shape {','.join(map(str, DEFAULT_TOKEN_SHAPE))})")
    export.add_argument("--model", metavar="MODULE:CALLABLE", default=None,
                        help="callable returning the float architecture (default: the Hugging Face class and "
                             f"config recorded in the checkpoint, else {DEFAULT_MODEL})")
    export.set_defaults(func="quark_brevitas.cli.export:cmd_export")

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
    template.add_argument("--kv-cache-scheme", default=None, choices=("fp8", "int8"),
                          help="quantize the key/value cache too (Quark's get_config(kv_cache_scheme=...))")
    template.add_argument("--attention-scheme", default=None, choices=("fp8", "int8"),
                          help="quantize the query and the attention probabilities too (Quark's "
                               "get_config(attention_scheme=...))")
    plan.set_defaults(func="quark_brevitas.cli.plan:cmd_plan")

    presets = sub.add_parser("presets", parents=[verbosity], help="list the presets")
    presets.set_defaults(func="quark_brevitas.cli.plan:cmd_presets", uses_torch=False)
    _add_analysis_commands(sub, verbosity, config_args)
    _add_list_command(sub, verbosity)

    check = sub.add_parser("check", parents=[verbosity],
                           help="check an exported file against a deployment target's rules (FINN)")
    check.add_argument("--target", choices=("finn",), required=True, help="the target whose rules apply")
    check.add_argument("file", metavar="FILE.onnx", help="a QONNX file (export --format qonnx)")
    check.set_defaults(func="quark_brevitas.cli.check:cmd_check")
    return parser


def _add_analysis_commands(sub: Any, verbosity: argparse.ArgumentParser,
                           config_args: argparse.ArgumentParser) -> None:
    """The ``analyze`` and ``autoconfig`` subcommands. The model options (``--epochs``, ``--seed``) are those of
    the built-in digits CNN; :func:`_analysis_subject` is the one place that builds the model and its data, so a
    ``--model DIR`` (Hugging Face folder) option plugs in there (:mod:`quark_brevitas.cli.analysis`)."""
    subject = argparse.ArgumentParser(add_help=False)
    subject.add_argument("--epochs", type=positive_int, default=15, help="training epochs (default 15)")
    subject.add_argument("--seed", type=int, default=0, help="data split and training seed (default 0)")
    subject.add_argument("--batches", type=positive_int, default=4,
                         help="calibration batches the measurements use (default 4; --exact: all)")
    subject.add_argument("--exact", action="store_true",
                         help="re-run the pipeline for every measurement instead of switching layers off (slower)")

    analyze = sub.add_parser(
        "analyze", parents=[verbosity, config_args, subject],
        help="per-layer error report and sensitivity ranking of a config on the digits CNN",
        description="Train the digits CNN, quantize it, compare it with the float model layer by layer (SQNR of "
                    "weights, inputs, outputs) and rank the layers by sensitivity; prints the tables and writes "
                    "layers.json/.csv/.png and sensitivity.json/.csv/.png.",
    )
    analyze.add_argument("--output", metavar="DIR", default=DEFAULT_ANALYSIS_OUTPUT,
                         help=f"output directory (default {DEFAULT_ANALYSIS_OUTPUT})")
    analyze.add_argument("--no-plots", action="store_true", help="skip the PNG files (no matplotlib needed)")
    analyze.set_defaults(func="quark_brevitas.cli.analysis:cmd_analyze")

    autoconfig = sub.add_parser(
        "autoconfig", parents=[verbosity, subject],
        help="choose a format per layer under a budget and write the config as YAML",
        description="Measure every layer of the digits CNN with every candidate format, choose one per layer under "
                    "the budget (knapsack on the measured output SQNR, refined by quantizing the best proposals "
                    "for real) and write the Config as YAML (for 'quantize --config' and 'plan --config').",
    )
    budget = autoconfig.add_mutually_exclusive_group()
    budget.add_argument("--budget-bits", type=float, metavar="BITS",
                        help="average bits per weight, scales included (uniform W4 per-channel: about 4.1)")
    budget.add_argument("--budget-bytes", type=float, metavar="BYTES", help="model size in bytes")
    autoconfig.add_argument("--min-metric", type=float, metavar="DB",
                            help="smallest assignment whose output SQNR reaches DB (alone or within a budget)")
    autoconfig.add_argument("--candidates", default=None, metavar="NAMES",
                            help="comma-separated candidate formats (default: quark_brevitas.analysis."
                                 "DEFAULT_CANDIDATES; the names: 'quark-brevitas list candidates')")
    autoconfig.add_argument("--refine", type=positive_int, default=4,
                            help="proposals quantized for real to pick the best (default 4)")
    autoconfig.add_argument("--output", metavar="FILE", default=DEFAULT_AUTOCONFIG_OUTPUT,
                            help=f"the YAML config to write (default {DEFAULT_AUTOCONFIG_OUTPUT})")
    autoconfig.set_defaults(func="quark_brevitas.cli.analysis:cmd_autoconfig")


def _add_list_command(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    """``quark-brevitas list TOPIC``: what this install can do, from the tables the code uses."""
    listing = sub.add_parser(
        "list", parents=[verbosity], help="list what this install supports: " + ", ".join(TOPICS),
        description="Print what this install can do, read from the same tables the code uses: "
                    + "; ".join(f"{name}: {text}" for name, text in TOPICS.items()) + ".")
    listing.add_argument("topic", choices=list(TOPICS), metavar="TOPIC", help=", ".join(TOPICS))
    # Listing computes nothing: no intra-op thread setting (which would import torch for 'list formats').
    listing.set_defaults(func="quark_brevitas.cli.listing:cmd_list", uses_torch=False)
