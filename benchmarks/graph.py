"""Backend.graph on the graph zoo (tests/helpers/graph_zoo.py), trained on scikit-learn's digits: accuracy float /
PTQ / QAT,
FINN readiness findings, FINN's conversion difference, and onnxruntime speed and integer kernels against
onnxruntime's own ``quantize_static`` of the same float model, in the same run.

Run: ``FINN_SRC=../shared/finn python -m benchmarks.graph [--bits 4] [--qat-epochs N --qat-lr LR]`` (a few
minutes; without ``FINN_SRC`` the FINN column says why it is empty). The config is ``finn_config(bits, model)``
(tests/helpers/graph_zoo.py: the ``finn_w{bits}a{bits}`` preset; at 2 bits the first layer's input and weights and
the last layer's weights 8-bit; ``--output-bits N``: the model's output quantized too) and the QAT recipe
``QAT_RECIPE[bits]`` (``FINN_QAT_RECIPE``) unless given. The encoder-decoder is not
a classifier: it is trained to reconstruct its input (its accuracy columns show the reconstruction's mean squared
error, lower is better).
Timings: the two onnxruntime files run alternately, one thread, median of ``--reps`` runs of a 64-image batch.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.tables import format_table

ROOT = Path(__file__).resolve().parent.parent
from quark_brevitas.api import ModelQuantizer  # noqa: E402
from quark_brevitas.cli.digits import evaluate, fine_tune, load_digits_data  # noqa: E402
from quark_brevitas.config.presets import get_preset  # noqa: E402
from quark_brevitas.export import ExportMismatchError, export_onnx_qcdq, export_qonnx, finn_readiness  # noqa: E402
from quark_brevitas.qat import prepare_qat  # noqa: E402
from tests.helpers.graph_zoo import GRAPH_ZOO, QAT_RECIPE, finn_config  # noqa: E402

INTEGER_KERNELS = ("QLinearConv", "QLinearAdd", "QLinearConcat", "QLinearGlobalAveragePool", "QLinearAveragePool",
                   "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm")


def _mse(model: nn.Module, loader) -> float:
    model.eval()
    with torch.no_grad():
        errs = [float(((model(x)[:, :1] - x) ** 2).mean()) for x, _ in loader]
    return float(np.mean(errs))


def _fit_reconstruction(model: nn.Module, data, epochs: int, lr: float) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for x, _ in data.train:
            optimizer.zero_grad()
            ((model(x)[:, :1] - x) ** 2).mean().backward()
            optimizer.step()
    model.eval()


def _score(name: str, model: nn.Module, data) -> float:
    return _mse(model, data.test) if name == "encoder_decoder" else evaluate(model, data.test)


def _train(name: str, model: nn.Module, data, epochs: int, lr: float) -> None:
    if name == "encoder_decoder":
        _fit_reconstruction(model, data, epochs, lr)
    else:
        fine_tune(model, data, epochs=epochs, lr=lr)


def _finn(path: Path, inputs: np.ndarray) -> str:
    source = os.environ.get("FINN_SRC") or str(ROOT.parent / "shared" / "finn")
    if not (Path(source) / "finn_check.py").is_file():
        return "no FINN_SRC"
    env = dict(line.split("=", 1) for line in subprocess.run(
        ["bash", str(Path(source) / "setup.sh"), *([os.environ["FINN_FRONTEND"]] if "FINN_FRONTEND" in os.environ
                                                   else [])], capture_output=True, text=True, check=True
    ).stdout.splitlines() if "=" in line)
    np.save(path.with_suffix(".npy"), inputs)
    script = str(Path(source) / "finn_check.py")
    out = subprocess.run([env["FINN_PY"], script, str(path), str(path.with_suffix(".npy"))], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": env["FINN_PATH"]}).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if "error" in result:
        return result["error"][:60]
    return (f"rel {result['rel_streamline']:.1e}, argmax {result['argmax_agree']:.3f}, "
            f"float MatMul/Conv {len(result['float_compute_inputs'])}")


def _ort_static(model: nn.Module, data, path: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    x = next(iter(data.test))[0]
    torch.onnx.export(model.eval(), (x,), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": b[0].numpy()} for b in data.calib])

        def get_next(self):
            return next(self.batches, None)

    out = path.with_name(path.stem + "_static.onnx")
    quantize_static(str(path), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, per_channel=True)
    return out


def _session(path: Path, optimized: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.optimized_model_filepath = str(optimized)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _kernels(path: Path) -> str:
    import onnx

    counts = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    return " ".join(f"{op}x{counts[op]}" for op in INTEGER_KERNELS if counts[op]) or "-"


def _ort_accuracy(name: str, session, data) -> float:
    feed = session.get_inputs()[0].name
    if name == "encoder_decoder":
        return float(np.mean([((session.run(None, {feed: x.numpy()})[0][:, :1] - x.numpy()) ** 2).mean()
                              for x, _ in data.test]))
    hits = sum(int((session.run(None, {feed: x.numpy()})[0].argmax(1) == y.numpy()).sum()) for x, y in data.test)
    return 100.0 * hits / len(data.test.dataset)


def _timed(sessions, x: np.ndarray, reps: int) -> list[float]:
    times = [[] for _ in sessions]
    for _ in range(reps):
        for i, session in enumerate(sessions):  # alternate the contenders
            start = time.perf_counter()
            session.run(None, {session.get_inputs()[0].name: x})
            times[i].append(time.perf_counter() - start)
    return [float(np.median(t)) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--qat-epochs", type=int, default=None, help="default: QAT_RECIPE[bits]")
    parser.add_argument("--qat-lr", type=float, default=None, help="default: QAT_RECIPE[bits]")
    parser.add_argument("--output-bits", type=int, default=None,
                        help="quantize the model's output at this width (finn_config's output_bits); default float")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--models", default=",".join(GRAPH_ZOO))
    args = parser.parse_args()
    qat_epochs, qat_lr = QAT_RECIPE[args.bits]
    qat_epochs = args.qat_epochs if args.qat_epochs is not None else qat_epochs
    qat_lr = args.qat_lr if args.qat_lr is not None else qat_lr
    torch.set_num_threads(1)
    data = load_digits_data()
    xt = torch.cat([b[0] for b in data.test])
    work = Path(tempfile.mkdtemp())
    rows, speed = [], []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = GRAPH_ZOO[name]()
        _train(name, model, data, args.epochs, 3e-3)
        float_score = _score(name, model, data)
        quant = ModelQuantizer(finn_config(args.bits, model, args.output_bits)).quantize_model(model, data.calib)
        ptq = _score(name, quant, data)
        prepare_qat(quant)
        _train(name, quant, data, qat_epochs, qat_lr)
        quant.eval()
        qat = _score(name, quant, data)
        qonnx = work / f"{name}.onnx"
        try:
            export_qonnx(quant, xt, qonnx)
            exported = "verified"
        except ExportMismatchError as exc:  # the file is kept (exc.path); say so rather than hide the model's row
            exported, qonnx = f"off by {exc.max_abs_diff:.3g}", exc.path
        findings = len(finn_readiness(qonnx))
        rows.append((name, f"{float_score:.3f}", f"{ptq:.3f}", f"{qat:.3f}", exported, str(findings),
                     _finn(qonnx, xt.numpy())))
        # onnxruntime: graph W8A8 (PTQ) QCDQ against quantize_static of the same float model
        w8 = ModelQuantizer(get_preset("finn_w8a8")).quantize_model(model, data.calib)
        export_onnx_qcdq(w8, next(iter(data.test))[0], work / f"{name}_w8.onnx", dynamic_batch=True)
        static = _ort_static(model, data, work / f"{name}_float.onnx")
        graph_s = _session(work / f"{name}_w8.onnx", work / f"{name}_w8_opt.onnx")
        static_s = _session(static, work / f"{name}_static_opt.onnx")
        x64 = xt[:64].numpy()
        graph_ms, static_ms = _timed([graph_s, static_s], x64, args.reps)
        speed.append((name, f"{_ort_accuracy(name, graph_s, data):.3f}", f"{_ort_accuracy(name, static_s, data):.3f}",
                      f"{graph_ms:.3f}", f"{static_ms:.3f}", f"{static_ms / graph_ms:.2f}",
                      _kernels(work / f"{name}_w8_opt.onnx"), _kernels(work / f"{name}_static_opt.onnx")))
    score = "accuracy % (encoder_decoder: MSE)"
    wide = ", first layer input+weights and last layer weights 8-bit" if args.bits == 2 else ""
    output = f", output quantized to {args.output_bits} bits" if args.output_bits else ""
    print(f"W{args.bits}A{args.bits} finn preset{wide}{output}, {qat_epochs} QAT epochs from lr {qat_lr:g} (cosine); "
          f"{score}")
    print(format_table(("model", "float", "PTQ", "QAT", "QONNX vs PyTorch", "readiness findings",
                        "FINN convert+streamline"), rows))
    print("\nonnxruntime, W8A8: graph backend QCDQ vs quantize_static (QDQ, per-channel int8), batch 64, 1 thread")
    print(format_table(("model", "graph acc", "static acc", "graph ms", "static ms", "static/graph",
                        "graph integer kernels", "static integer kernels"), speed))


if __name__ == "__main__":
    main()
