"""The ``quark-brevitas`` command line: quantize, export and check the built-in digits CNN.

Subcommands:

- ``quantize``: train the digits CNN (seconds), quantize it with a preset or a config file, export
  it to ONNX QCDQ, run the file in onnxruntime on the test set and print a results table; the
  numbers also go to ``OUTPUT/report.json`` and the config used to ``OUTPUT/config.json``;
  ``--save-checkpoint DIR`` also saves the quantized model (see :mod:`quark_brevitas.checkpoint`).
  With ``--model DIR --calib-text FILE``: quantize a Hugging Face folder (a causal LM or an encoder)
  into the checkpoint ``OUTPUT`` instead, block by block when it is made of blocks, and report
  perplexity (or embedding cosine) before and after on held-out text (:mod:`quark_brevitas.hf.lm`).
- ``export``: rebuild a saved checkpoint and export it to ONNX QCDQ or QONNX, verified against the
  rebuilt PyTorch model.
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
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quark_brevitas.api import ModelExporter, ModelQuantizer
from quark_brevitas.config import Config
from quark_brevitas.errors import ConfigError, QuarkBrevitasError
from quark_brevitas.extras import available, install_hint
from quark_brevitas.outputs import OutputError, check_output_dir, output_dir
from quark_brevitas.presets import DEFAULT_PRESET, DESCRIPTIONS, PRESETS, get_preset

__all__ = ["main"]

logger = logging.getLogger("quark_brevitas.cli")

DEFAULT_OUTPUT = "quark_brevitas_output"
DEFAULT_MODEL = "quark_brevitas.digits:DigitsCNN"
#: (batch, sequence) of the example input made for a Hugging Face checkpoint that stores none.
DEFAULT_TOKEN_SHAPE = (1, 16)
#: What a Hugging Face checkpoint's saved tokenizer turns into that example input.
EXAMPLE_TEXT = "The quick brown fox jumps over the lazy dog while seven small cats sleep near the warm red house."
EXPORT_FORMATS = ("qcdq", "qonnx")
ONNX_NAME = "digits_quant.onnx"


class CLIError(QuarkBrevitasError):
    """A command-line argument cannot be honoured (reported like any other user error)."""


# ===================================================================== argument parsing
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,1,8,8, got {text!r}")\
            from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,1,8,8, got {text!r}")
    return dims


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
    quantize.add_argument("--epochs", type=_positive_int, default=15, help="training epochs (default 15)")
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
    llm.add_argument("--seq-len", type=_positive_int, default=128, help="tokens per sequence (default 128)")
    llm.add_argument("--batch-size", type=_positive_int, default=4, help="sequences per batch (default 4)")
    llm.add_argument("--calib-sequences", type=_positive_int, default=128,
                     help="calibration sequences (default 128)")
    llm.add_argument("--eval-sequences", type=_positive_int, default=32, help="evaluation sequences (default 32)")
    llm.add_argument("--prompt", default=None, help="also generate a continuation of this prompt (causal LMs)")
    llm.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens to generate (default 32)")
    llm.add_argument("--offload", choices=("disk",), default=None,
                     help="keep cached activations on disk instead of in memory")
    llm.add_argument("--no-resume", action="store_true",
                     help="start over even if --output holds an interrupted run of the same job")
    quantize.set_defaults(func=_cmd_quantize)

    export = sub.add_parser(
        "export", parents=[verbosity],
        help="export a saved checkpoint to ONNX QCDQ or QONNX",
        description="Rebuild a checkpoint written by 'quantize --save-checkpoint', 'quantize --model' (a Hugging "
                    "Face model) or save_quantized and export it; the file is checked against the rebuilt PyTorch "
                    "model (onnxruntime for QCDQ, qonnx for QONNX).",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint directory")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="qcdq", help="qcdq (default) or qonnx")
    export.add_argument("--output", metavar="FILE", required=True, help="the .onnx file to write")
    export.add_argument("--input-shape", metavar="SHAPE", type=_shape, default=None,
                        help="example input shape such as 1,1,8,8 (random values; for a Hugging Face model "
                             "BATCH,SEQUENCE of random token ids; default: the checkpoint's stored example input, "
                             "for a Hugging Face model without one a sentence through its saved tokenizer, else "
                             f"random token ids of shape {','.join(map(str, DEFAULT_TOKEN_SHAPE))})")
    export.add_argument("--model", metavar="MODULE:CALLABLE", default=None,
                        help="callable returning the float architecture (default: the Hugging Face class and "
                             f"config recorded in the checkpoint, else {DEFAULT_MODEL})")
    export.set_defaults(func=_cmd_export)

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
                          help="an algorithm (awq, gptq, smoothquant); repeat it for several, applied in that order")
    plan.set_defaults(func=_cmd_plan)

    presets = sub.add_parser("presets", parents=[verbosity], help="list the presets")
    presets.set_defaults(func=_cmd_presets)
    _add_analysis_commands(sub, verbosity, config_args)
    return parser


def _plan_digits(config: Config, args: argparse.Namespace) -> list[Any]:
    """The plan of the digits CNN; errors about the config (a layer name that matches nothing, ...)
    name the config file they come from."""
    from quark_brevitas.digits import DigitsCNN

    try:
        return ModelQuantizer(config).plan(DigitsCNN())
    except ConfigError as exc:
        if args.config is None or str(args.config) in str(exc):
            raise
        raise CLIError(f"{args.config}: {exc}") from exc


def _resolve_config(args: argparse.Namespace) -> tuple[Config, str]:
    """The Config asked for (file, preset or the default preset) and a label for it."""
    if args.config is not None:
        try:
            return Config.from_file(args.config), f"file {args.config}"
        except ConfigError as exc:
            if str(args.config) in str(exc):
                raise
            raise CLIError(f"{args.config}: {exc}") from exc
    name = args.preset if args.preset is not None else DEFAULT_PRESET
    return get_preset(name), f"preset {name}"


# ===================================================================== quantize
def _onnx_size_of_float_model(model: nn.Module, example: torch.Tensor) -> int | None:
    """Size in bytes of the float model as a plain ONNX file (for comparison); None if it fails."""
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(tmp) / "float.onnx"
            torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=13,
                              input_names=["input"], output_names=["output"])
            return path.stat().st_size
    except Exception as exc:  # noqa: BLE001 - the comparison is optional; say why it is missing
        logger.warning("float ONNX export for the size comparison failed (%s: %s)", type(exc).__name__, exc)
        return None


def _check_onnx(path: Path, quant_model: nn.Module, loader: Any) -> tuple[float, float, int]:
    """onnxruntime accuracy of the exported file and its top-1 agreement (%) with the PyTorch model."""
    from quark_brevitas.digits import evaluate_predictions
    from quark_brevitas.export import create_ort_session, run_onnx

    session = create_ort_session(path)
    counts = {"agree": 0, "total": 0}

    def predict(images: np.ndarray) -> np.ndarray:
        logits = run_onnx(session, images)[0]
        with torch.no_grad():
            reference = quant_model(torch.from_numpy(images)).argmax(dim=1).numpy()
        counts["agree"] += int((logits.argmax(axis=1) == reference).sum())
        counts["total"] += int(reference.shape[0])
        return logits

    quant_model.eval()
    accuracy = evaluate_predictions(predict, loader)
    return accuracy, 100.0 * counts["agree"] / counts["total"], counts["total"]


def _read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"{option} {path!r}: cannot read it as UTF-8 text ({exc})") from exc


def _cmd_quantize_llm(args: argparse.Namespace) -> int:
    from quark_brevitas.hf.lm import quantize_folder

    if args.calib_text is None:
        raise CLIError("--model needs --calib-text FILE (plain text to calibrate on)")
    if args.save_checkpoint is not None:
        raise CLIError("--save-checkpoint does not apply to --model: --output is the checkpoint")
    if not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"--model {args.model!r} is not a Hugging Face model folder (no config.json)")
    config, source = (None, "default (int4 per-group 128 + GPTQ)")
    if args.config is not None or args.preset is not None:
        config, source = _resolve_config(args)
    output = _checked_output(args.output, "--output", args.overwrite, sources=[args.model])
    report = quantize_folder(
        args.model, _read_text(args.calib_text, "--calib-text"), output, config=config, config_source=source,
        eval_text=_read_text(args.eval_text, "--eval-text") if args.eval_text is not None else None,
        seq_len=args.seq_len, batch_size=args.batch_size, calib_sequences=args.calib_sequences,
        eval_sequences=args.eval_sequences, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
        resume=not args.no_resume, offload=args.offload, overwrite=args.overwrite,
        tokenizer_dir=args.tokenizer)
    rows = report.rows()
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _cmd_quantize_llm(args)
    if args.calib_text is not None:
        raise CLIError("--calib-text needs --model DIR (the digits CNN calibrates on its own data)")
    if args.tokenizer is not None:
        raise CLIError("--tokenizer needs --model DIR (the digits CNN takes images, not text)")
    from quark_brevitas.digits import evaluate, example_input, load_digits_data, train_digits_cnn

    config, source = _resolve_config(args)  # before any work, so a bad config fails fast
    _plan_digits(config, args)  # layer names and types too, before training
    output = _checked_output(args.output, "--output", args.overwrite)
    if args.save_checkpoint is not None:
        _checked_output(args.save_checkpoint, "--save-checkpoint", args.overwrite)
    logger.info("Config: %s", source)

    start = time.perf_counter()
    data = load_digits_data(seed=args.seed)
    model = train_digits_cnn(data, epochs=args.epochs, seed=args.seed)
    train_s = time.perf_counter() - start
    float_acc = evaluate(model, data.test)
    logger.info("Float accuracy: %.2f %%", float_acc)

    start = time.perf_counter()
    quant_model = ModelQuantizer(config).quantize_model(model, data.calib)
    quantize_s = time.perf_counter() - start
    quant_acc = evaluate(quant_model, data.test)
    logger.info("Quantized accuracy (PyTorch): %.2f %%", quant_acc)

    with output_dir(output, overwrite=args.overwrite) as work:  # moved into place once everything is written
        exported = _export_digits(work, quant_model, model, data, example_input(data))
        timings = {"train": train_s, "quantize": quantize_s, **exported.pop("timings_s")}
        report = {"config_source": source, "epochs": args.epochs, "seed": args.seed,
                  "test_images": exported.pop("test_images"), "float_accuracy": float_acc,
                  "quant_accuracy_pytorch": quant_acc, **exported, "onnx_path": str(output / ONNX_NAME),
                  "timings_s": timings}
        (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (work / "config.json").write_text(config.to_json() + "\n")
    logger.info("Wrote %s, %s and %s", output / ONNX_NAME, output / "report.json", output / "config.json")
    if args.save_checkpoint is not None:
        from quark_brevitas.checkpoint import save_quantized

        save_quantized(quant_model, args.save_checkpoint, example_input=example_input(data), overwrite=args.overwrite)
        logger.info("Saved checkpoint %s", args.save_checkpoint)
    print(_results_table(report))
    return 0


def _checked_output(path: str, option: str, overwrite: bool, sources: Sequence[str] = ()) -> Path:
    """``path`` if the run may write there (see :func:`quark_brevitas.outputs.check_output_dir`), checked before
    any work; the error names the command-line option."""
    try:
        return check_output_dir(path, overwrite=overwrite, sources=sources)
    except OutputError as exc:
        raise CLIError(f"{option}: {exc}") from exc


def _export_digits(work: Path, quant_model: nn.Module, model: nn.Module, data: Any,
                   example: torch.Tensor) -> dict[str, Any]:
    """Export the quantized digits CNN into ``work``, check it in onnxruntime and return the report's values
    about the file."""
    onnx_path = work / ONNX_NAME
    start = time.perf_counter()
    export = ModelExporter(onnx_path).export_onnx_model(quant_model, example)
    export_s = time.perf_counter() - start

    start = time.perf_counter()
    ort_acc, agreement, n_test = _check_onnx(onnx_path, quant_model, data.test)
    evaluate_s = time.perf_counter() - start
    logger.info("Quantized accuracy (onnxruntime): %.2f %%; agreement with PyTorch %.2f %%", ort_acc, agreement)
    float_size = _onnx_size_of_float_model(model, example)

    return {
        "test_images": n_test,
        "quant_accuracy_onnxruntime": ort_acc,
        "agreement_onnxruntime_pytorch": agreement,
        "onnx_opset": export.opset,
        "onnx_size_bytes": export.file_size,
        "float_onnx_size_bytes": float_size,
        "export_max_abs_diff": export.max_abs_diff,
        "export_tolerance": export.tolerance,
        "timings_s": {"export": export_s, "evaluate_onnx": evaluate_s},
    }


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB ({size} bytes)"


def _results_table(r: dict[str, Any]) -> str:
    t = r["timings_s"]
    size = f"{_kib(r['onnx_size_bytes'])}, opset {r['onnx_opset']}"
    float_size = "n/a"
    if r["float_onnx_size_bytes"]:
        float_size = f"{_kib(r['float_onnx_size_bytes'])}, {r['float_onnx_size_bytes'] / r['onnx_size_bytes']:.1f}x"
    rows = [
        ("config", r["config_source"]),
        ("float accuracy (PyTorch)", f"{r['float_accuracy']:6.2f} %"),
        ("quantized accuracy (PyTorch)", f"{r['quant_accuracy_pytorch']:6.2f} %"),
        ("quantized accuracy (onnxruntime)", f"{r['quant_accuracy_onnxruntime']:6.2f} %"),
        ("agreement onnxruntime vs PyTorch", f"{r['agreement_onnxruntime_pytorch']:6.2f} %"
                                             f"  ({r['test_images']} test images)"),
        ("max |onnxruntime - PyTorch| logit",
         f"{r['export_max_abs_diff']:.2e} (tolerance {r['export_tolerance']:.2e})"),
        ("ONNX file", r["onnx_path"]),
        ("ONNX size (QCDQ)", size),
        ("float ONNX size", float_size),
        ("time: train / quantize / export", f"{t['train']:.1f} s / {t['quantize']:.1f} s / {t['export']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    lines = [rule, *(f"{name:<{width}}  {value}" for name, value in rows), rule]
    return "\n".join(lines)


# ===================================================================== export
def _float_model(spec: str) -> nn.Module:
    """Call ``MODULE:CALLABLE`` (e.g. ``quark_brevitas.digits:DigitsCNN``) for the float architecture."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CLIError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. {DEFAULT_MODEL}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module (ImportError, SyntaxError, ...)
        raise CLIError(f"--model {spec!r}: cannot import it ({type(exc).__name__}: {_first_line(exc)})") from exc
    if not callable(factory):
        raise CLIError(f"--model {spec!r} is a {type(factory).__name__}, not a callable returning the float model")
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failed; say so in one line
        raise CLIError(f"--model {spec!r}: calling it failed ({type(exc).__name__}: {_first_line(exc)}); it must "
                       "build the float architecture without arguments") from exc
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def _check_example(model: nn.Module, example: Any, source: str, where: str) -> None:
    """A one-line error for an example input the model rejects (a wrong --input-shape)."""
    if isinstance(example, dict):
        inputs: tuple = tuple(example.values())
        call = lambda: model(**example)  # noqa: E731
    else:
        inputs = tuple(example) if isinstance(example, tuple | list) else (example,)
        call = lambda: model(*inputs)  # noqa: E731
    try:
        with torch.no_grad():
            call()
    except Exception as exc:  # noqa: BLE001 - any failure means the input does not fit the model
        shapes = ", ".join(str(list(t.shape)) for t in inputs)
        described = source if "shape" in source else f"{source}, shape {shapes}"
        hint = "; pass the shape the model takes" if where == "--input-shape" else ""
        raise CLIError(f"{where}: the model rejects the example input ({described}): "
                       f"{type(exc).__name__}: {_first_line(exc)}{hint}") from exc


def _checkpoint_model(args: argparse.Namespace, info: Any) -> tuple[nn.Module, str]:
    """The quantized model of the checkpoint and where its architecture came from: ``--model``, else a Hugging
    Face checkpoint's recorded architecture (the class and config in the manifest, or ``float_model/`` of one
    written block by block by ``quantize --model``), else the digits CNN."""
    from quark_brevitas.checkpoint import load_quantized
    from quark_brevitas.export.hf import float_model_from_record
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR, load_pretrained_quantized

    record = info.manifest.get("huggingface")
    if args.model is not None:
        return load_quantized(_float_model(args.model), args.checkpoint), args.model
    if isinstance(info.manifest.get("block_stack"), str):
        model = load_pretrained_quantized(info.directory)
        return model, f"{type(model).__name__} from the checkpoint's {FLOAT_MODEL_DIR}/config.json"
    if record:
        model = load_quantized(float_model_from_record(record), args.checkpoint)
        return model, f"{record['class'].rsplit('.', 1)[-1]} from the checkpoint's config"
    return load_quantized(_float_model(DEFAULT_MODEL), args.checkpoint), DEFAULT_MODEL


def _tokenizer_example(directory: Path) -> tuple[dict[str, torch.Tensor], str] | None:
    """:data:`EXAMPLE_TEXT` through the tokenizer saved with a Hugging Face checkpoint (``float_model/`` or the
    checkpoint folder itself), at most :data:`DEFAULT_TOKEN_SHAPE` tokens; ``None`` if it saved none."""
    from quark_brevitas.hf.lm import TOKENIZER_FILES, load_tokenizer
    from quark_brevitas.hf.streaming import FLOAT_MODEL_DIR

    for folder in (directory / FLOAT_MODEL_DIR, directory):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            tokenizer = load_tokenizer(folder)
            encoded = tokenizer(EXAMPLE_TEXT, return_tensors="pt", truncation=True,
                                max_length=DEFAULT_TOKEN_SHAPE[1])
            example = {key: value for key, value in encoded.items() if isinstance(value, torch.Tensor)}
            shape = list(example["input_ids"].shape)
            return example, f"a sentence through the tokenizer in {folder}, shape {shape}"
    return None


def _export_example(args: argparse.Namespace, info: Any, model: nn.Module) -> tuple[Any, str]:
    """The example input the export is traced and verified with, and a label for it: ``--input-shape``
    (random values, or random token ids for a model with a vocabulary), else the checkpoint's stored one,
    else for a Hugging Face language model a tokenized sentence or random token ids of
    :data:`DEFAULT_TOKEN_SHAPE` with a full attention mask."""
    from quark_brevitas.export.hf import token_example

    if args.input_shape is not None:
        tokens = token_example(model, args.input_shape)
        if tokens is not None:
            return tokens, f"random token ids, shape {list(args.input_shape)}"
        return (torch.randn(args.input_shape, generator=torch.Generator().manual_seed(0)),
                f"random, shape {list(args.input_shape)}")
    if info.example_input is not None:
        return info.example_input, "stored in the checkpoint"
    tokens = token_example(model, DEFAULT_TOKEN_SHAPE)
    if tokens is not None:
        return _tokenizer_example(info.directory) or \
            (tokens, f"random token ids, shape {list(DEFAULT_TOKEN_SHAPE)}, full attention mask")
    raise CLIError(f"checkpoint {args.checkpoint!r} stores no example input; pass --input-shape")


def _cmd_export(args: argparse.Namespace) -> int:
    from quark_brevitas.checkpoint import read_checkpoint

    info = read_checkpoint(args.checkpoint)
    model, model_source = _checkpoint_model(args, info)
    example, example_source = _export_example(args, info, model)
    where = "--input-shape" if args.input_shape is not None else f"checkpoint {args.checkpoint!r}"
    _check_example(model, example, example_source, where)
    exporter = ModelExporter(args.output)
    start = time.perf_counter()
    if args.format == "qonnx":
        report = exporter.export_qonnx_model(model, example)
        label, checker = "QONNX", "qonnx"
    else:
        report = exporter.export_onnx_model(model, example)
        label, checker = "ONNX QCDQ", "onnxruntime"
    rows = [
        ("checkpoint", str(args.checkpoint)),
        ("model", model_source),
        ("format", f"{label}, opset {report.opset}"),
        ("file", f"{report.path}, {_kib(report.file_size)}"),
        ("example input", example_source),
        (f"max |{checker} - PyTorch|", f"{report.max_abs_diff:.2e} (tolerance {report.tolerance:.2e}"
                                        + ("" if getattr(report, "verified_by", "outputs") == "outputs" else
                                           "; rounding flips, every quantizer verified pinned") + ")"),
        ("time", f"{time.perf_counter() - start:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


# ===================================================================== plan / presets
def _plan_model(args: argparse.Namespace) -> int:
    """``plan --model DIR``: the plan of a Hugging Face folder's model, built on the meta device (no weights
    read), with the block stack that ``quantize --model`` walks and what the algorithms infer in it."""
    from quark_brevitas.algorithms import describe_algorithms
    from quark_brevitas.backend import plan_table
    from quark_brevitas.blocks.stack import detect_block_stack as find_block_stack
    from quark_brevitas.hf.lm import default_llm_config
    from quark_brevitas.hf.streaming import load_skeleton

    if not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"--model {args.model!r} is not a Hugging Face model folder (no config.json)")
    config, source = default_llm_config(), "default (int4 per-group 128 + GPTQ)"
    if args.template is not None:
        config, source = _template_config(args)
    elif args.config is not None or args.preset is not None:
        config, source = _resolve_config(args)
    skeleton, _ = load_skeleton(args.model)
    try:
        rows = ModelQuantizer(config).plan(skeleton)
    except ConfigError as exc:
        raise CLIError(f"{args.config or source}: {exc}") from exc
    stack = find_block_stack(skeleton)
    blocks = f"{len(skeleton.get_submodule(stack))} blocks in {stack}" if stack else "none (quantized in memory)"
    pre = ", ".join(type(a).__name__ for a in config.pre_quant_opt_config) or "-"
    post = ", ".join(type(a).__name__ for a in config.algo_config) or "-"
    print(f"{type(skeleton).__name__} plan ({args.model}; {source}; pre-quant: {pre}; algorithms: {post})")
    print(f"block stack: {blocks}")
    print(plan_table(rows))
    print("\n" + "\n".join(run_order_lines(config)))
    described = describe_algorithms(config, skeleton)
    if described:
        print("\n" + "\n".join(described))
    return 0


def _template_config(args: argparse.Namespace) -> tuple[Config, str]:
    """``plan --template T --scheme S [--algorithm A ...]``: the Config Quark 0.13's ``LLMTemplate.get(T)
    .get_config(scheme=S, algorithm=[A, ...])`` gives, and a label saying what the template chose."""
    from quark_brevitas.config import LLMTemplate

    if args.config is not None or args.preset is not None:
        raise CLIError("--template builds the config; leave out --config and --preset")
    if args.scheme is None:
        raise CLIError(f"--template needs --scheme; supported: {', '.join(LLMTemplate.get_supported_schemes())}")
    try:
        template = LLMTemplate.get(args.template)
        config = template.get_config(scheme=args.scheme, algorithm=args.algorithm)
    except ConfigError as exc:
        raise CLIError(f"--template {args.template}: {exc}") from exc
    chosen = LLMTemplate.get_scheme(args.scheme)
    return config, (f"template {args.template}, scheme {args.scheme} ({chosen.description}), exclude "
                    f"{', '.join(config.exclude) or '-'}")


def _print_template(config: Config, source: str, model_type: str) -> int:
    """Without a model: what the template chose, spec by spec and algorithm by algorithm, in order."""
    from quark_brevitas.config import LLMTemplate

    print(source)
    for role in ("weight", "input_tensors"):
        spec = getattr(config.global_quant_config, role)
        print(f"  {role}: {spec.short() if spec is not None else 'float'}")
    for pattern, layer in config.layer_quant_config.items():
        print(f"  {pattern}: weight {layer.weight.short() if layer.weight else 'float'}")
    print("\n".join(run_order_lines(config)))
    print("\n".join(LLMTemplate.get(model_type).describe()))
    return 0


def run_order_lines(config: Config) -> list[str]:
    """What ``plan`` says about the algorithms: each with its place in the config, in the order they run and
    when (an ``algo_config`` entry that transforms the float weights runs before quantization, as written)."""
    pre = {id(a) for a in config.pre_quant_algorithms()}
    lines = ["algorithms, in the order they run:"]
    for number, (where, algo) in enumerate(config.run_order(), start=1):
        when = "before quantization, on the float model" if id(algo) in pre else "after quantization and calibration"
        lines.append(f"  {number}. {where} {type(algo).__name__} ({when})")
    return lines if len(lines) > 1 else ["algorithms: none"]


def _cmd_plan(args: argparse.Namespace) -> int:
    from quark_brevitas.algorithms import describe_algorithms
    from quark_brevitas.backend import plan_table

    if args.model is not None:
        return _plan_model(args)
    if args.template is not None:
        return _print_template(*_template_config(args), args.template)
    if args.scheme is not None or args.algorithm is not None:
        raise CLIError("--scheme and --algorithm are the template's; give --template too")
    config, source = _resolve_config(args)
    rows = _plan_digits(config, args)
    pre = ", ".join(type(a).__name__ for a in config.pre_quant_opt_config) or "-"
    post = ", ".join(type(a).__name__ for a in config.algo_config) or "-"
    print(f"DigitsCNN plan ({source}; pre-quant: {pre}; algorithms: {post})")
    print(plan_table(rows))
    print("\n" + "\n".join(run_order_lines(config)))
    from quark_brevitas.digits import DigitsCNN

    described = describe_algorithms(config, DigitsCNN())  # what the algorithms work on (inferred structure)
    if described:
        print("\n" + "\n".join(described))
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    width = max(len(name) for name in PRESETS)
    for name in PRESETS:
        print(f"{name:<{width}}  {DESCRIPTIONS[name]}")
    return 0


# ===================================================================== analyze / autoconfig
DEFAULT_ANALYSIS_OUTPUT = "quark_brevitas_analysis"
DEFAULT_AUTOCONFIG_OUTPUT = "quark_brevitas_autoconfig.yaml"


def _add_analysis_commands(sub: Any, verbosity: argparse.ArgumentParser,
                           config_args: argparse.ArgumentParser) -> None:
    """The ``analyze`` and ``autoconfig`` subcommands. The model options (``--epochs``, ``--seed``) are those of
    the built-in digits CNN; :func:`_analysis_subject` is the one place that builds the model and its data, so a
    ``--model DIR`` (Hugging Face folder) option plugs in there."""
    from quark_brevitas.analysis import DEFAULT_CANDIDATES

    subject = argparse.ArgumentParser(add_help=False)
    subject.add_argument("--epochs", type=_positive_int, default=15, help="training epochs (default 15)")
    subject.add_argument("--seed", type=int, default=0, help="data split and training seed (default 0)")
    subject.add_argument("--batches", type=_positive_int, default=4,
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
    analyze.set_defaults(func=_cmd_analyze)

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
    autoconfig.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES), metavar="NAMES",
                            help=f"comma-separated candidate formats (default {','.join(DEFAULT_CANDIDATES)})")
    autoconfig.add_argument("--refine", type=_positive_int, default=4,
                            help="proposals quantized for real to pick the best (default 4)")
    autoconfig.add_argument("--output", metavar="FILE", default=DEFAULT_AUTOCONFIG_OUTPUT,
                            help=f"the YAML config to write (default {DEFAULT_AUTOCONFIG_OUTPUT})")
    autoconfig.set_defaults(func=_cmd_autoconfig)


@dataclass(frozen=True)
class _Subject:
    """What the analysis commands work on: a float model, calibration batches, a test metric and their label."""

    model: nn.Module
    calib: Any
    evaluate: Any
    label: str


def _analysis_subject(args: argparse.Namespace) -> _Subject:
    """The built-in digits CNN, trained now, with its calibration batches and test accuracy."""
    from quark_brevitas.digits import evaluate, load_digits_data, train_digits_cnn

    data = load_digits_data(seed=args.seed)
    model = train_digits_cnn(data, epochs=args.epochs, seed=args.seed)
    return _Subject(model, data.calib, lambda m: evaluate(m, data.test), "digits CNN")


def _cmd_analyze(args: argparse.Namespace) -> int:
    from quark_brevitas import analysis

    config, source = _resolve_config(args)
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise CLIError(f"--output {str(output)!r} exists and is not a directory")
    subject = _analysis_subject(args)
    ModelQuantizer(config).plan(subject.model)
    quant = ModelQuantizer(config).quantize_model(subject.model, subject.calib)
    layers = analysis.compare_layers(subject.model, quant, subject.calib, max_batches=args.batches)
    ranking = analysis.sensitivity(subject.model, config, subject.calib, exact=args.exact,
                                   max_batches=None if args.exact else args.batches)
    written = [*analysis.write_rows(layers, output, "layers"), *analysis.write_rows(ranking, output, "sensitivity")]
    if not args.no_plots and not available("matplotlib"):
        # The tables and files are the result; the pictures are optional and need an extra.
        logger.warning("plots skipped: they need matplotlib, which is not installed; install it with %s (or pass "
                       "--no-plots)", install_hint("matplotlib"))
    elif not args.no_plots:
        written.append(analysis.plot_layer_sqnr(layers, output / "layers.png",
                                                title=f"{subject.label}, {source}: error per layer"))
        written.append(analysis.plot_sensitivity(ranking, output / "sensitivity.png",
                                                 title=f"{subject.label}, {source}: sensitivity per layer"))
    print(f"{subject.label}, {source}: float accuracy {subject.evaluate(subject.model):.2f} %, quantized "
          f"{subject.evaluate(quant):.2f} %\n")
    print(analysis.layer_table(layers), end="\n\n")
    print(analysis.sensitivity_table(ranking), end="\n\n")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def _candidates(text: str) -> list[Any]:
    from quark_brevitas.analysis import CANDIDATES

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CANDIDATES]
    if unknown or not names:
        raise CLIError(f"--candidates: unknown {unknown or 'empty list'}; allowed: {', '.join(CANDIDATES)}")
    return [CANDIDATES[name] for name in names]


def _cmd_autoconfig(args: argparse.Namespace) -> int:
    from quark_brevitas import analysis
    from quark_brevitas.backend import plan_table

    if args.budget_bits is None and args.budget_bytes is None and args.min_metric is None:
        raise CLIError("give a budget: --budget-bits, --budget-bytes or --min-metric")
    candidates = _candidates(args.candidates)
    output = Path(args.output)
    if output.is_dir():
        raise CLIError(f"--output {str(output)!r} is a directory; give a .yaml file name")
    subject = _analysis_subject(args)
    search = analysis.search_mixed_precision(
        subject.model, candidates, subject.calib, budget_bits=args.budget_bits, budget_bytes=args.budget_bytes,
        min_metric=args.min_metric, exact=args.exact, max_batches=None if args.exact else args.batches,
        refine=args.refine)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(search.config.to_yaml())
    quant = ModelQuantizer(search.config).quantize_model(subject.model, subject.calib)
    size = analysis.model_size(subject.model, search.config)
    print(f"{subject.label}: one format per layer from {args.candidates}")
    print(analysis.format_table(search.rows(), [("name", "layer"), ("module_type", "type"), ("candidate", "format"),
                                                ("average_weight_bits", "weight bits"),
                                                ("alone_sqnr_db", "output SQNR alone (dB)")]))
    print(f"\naverage weight bits {size.average_weight_bits:.3f}, model size {size.total_bytes:.0f} bytes; "
          f"{search.metric_name} {search.metric:.2f} (measured on {len(search.tried)} proposals)")
    print(f"test accuracy: float {subject.evaluate(subject.model):.2f} %, this config {subject.evaluate(quant):.2f} %")
    print(f"\n{plan_table(ModelQuantizer(search.config).plan(subject.model))}\n")
    print(f"wrote {output} (run it: quark-brevitas quantize --config {output})")
    return 0


# ===================================================================== entry point
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
    :func:`quark_brevitas.digits.train_digits_cnn`.
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
