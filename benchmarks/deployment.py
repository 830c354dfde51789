"""Deployment in onnxruntime: latency and file size of our int8 export vs float vs onnxruntime's own quantizer.

Run: ``python -m benchmarks.deployment`` (about 1-2 minutes on 2 CPU cores). For each model it writes

* the float model (``torch.onnx.export``),
* our W8A8 export (``quark_brevitas``: int8 per-channel weights, int8 per-tensor activations, int32 bias;
  ``export_onnx_qcdq`` verifies it against PyTorch while writing it),
* the same export without the integer-kernel rewrites (``integer_kernels=False``: the graph as Brevitas
  writes it, i.e. before issue 5),
* onnxruntime's ``quantize_static`` output of the float file (QDQ, per-channel int8 weights, calibrated on
  the same batches), once with its default uint8 activations and once with int8 activations,

then measures onnxruntime CPU latency of each file -- sessions with ``intra_op_num_threads`` 1 and 2
(``inter_op_num_threads`` 1, otherwise onnxruntime's defaults), warm-up runs, the files taking turns in
10 interleaved blocks of at least 0.1 s so that machine noise hits all of them alike, median of all runs
(at least ``--runs``) -- and prints sizes and ratios.

Targets (issue 5): our int8 file about a quarter of the float file; our speed-up over float at least 0.9
of the speed-up of onnxruntime's quantizer (the better of its uint8 and int8 activation variants).

Models: an MLP (4 x Linear(1024, 1024) with ReLU, batch 32), the digits CNN (batch 64) and a 2-layer
transformer encoder (d_model 128, 4 heads, feed-forward 256, input (8, 32, 128)). ``nn.TransformerEncoder``
itself cannot be quantized: its layers read ``self_attn.in_proj_bias`` and pass ``is_causal=`` to
``self_attn``, which Brevitas' ``QuantMultiheadAttention`` does not have / accept (the benchmark prints the
error). The encoder used here is the same post-norm architecture written out with ``nn.MultiheadAttention``,
``nn.LayerNorm`` and ``nn.Linear`` (what ``nn.TransformerEncoderLayer`` computes in eval mode); its
MultiheadAttention does become a ``QuantMultiheadAttention`` and exports.
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from torch import nn

from benchmarks.models import EncoderLayer
from benchmarks.tables import format_table
from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.cli.digits import load_digits_data, train_digits_cnn
from quark_brevitas.export import export_onnx_qcdq
from quark_brevitas.types import QSchemeType

W8A8 = Config(
    global_quant_config=QLayerConfig(
        weight=QTensorConfig(qscheme=QSchemeType.per_channel),
        input_tensors=QTensorConfig(),
        bias=QTensorConfig(bit_width=32),
    )
)
FLOAT_OPSET = 17  # scaled_dot_product_attention needs >= 14; LayerNormalization is an op from 17
TARGET = 0.9
PLAIN = "int8, Brevitas graph as is"
BLOCK_SECONDS = 0.1
INTEGER_KERNELS = ("QGemm", "QLinear", "MatMulInteger", "ConvInteger", "Nhwc", "DynamicQuantize", "MatMulNBits")
FLOAT_KERNELS = ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "ConvTranspose")


# ------------------------------------------------------------------------------------------- models


class Encoder(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class Case:
    name: str
    model: nn.Module
    calib: list[torch.Tensor]
    example: torch.Tensor
    note: str = ""


def mlp_case() -> Case:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(nn.Linear(1024, 1024))
        if i < 3:
            layers.append(nn.ReLU())
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(32, 1024, generator=gen) for _ in range(8)]
    return Case("MLP 4x1024, batch 32", nn.Sequential(*layers).eval(), calib, calib[0])


def digits_case() -> Case:
    data = load_digits_data()
    model = train_digits_cnn(data)
    calib = [images for images, _ in data.calib]
    example = next(iter(data.test))[0]  # 64 test images
    return Case("digits CNN, batch 64", model, calib, example)


def encoder_case() -> Case:
    note = ""
    torch.manual_seed(0)
    reference = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True), num_layers=2
    ).eval()
    try:
        ModelQuantizer(W8A8).quantize_model(reference, [torch.randn(2, 32, 128)])
    except Exception as exc:  # noqa: BLE001 - reported, then the equivalent encoder is used
        note = f"nn.TransformerEncoder cannot be quantized ({type(exc).__name__}: {str(exc)[:160]})"
    torch.manual_seed(0)
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 32, 128, generator=gen) for _ in range(8)]
    return Case("transformer encoder 2x128, (8, 32, 128)", model, calib, calib[0], note)


CASES: dict[str, Callable[[], Case]] = {"mlp": mlp_case, "digits": digits_case, "encoder": encoder_case}


# ------------------------------------------------------------------------------------------- files


class _Batches(CalibrationDataReader):
    def __init__(self, name: str, batches: Sequence[torch.Tensor]) -> None:
        self._feeds = iter([{name: b.numpy()} for b in batches])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def write_files(case: Case, out: pathlib.Path) -> tuple[dict[str, pathlib.Path], str]:
    """Float, ours and onnxruntime's quantize_static files; returns them and our export's summary."""
    files = {"float": out / "float.onnx", "int8 (ours)": out / "ours.onnx"}
    torch.onnx.export(
        case.model,
        (case.example,),
        str(files["float"]),
        dynamo=False,
        opset_version=FLOAT_OPSET,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}},
    )
    quant = ModelQuantizer(W8A8).quantize_model(case.model, case.calib)
    report = export_onnx_qcdq(quant, case.example, files["int8 (ours)"])
    files[PLAIN] = out / "ours_plain.onnx"
    export_onnx_qcdq(quant, case.example, files[PLAIN], integer_kernels=False)
    summary = f"max |ORT - PyTorch| {report.max_abs_diff:.3g} <= {report.tolerance:.3g}, opset {report.opset}"
    for suffix, activations in (("u8", QuantType.QUInt8), ("s8", QuantType.QInt8)):
        path = out / f"ort_{suffix}.onnx"
        quantize_static(
            str(files["float"]),
            str(path),
            _Batches("input", case.calib),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=activations,
            weight_type=QuantType.QInt8,
        )
        files[f"ORT quantize_static {suffix}"] = path
    return files, summary


def optimized_kernels(path: pathlib.Path, out: pathlib.Path) -> collections.Counter[str]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(out / f"{path.stem}.optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    return collections.Counter({op: n for op, n in ops.items() if op.startswith(INTEGER_KERNELS + FLOAT_KERNELS)})


# ------------------------------------------------------------------------------------------- timing


def _session(path: pathlib.Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def latencies(
    files: dict[str, pathlib.Path], example: np.ndarray | dict[str, np.ndarray], threads: int, runs: int,
    rounds: int = 10
) -> dict[str, float]:
    """Median latency (ms) of each file over at least ``runs`` runs, measured in ``rounds`` interleaved blocks.

    Only the measured file's session exists while it runs (idle sessions' spinning worker threads would
    steal its cores). The files take turns block by block, in a rotating order, and every block lasts at
    least ``BLOCK_SECONDS``, so that changes of the machine's load (other processes) hit all files alike.
    """
    per_block = -(-runs // rounds)
    labels = list(files)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            session = _session(files[label], threads)
            feed = example if isinstance(example, dict) else {session.get_inputs()[0].name: example}
            for _ in range(5):
                session.run(None, feed)
            block_start = time.perf_counter()
            done = 0
            while done < per_block or time.perf_counter() - block_start < BLOCK_SECONDS:
                start = time.perf_counter()
                session.run(None, feed)
                times[label].append(time.perf_counter() - start)
                done += 1
            del session
    return {label: 1e3 * statistics.median(t) for label, t in times.items()}


# ------------------------------------------------------------------------------------------- report


def table(rows: list[tuple[str, ...]]) -> str:
    """``rows[0]`` is the header."""
    return format_table(rows[0], rows[1:])


def run_case(case: Case, out: pathlib.Path, threads: Sequence[int], runs: int) -> list[tuple[str, ...]]:
    print(f"\n== {case.name}")
    if case.note:
        print(f"   note: {case.note}; benchmarking the same architecture built from nn.MultiheadAttention")
    files, summary = write_files(case, out)
    print(f"   our export: {summary}")
    kernels = optimized_kernels(files["int8 (ours)"], out)
    print("   onnxruntime compute kernels of our file: " + ", ".join(f"{op} x{n}" for op, n in sorted(kernels.items())))
    sizes = {label: path.stat().st_size for label, path in files.items()}
    example = case.example.numpy()
    rows = [("threads", "file", "size KiB", "size / float", "latency ms", "speed-up vs float")]
    summary_rows = []
    for n in threads:
        ms = latencies(files, example, n, runs)
        speedup = {label: ms["float"] / value for label, value in ms.items()}
        for label in files:
            rows.append(
                (str(n), label, f"{sizes[label] / 1024:.1f}", f"{sizes[label] / sizes['float']:.3f}",
                 f"{ms[label]:.3f}", f"{speedup[label]:.2f}x")
            )
        ort_best = max(speedup["ORT quantize_static u8"], speedup["ORT quantize_static s8"])
        ratio = speedup["int8 (ours)"] / ort_best
        summary_rows.append(
            (case.name, str(n), f"{sizes['int8 (ours)'] / sizes['float']:.3f}", f"{speedup[PLAIN]:.2f}x",
             f"{speedup['int8 (ours)']:.2f}x", f"{ort_best:.2f}x", f"{ratio:.2f}", "yes" if ratio >= TARGET else "NO")
        )
    print(table(rows))
    return summary_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="timed runs per file (median reported; >= 50)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op thread counts")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--keep", type=pathlib.Path, help="keep the ONNX files in this directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("root").setLevel(logging.ERROR)  # quantize_static's "consider pre-processing" hints
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(args.threads))
    start = time.perf_counter()
    summary = [
        ("model", "threads", "size int8/float", "as-is vs float", "ours vs float", "ORT vs float", "ours / ORT",
         "ours/ORT >= 0.9")
    ]
    with tempfile.TemporaryDirectory(prefix="quark_brevitas_deploy_") as tmp:
        root = args.keep or pathlib.Path(tmp)
        for key in args.models:
            out = root / key
            out.mkdir(parents=True, exist_ok=True)
            summary.extend(run_case(CASES[key](), out, args.threads, args.runs))
    print("\n== Summary (speed-ups over the float file; as-is = Brevitas' graph without the integer-kernel rewrites;")
    print("   ORT = the faster of onnxruntime's quantize_static u8 / s8 files)")
    print(table(summary))
    seconds = time.perf_counter() - start
    print(f"\n(total {seconds:.0f} s, median of {args.runs} runs per file, onnxruntime {ort.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
