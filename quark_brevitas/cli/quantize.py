"""``quark-brevitas quantize``: the built-in digits CNN quantized, exported, checked in onnxruntime and reported;
or, with ``--model DIR``, a Hugging Face folder quantized block by block (:mod:`quark_brevitas.hf.lm`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from quark_brevitas.api import ModelExporter, ModelQuantizer
from quark_brevitas.cli.options import ONNX_NAME, CLIError, checked_output, claimed, read_text, resolve_config
from quark_brevitas.cli.plan import plan_digits
from quark_brevitas.outputs import output_dir

logger = logging.getLogger("quark_brevitas.cli")


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
    from quark_brevitas.cli.digits import evaluate_predictions
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


def _cmd_quantize_llm(args: argparse.Namespace) -> int:
    if args.calib_text is None:
        raise CLIError("--model needs --calib-text FILE (plain text to calibrate on)")
    if args.save_checkpoint is not None:
        raise CLIError("--save-checkpoint does not apply to --model: --output is the checkpoint")
    if not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"--model {args.model!r} is not a Hugging Face model folder (no config.json)")
    config, source = (None, "default (int4 per-group 128 + GPTQ)")
    if args.config is not None or args.preset is not None:
        config, source = resolve_config(args)
    output = checked_output(args.output, "--output", args.overwrite, sources=[args.model])
    if args.export is not None:
        _refuse_early(args, config)
    with claimed(args.output, "--output"):  # held until the export below is written too
        return _quantize_llm_claimed(args, config, source, output)


def _refuse_early(args: argparse.Namespace, config: Any) -> None:
    """``--export FORMAT``: what the export would refuse at the end (for GGUF the family, a layer's weight layout,
    quantized activations, the tokenizer's fit to the embedding; for the others the layers they cannot hold),
    refused now, before any calibration, by the format's own check (its row of the format table)."""
    from quark_brevitas.export import ExportError
    from quark_brevitas.export.registry import get_format
    from quark_brevitas.hf.lm import default_llm_config
    from quark_brevitas.hf.streaming import load_skeleton

    row = get_format(args.export)
    if row.plan_check is None:
        return
    skeleton, hf_config = load_skeleton(args.model)
    rows = ModelQuantizer(config if config is not None else default_llm_config()).plan(skeleton)
    try:
        row.check_plan(rows, skeleton, hf_config, args.tokenizer if args.tokenizer is not None else args.model)
    except ExportError as exc:
        raise CLIError(f"--export {args.export}: {exc} (refused before quantizing; nothing was written)") from exc


def _quantize_llm_claimed(args: argparse.Namespace, config: Any, source: str, output: Path) -> int:
    from quark_brevitas.hf.lm import quantize_folder

    report = quantize_folder(
        args.model, read_text(args.calib_text, "--calib-text"), output, config=config, config_source=source,
        eval_text=read_text(args.eval_text, "--eval-text") if args.eval_text is not None else None,
        seq_len=args.seq_len, batch_size=args.batch_size, calib_sequences=args.calib_sequences,
        eval_sequences=args.eval_sequences, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
        resume=not args.no_resume, offload=args.offload, overwrite=args.overwrite,
        tokenizer_dir=args.tokenizer)
    rows = report.rows()
    if args.export is not None:
        from quark_brevitas.cli.deploy import write_next_to_checkpoint
        from quark_brevitas.export import ExportError

        start = time.perf_counter()
        try:
            written = write_next_to_checkpoint(args.export, output)
        except ExportError as exc:
            raise CLIError(f"--export {args.export}: {exc} (the checkpoint {str(output)!r} is written; after "
                           f"quantizing it differently, or for another format: quark-brevitas export)") from exc
        rows = [*rows, (f"export ({args.export})", f"{written} ({time.perf_counter() - start:.1f} s)")]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _cmd_quantize_llm(args)
    if args.calib_text is not None:
        raise CLIError("--calib-text needs --model DIR (the digits CNN calibrates on its own data)")
    if args.tokenizer is not None:
        raise CLIError("--tokenizer needs --model DIR (the digits CNN takes images, not text)")
    if args.export is not None:
        raise CLIError("--export needs --model DIR (the digits CNN is always exported to ONNX QCDQ)")
    config, source = resolve_config(args)  # before any work, so a bad config fails fast
    plan_digits(config, args)  # layer names and types too, before training
    output = checked_output(args.output, "--output", args.overwrite)
    if args.save_checkpoint is not None:
        checked_output(args.save_checkpoint, "--save-checkpoint", args.overwrite)
    with contextlib.ExitStack() as claims:  # before training: a busy or unwritable output fails in its first second
        claims.enter_context(claimed(args.output, "--output"))
        if args.save_checkpoint is not None:
            claims.enter_context(claimed(args.save_checkpoint, "--save-checkpoint"))
        return _quantize_digits(args, config, source, output)


def _quantize_digits(args: argparse.Namespace, config: Any, source: str, output: Path) -> int:
    from quark_brevitas.cli.digits import evaluate, example_input, load_digits_data, train_digits_cnn

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


def kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB ({size} bytes)"


def _results_table(r: dict[str, Any]) -> str:
    t = r["timings_s"]
    size = f"{kib(r['onnx_size_bytes'])}, opset {r['onnx_opset']}"
    float_size = "n/a"
    if r["float_onnx_size_bytes"]:
        float_size = f"{kib(r['float_onnx_size_bytes'])}, {r['float_onnx_size_bytes'] / r['onnx_size_bytes']:.1f}x"
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
