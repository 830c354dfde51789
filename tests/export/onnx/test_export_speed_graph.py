"""Exported int8 graphs take onnxruntime's integer kernels, and the rewrites that get them there are exact.

No timings here (``benchmarks/deployment.py`` measures them). What decides the speed is which kernels
onnxruntime's graph optimizer turns the file into, so the tests read the optimized graph that onnxruntime
writes (``SessionOptions.optimized_model_filepath``): every quantized layer must have become an integer
kernel (QGemm, QLinearConv, MatMulIntegerToFloat, ...) with no float Conv/Gemm/MatMul and no run-time weight
DequantizeLinear left. Exactness is checked by running the rewritten and the unrewritten file
(``integer_kernels=False``) with onnxruntime's optimizations off: their outputs must be identical.
"""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.cli.digits import example_input
from quark_brevitas.export import ExportReport, export_onnx_qcdq, run_onnx
from quark_brevitas.export.onnx.passes.kernels import rewrite_for_integer_kernels
from quark_brevitas.types import QSchemeType

PC = QSchemeType.per_channel
B32 = QTensorConfig(bit_width=32)
LAYERS = {
    "W8A8 per-channel": QLayerConfig(weight=QTensorConfig(qscheme=PC), input_tensors=QTensorConfig(), bias=B32),
    "W8A8 per-tensor": QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(), bias=B32),
}
EXACTNESS_LAYERS = {
    **LAYERS,
    "W8A8 asymmetric": QLayerConfig(
        weight=QTensorConfig(symmetric=False), input_tensors=QTensorConfig(symmetric=False), bias=B32
    ),
    "W4A4": QLayerConfig(
        weight=QTensorConfig(bit_width=4, qscheme=PC), input_tensors=QTensorConfig(bit_width=4), bias=B32
    ),
}
FLOAT_COMPUTE = {"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "ConvTranspose"}
INTEGER_COMPUTE = {"QGemm", "QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat"}


# ------------------------------------------------------------------------------------ models


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).eval()


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.relu2 = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu1(self.conv1(x)))
        return self.fc(self.flatten(self.relu2(self.conv2(x))))


class EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer built from nn.MultiheadAttention (-> QuantMultiheadAttention)."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, 2, batch_first=True)
        self.linear1 = nn.Linear(d_model, 32)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(32, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, x, x, need_weights=False)[0])
        return self.norm2(x + self.linear2(self.relu(self.linear1(x))))


MODELS = {
    "mlp": (_mlp, (64,)),
    "cnn": (lambda: _seeded(SmallCNN), (3, 8, 8)),
    "encoder": (lambda: _seeded(EncoderLayer), (6, 16)),
}


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def _batches(shape: tuple[int, ...], n: int = 4, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *shape, generator=gen) for _ in range(n)]


def _export(
    model_key: str, layer: QLayerConfig, path: pathlib.Path, **kwargs: bool
) -> tuple[nn.Module, torch.Tensor, ExportReport]:
    build, shape = MODELS[model_key]
    quant = ModelQuantizer(Config(global_quant_config=layer)).quantize_model(build(), _batches(shape))
    x = _batches(shape, n=1, seed=1)[0]
    return quant, x, export_onnx_qcdq(quant, x, path, **kwargs)


# ------------------------------------------------------------------------------------ graph helpers


def _ort_kernels(path: pathlib.Path, tmp_path: pathlib.Path) -> collections.Counter[str]:
    """Op types of the graph onnxruntime actually runs (default CPU session, full optimization)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / f"{path.stem}.ort_optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def _run_unoptimized(path: pathlib.Path, x: torch.Tensor) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _inits(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def _assert_integer_kernels_only(kernels: collections.Counter[str], expected: dict[str, int]) -> None:
    assert not FLOAT_COMPUTE & set(kernels), kernels
    assert "DequantizeLinear" not in kernels or kernels["DequantizeLinear"] <= 1, kernels  # output DQ at most
    assert {op: kernels[op] for op in expected} == expected, kernels


def _assert_clips_are_relus(graph: onnx.GraphProto) -> None:
    """Every Clip is an integer ReLU: it clips an activation's codes at its quantizer's zero point."""
    inits = _inits(graph)
    producer = {out: node for node in graph.node for out in node.output}
    for clip in (n for n in graph.node if n.op_type == "Clip"):
        assert len(clip.input) == 2, "no upper bound expected for 8-bit activations"
        low = inits[clip.input[1]]
        q = producer[clip.input[0]]
        while q.op_type == "MaxPool":  # the Clip moves below MaxPool (both only order values)
            q = producer[q.input[0]]
        assert q.op_type == "QuantizeLinear"
        zero_point = inits[q.input[2]]
        assert low.dtype == zero_point.dtype == np.uint8
        assert int(low) == int(zero_point) > 0, "a Clip at the type's minimum would be a no-op"


# ------------------------------------------------------------------------------------ integer kernels


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_w8a8_mlp_runs_on_integer_kernels(tmp_path: pathlib.Path, name: str) -> None:
    quant, x, report = _export("mlp", LAYERS[name], tmp_path / "mlp.onnx")
    assert report.max_abs_diff <= report.tolerance

    # onnxruntime runs all four layers as QGemm: no float Gemm, no weight dequantized at run time
    _assert_integer_kernels_only(_ort_kernels(report.path, tmp_path), {"QGemm": 4})

    graph = onnx.load(str(report.path)).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    assert ops["Relu"] == 0 and ops["Clip"] == 3  # the ReLUs became integer Clips, no other Clip
    _assert_clips_are_relus(graph)
    # activations are stored as uint8 (zero point 128 for the symmetric quantizer), weights stay int8
    for q in (n for n in graph.node if n.op_type == "QuantizeLinear"):
        assert _inits(graph)[q.input[2]].dtype == np.uint8
    assert report.weight_dtypes == ("INT8",) and report.bias_dtypes == ("INT32",)
    weights = [i for i in graph.initializer if len(i.dims) == 2]
    assert len(weights) == 4 and all(w.data_type == TensorProto.INT8 for w in weights)
    assert dict(report.rewrites)["ReLUs moved into the integer domain"] == 3

    # predictions agree with PyTorch on fresh data
    x_new = torch.randn(256, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = quant(x_new).numpy()
    actual = run_onnx(report.path, x_new)[0]
    assert np.abs(actual - expected).max() <= report.tolerance
    assert np.mean(actual.argmax(1) == expected.argmax(1)) >= 0.99


def test_cnn_with_maxpool_runs_on_integer_kernels(tmp_path: pathlib.Path) -> None:
    quant, x, report = _export("cnn", LAYERS["W8A8 per-channel"], tmp_path / "cnn.onnx")
    kernels = _ort_kernels(report.path, tmp_path)
    # Conv -> Relu -> MaxPool: the quantizer moved up to the Conv (QLinearConv), MaxPool runs on uint8 in NHWC
    _assert_integer_kernels_only(kernels, {"QLinearConv": 2, "QGemm": 1, "NhwcMaxPool": 1})
    graph = onnx.load(str(report.path)).graph
    _assert_clips_are_relus(graph)
    producer = {out: node for node in graph.node for out in node.output}
    pool = next(n for n in graph.node if n.op_type == "MaxPool")
    quantizer = producer[pool.input[0]]  # MaxPool reads the first Conv's quantized output directly
    assert quantizer.op_type == "QuantizeLinear" and producer[quantizer.input[0]].op_type == "Conv"
    assert np.abs(run_onnx(report.path, x)[0] - quant(x).detach().numpy()).max() <= report.tolerance


def test_attention_encoder_runs_on_integer_kernels(tmp_path: pathlib.Path) -> None:
    quant, x, report = _export("encoder", LAYERS["W8A8 per-channel"], tmp_path / "encoder.onnx")
    assert report.max_abs_diff <= report.tolerance
    kernels = _ort_kernels(report.path, tmp_path)
    # q/k/v projections, q @ k, attention @ v, out_proj, linear1, linear2: all integer (3-D inputs: MatMul, not
    # Gemm)
    assert not FLOAT_COMPUTE & set(kernels), kernels
    assert sum(kernels[op] for op in INTEGER_COMPUTE) == 8, kernels
    graph = onnx.load(str(report.path)).graph
    producer = {out: node for node in graph.node for out in node.output}
    inits = {i.name for i in graph.initializer}
    for node in graph.node:  # weights are stored pre-transposed: no Transpose of a dequantized constant
        source = producer.get(node.input[0]) if node.op_type == "Transpose" else None
        assert source is None or source.op_type != "DequantizeLinear" or source.input[0] not in inits


@pytest.mark.slow
def test_digits_w8a8_runs_on_integer_kernels(digits_model, digits_data, tmp_path: pathlib.Path) -> None:
    quant = ModelQuantizer(Config(global_quant_config=LAYERS["W8A8 per-channel"])).quantize_model(
        digits_model, digits_data.calib
    )
    report = export_onnx_qcdq(quant, example_input(digits_data), tmp_path / "digits.onnx")
    _assert_integer_kernels_only(
        _ort_kernels(report.path, tmp_path), {"QLinearConv": 2, "QGemm": 2, "NhwcMaxPool": 1}
    )
    _assert_clips_are_relus(onnx.load(str(report.path)).graph)
    agree = total = 0
    for images, _ in digits_data.test:
        with torch.no_grad():
            expected = quant(images).argmax(1).numpy()
        agree += int((run_onnx(report.path, images)[0].argmax(1) == expected).sum())
        total += len(expected)
    assert agree / total >= 0.995
    weights = [i for i in onnx.load(str(report.path)).graph.initializer if len(i.dims) >= 2]
    assert weights and all(w.data_type == TensorProto.INT8 for w in weights)


# ------------------------------------------------------------------------------------ exactness


EXACTNESS_CASES = [
    *(("mlp", name) for name in sorted(EXACTNESS_LAYERS)),
    ("cnn", "W8A8 per-channel"),  # quantizer above MaxPool/Flatten, Clip below MaxPool
    ("cnn", "W4A4"),  # ... with Brevitas' low-bit Clip
    ("cnn", "W8A8 asymmetric"),  # ReLU dropped (zero point at the type minimum)
    ("encoder", "W8A8 per-channel"),  # offline weight transposes (per-channel axis), attention
    ("encoder", "W4A4"),
]


@pytest.mark.parametrize(("model_key", "name"), EXACTNESS_CASES)
def test_rewrites_are_exact(tmp_path: pathlib.Path, model_key: str, name: str) -> None:
    """The rewritten graph computes bit-identical outputs to Brevitas' graph (onnxruntime optimizations off)."""
    quant, x, rewritten = _export(model_key, EXACTNESS_LAYERS[name], tmp_path / "rewritten.onnx")
    plain = export_onnx_qcdq(quant, x, tmp_path / "plain.onnx", integer_kernels=False)
    assert rewritten.rewrites and not plain.rewrites
    for batch in (x, _batches(MODELS[model_key][1], n=1, batch=32, seed=3)[0]):
        assert np.array_equal(_run_unoptimized(rewritten.path, batch), _run_unoptimized(plain.path, batch))
    # and with onnxruntime's integer kernels it still matches PyTorch (the exporter's own check)
    assert rewritten.max_abs_diff <= rewritten.tolerance


def test_integer_kernels_false_keeps_brevitas_graph(tmp_path: pathlib.Path) -> None:
    _, _, report = _export("mlp", LAYERS["W8A8 per-tensor"], tmp_path / "plain.onnx", integer_kernels=False)
    graph = onnx.load(str(report.path)).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    assert report.rewrites == () and ops["Relu"] == 3 and ops["Clip"] == 0
    zero_points = {_inits(graph)[q.input[2]].dtype for q in graph.node if q.op_type == "QuantizeLinear"}
    assert zero_points == {np.dtype(np.int8)}
    # which is what onnxruntime cannot fuse: the ReLU layers stay float Gemms
    assert {"FusedGemm", "Gemm"} & set(_ort_kernels(report.path, tmp_path))


def test_low_bit_activation_clip_absorbs_relu(tmp_path: pathlib.Path) -> None:
    _, _, report = _export("mlp", EXACTNESS_LAYERS["W4A4"], tmp_path / "w4a4.onnx")
    graph = onnx.load(str(report.path)).graph
    inits = _inits(graph)
    bounds = sorted(
        (int(inits[c.input[1]]), int(inits[c.input[2]])) for c in graph.node if c.op_type == "Clip"
    )
    # input quantizer: Brevitas' 4-bit clip [-8, 7] (+128); after each ReLU: one Clip [zero point, 7] (+128)
    assert bounds == [(120, 135), (128, 135), (128, 135), (128, 135)]
    _assert_integer_kernels_only(_ort_kernels(report.path, tmp_path), {"QGemm": 4})


def test_relu_before_zero_point_at_type_minimum_is_dropped(tmp_path: pathlib.Path) -> None:
    """Asymmetric activations after a ReLU get zero point 0 (uint8): the ReLU is a no-op after Q."""
    _, _, report = _export("mlp", EXACTNESS_LAYERS["W8A8 asymmetric"], tmp_path / "asym.onnx")
    ops = collections.Counter(n.op_type for n in onnx.load(str(report.path)).graph.node)
    assert ops["Relu"] == 0 and ops["Clip"] == 0
    _assert_integer_kernels_only(_ort_kernels(report.path, tmp_path), {"QGemm": 4})


def test_bias_with_foreign_scale_is_not_left_to_the_fused_kernel(tmp_path: pathlib.Path) -> None:
    """onnxruntime's QGemm adds the raw int32 bias assuming scale = input scale x weight scale."""
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, size=(4, 8), dtype=np.int8)
    bias = rng.integers(-1000, 1000, size=(4,), dtype=np.int32)
    x_scale, w_scale = np.float32(0.05), np.float32(0.02)
    bias_scale = np.float32(x_scale * w_scale * 3)  # not the product
    inits = [
        numpy_helper.from_array(x_scale, "x_scale"),
        numpy_helper.from_array(np.int8(0), "x_zp"),
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.int8(0), "w_zp"),
        numpy_helper.from_array(bias, "b"),
        numpy_helper.from_array(bias_scale, "b_scale"),
        numpy_helper.from_array(np.int32(0), "b_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zp"], ["wd"]),
        helper.make_node("DequantizeLinear", ["b", "b_scale", "b_zp"], ["bd"]),
        helper.make_node("Gemm", ["xd", "wd", "bd"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = torch.from_numpy(rng.standard_normal((5, 8)).astype(np.float32))
    original = tmp_path / "original.onnx"
    onnx.save(model, str(original))
    reference = _run_unoptimized(original, x)
    # onnxruntime's fused QGemm gets this bias wrong ...
    assert np.abs(run_onnx(original, x)[0] - reference).max() > 0.01
    rewrites = dict(rewrite_for_integer_kernels(model))
    assert rewrites["biases dequantized offline (scale is not input x weight scale)"] == 1
    fixed = tmp_path / "fixed.onnx"
    onnx.save(model, str(fixed))
    # ... the rewritten file stores it as float and runs right
    assert np.allclose(run_onnx(fixed, x)[0], reference, atol=1e-5)
    assert np.array_equal(_run_unoptimized(fixed, x), reference)


def test_float_bias_that_onnxruntime_would_round_is_kept_exact(tmp_path: pathlib.Path) -> None:
    """onnxruntime rounds a float bias of a QDQ Gemm/Conv to int32 (scale = input x weight scale) to fuse it;
    at low bit widths that exceeds the tolerance, so the exporter moves such biases into an Add and re-verifies."""
    layer = QLayerConfig(weight=QTensorConfig(bit_width=4), input_tensors=QTensorConfig(bit_width=6, symmetric=False))
    quant, x, report = _export("mlp", layer, tmp_path / "float_bias.onnx")
    assert dict(report.rewrites)["float biases moved out of quantized layers"] == 4
    assert report.max_abs_diff <= report.tolerance
    graph = onnx.load(str(report.path)).graph
    assert all(len(n.input) == 2 for n in graph.node if n.op_type == "Gemm")
    assert collections.Counter(n.op_type for n in graph.node)["Add"] == 4
    # the matrix products still run on integer kernels (QGemm with float output, then the Add)
    _assert_integer_kernels_only(_ort_kernels(report.path, tmp_path), {"QGemm": 4})
    x_new = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert np.abs(run_onnx(report.path, x_new)[0] - quant(x_new).numpy()).max() <= report.tolerance


def test_embedding_rows_are_gathered_before_dequantization(tmp_path: pathlib.Path) -> None:
    """A QuantEmbedding's table is dequantized after the Gather (only the looked-up rows), exactly."""
    from brevitas.nn import QuantEmbedding

    from quark_brevitas import DEFAULT_LAYER_MAP, Container, LayerMapping

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(50, 16)
            self.fc = nn.Linear(16, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.embedding(ids))

    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, nn.Embedding: LayerMapping(QuantEmbedding)})
    config = Config(QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig()),
                    layer_type_quant_config={nn.Embedding: QLayerConfig(weight=QTensorConfig())},
                    pre_quant_opt_config=[])
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (4, 7))
    quant = ModelQuantizer(config, container=container).quantize_model(Tagger(), [ids])
    rewritten = export_onnx_qcdq(quant, ids, tmp_path / "rewritten.onnx")
    plain = export_onnx_qcdq(quant, ids, tmp_path / "plain.onnx", integer_kernels=False)
    assert dict(rewritten.rewrites)["embedding rows gathered before dequantization"] == 1
    graph = onnx.load(str(rewritten.path)).graph
    gather = next(n for n in graph.node if n.op_type == "Gather")
    assert gather.input[0] in _inits(graph) and _inits(graph)[gather.input[0]].dtype == np.int8  # int8 rows
    other = torch.randint(0, 50, (3, 5))
    assert np.array_equal(_run_unoptimized(rewritten.path, other), _run_unoptimized(plain.path, other))
