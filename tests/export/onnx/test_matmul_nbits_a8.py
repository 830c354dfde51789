"""Int4 per-group weights with int8 inputs quantized dynamically per group of the same size: the input quantizer
computes MLAS's codes (``x * (127 / max|x|)``), so the raw input goes into onnxruntime's ``MatMulNBits`` at
``accuracy_level`` 4 (fused, no quantization op in the file); explicit ops computing the same codes where the weight
is not such a kernel, and for the pinned verification (issue 18, item 4)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
import transformers
from helpers.onnx_check import assert_decodes_like_pytorch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.brevitas_adapter import weight_quant_disabled
from quark_brevitas.export import ExportError, export_onnx_qcdq, run_onnx
from quark_brevitas.export.onnx.passes.nbits import INT8_ACCURACY_LEVEL, nbits_tensors
from quark_brevitas.types import Dtype, QSchemeType

PG = QSchemeType.per_group
WEIGHTS = {
    "int4 sym": lambda g: QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=g),
    "uint4 asym": lambda g: QTensorConfig(dtype=Dtype.uint4, symmetric=False, qscheme=PG, group_size=g),
}


def _input(group: int) -> QTensorConfig:
    return QTensorConfig(dtype=Dtype.int8, qscheme=PG, group_size=group, is_dynamic=True)


def _quantize(model: nn.Module, weight: QTensorConfig, inputs: QTensorConfig, x: torch.Tensor) -> nn.Module:
    config = Config(QLayerConfig(weight=weight, input_tensors=inputs), pre_quant_opt_config=[])
    return ModelQuantizer(config).quantize_model(model, [x])


def _levels(path: pathlib.Path) -> list[int]:
    return [next(a.i for a in node.attribute if a.name == "accuracy_level")
            for node in onnx.load(str(path)).graph.node if node.op_type == "MatMulNBits"]


def _with_level(path: pathlib.Path, level: int, out: pathlib.Path) -> pathlib.Path:
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = level
    onnx.save(proto, str(out))
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(18)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)).eval()


def test_mlas_level_4_quantizes_the_input_per_block_as_the_export_assumes() -> None:
    """Canary for the arithmetic the export relies on: a MatMulNBits node at level 4 computes (int8 codes of A per
    block of block_size, scale max|a| / 127, rounded half to even) x (dequantized int4 weight), up to float
    summation order; at level 1 it computes with A itself."""
    rng = np.random.default_rng(0)
    m, k, n, block = 3, 512, 64, 128
    codes = rng.integers(0, 16, (n, k))
    scale = rng.uniform(0.01, 0.05, (n, k // block)).astype(np.float32)
    zero_point = rng.integers(0, 16, (n, k // block))
    packed, scales, zero_points = nbits_tensors(codes, scale, zero_point, 4, False, block)
    weight = (codes - np.repeat(zero_point, block, axis=1)) * np.repeat(scale.astype(np.float64), block, axis=1)
    a = rng.standard_normal((m, k)).astype(np.float32)
    blocks = a.reshape(m, k // block, block)
    amax = np.abs(blocks).max(-1, keepdims=True)
    a_quantized = (np.round(blocks * (np.float32(127) / amax)) * (amax / np.float32(127))).reshape(m, k)
    for level, expected in ((INT8_ACCURACY_LEVEL, a_quantized @ weight.T), (1, a.astype(np.float64) @ weight.T)):
        node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=block, accuracy_level=level)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])],
                                  [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S"),
                                   numpy_helper.from_array(zero_points, "Z")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        import onnxruntime as ort

        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"A": a})[0]
        assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()
    assert np.abs(a_quantized - a).max() > 1e-3  # the two references differ: the check above tells them apart


def _identity_kernel(k: int, block: int) -> object:
    """An onnxruntime session of one MatMulNBits node at level 4 whose weight is the identity (4-bit code 1, zero
    point 0, scale 1): every output is ``code * scale`` of the kernel's own int8 quantization of its input (one
    nonzero int8 x int4 product per output, the zero points' block sums all 0), exactly."""
    import onnxruntime as ort

    blocks = k // block
    packed, scales, zero_points = nbits_tensors(np.eye(k, dtype=np.int64), np.ones((k, blocks), np.float32),
                                                np.zeros((k, blocks), np.int64), 4, False, block)
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=k, bits=4,
                            block_size=block, accuracy_level=INT8_ACCURACY_LEVEL)
    graph = helper.make_graph([node], "identity", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", k])],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S"),
                               numpy_helper.from_array(zero_points, "Z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _near_ties(amax: float) -> np.ndarray:
    """Positive elements of a group with ``max|x| = amax`` whose codes ``x * (127 / amax)`` and
    ``x / (amax / 127)`` (float32) round differently: within 3 ulp of a midpoint between two codes."""
    amax = np.float32(amax)
    scale, inverse = amax / np.float32(127), np.float32(127) / amax
    midpoints = ((np.arange(127) + 0.5) * np.float64(scale)).astype(np.float32)
    candidates = np.concatenate([midpoints + np.float32(d) * np.spacing(midpoints) for d in range(-3, 4)])
    candidates = candidates[(candidates > 0) & (candidates < amax)]
    return candidates[np.rint(candidates * inverse) != np.rint(candidates / scale)]


def _adversarial_rows(block: int, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int]]:
    """Rows of 4 groups each: random; near ties of both roundings (signs mixed); exact ties (``127 / amax`` a power
    of two, elements at half codes); an all-zero group, tiny (1e-30) and huge (1e30) groups, one large element among
    tiny ones; and a group so small (``amax`` 1e-38) that ``127 / amax`` overflows float32, returned as
    ``(row, group)``."""
    rows = [rng.standard_normal(4 * block)]
    near = []
    for _ in range(4):
        amax = rng.uniform(0.5, 2.0)
        found = rng.permutation(_near_ties(amax))[:block - 1]
        found = np.resize(found, block - 1) * rng.choice([-1, 1], block - 1)
        near.append(np.concatenate([[amax * rng.choice([-1, 1])], found]))
    rows.append(np.concatenate(near))
    halves = (rng.integers(-127, 127, 4 * block) + 0.5) * np.repeat(2.0 ** np.arange(-2, 2), block)
    halves[::block] = 127 * np.repeat(2.0 ** np.arange(-2, 2), 1)  # amax 127 * 2^j: the inverse 2^-j, exact
    rows.append(halves)
    odd = rng.standard_normal(4 * block)
    odd[:block] = 0
    odd[block:2 * block] *= 1e-30
    odd[2 * block:3 * block] *= 1e30
    odd[3 * block:] *= 1e-20
    odd[3 * block + 5] = 1e20
    rows.append(odd)
    overflow = rng.standard_normal(4 * block)
    overflow[block:2 * block] = rng.uniform(-1e-38, 1e-38, block)
    rows.append(overflow)
    return np.stack(rows).astype(np.float32), (len(rows) - 1, 1)


@pytest.mark.parametrize("block", [32, 128])
def test_the_input_quantizer_computes_mlas_codes_at_ties_zeros_and_extremes(block: int) -> None:
    """The PyTorch per-group int8 input quantizer and onnxruntime's level-4 kernel quantize every input to the same
    codes and scales, bit for bit: the export's fused form (raw input into the kernel) relies on it. The rows hold
    inputs where Brevitas's ``x / scale`` would pick the other code, so the test tells the two apart."""
    rng = np.random.default_rng(block)
    x, (overflow_row, overflow_group) = _adversarial_rows(block, rng)
    k = x.shape[1]
    quant = _quantize(nn.Sequential(nn.Linear(k, 8)).eval(), WEIGHTS["int4 sym"](block), _input(block),
                      torch.from_numpy(x))
    with torch.no_grad():
        ours = quant.get_submodule("0").input_quant(torch.from_numpy(x)).value.numpy()
    session = _identity_kernel(k, block)
    kernel = np.concatenate([session.run(None, {"A": x[i:i + 1]})[0] for i in range(len(x))])  # M = 1 (decode)
    assert np.array_equal(session.run(None, {"A": x})[0], kernel)  # M > 1 (prompt): the same quantization
    exact = np.ones_like(x, dtype=bool)
    columns = slice(overflow_group * block, (overflow_group + 1) * block)
    exact[overflow_row, columns] = False
    assert np.array_equal(ours[exact], kernel[exact])
    assert not ours[~exact].any()  # codes 0 (MLAS's AVX-512 path; its AVX2 path saturates to -128 x ~1e-40)
    assert np.abs(kernel[~exact]).max() <= 1e-38
    assert not ours[3, :block].any() and np.abs(ours[3, 3 * block:]).max() == 1e20  # zero group, large among tiny
    groups = torch.from_numpy(x).reshape(len(x), -1, block)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127
    brevitas = (torch.round(groups / scale) * scale).reshape(x.shape).numpy()  # Brevitas's IntQuant: x / scale
    assert (brevitas[1] != kernel[1]).sum() > block  # the near-tie row: the other rounding differs there


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_per_group_int8_inputs_are_quantized_inside_matmulnbits(tmp_path: pathlib.Path, name: str,
                                                                group: int) -> None:
    """The fused form: the raw float input goes into MatMulNBits at level 4, no quantization op in the file."""
    x = torch.randn(4, 7, 256, generator=torch.Generator().manual_seed(2))
    quant = _quantize(_mlp(), WEIGHTS[name](group), _input(group), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert _levels(report.path) == [INT8_ACCURACY_LEVEL, INT8_ACCURACY_LEVEL]
    # the float file's ops, MatMul -> MatMulNBits: nothing quantizes the input in the file
    assert _op_counts(report.path) == _float_op_counts(_mlp(), x, tmp_path) == {"MatMulNBits": 2, "Add": 2, "Relu": 1}
    with torch.no_grad():
        reference = quant(x).numpy()
    scale = np.abs(reference).max()
    assert np.abs(run_onnx(report.path, x)[0] - reference).max() < 1e-5 * scale
    # the kernel quantizes the input: at level 1 (float32 products) the same file computes something else
    float32 = _with_level(report.path, 1, tmp_path / "level1.onnx")
    assert np.abs(run_onnx(float32, x)[0] - reference).max() > 1e-3 * scale
    with torch.no_grad(), contextlib.ExitStack() as stack:  # and the model's own input quantization is what it is
        for layer in (quant.get_submodule("0"), quant.get_submodule("2")):
            stack.enter_context(weight_quant_disabled(layer.input_quant))
        assert np.abs(quant(x).numpy() - reference).max() > 1e-3 * scale


def _op_counts(path: pathlib.Path) -> Counter[str]:
    """Op counts, without ``Constant`` nodes (the quantized Llama's opset takes its ReduceMean axes as Constant
    inputs where the float file's opset has attributes; onnxruntime folds them when it loads the file)."""
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node if node.op_type != "Constant")


def _float_op_counts(model: nn.Module, example: object, tmp_path: pathlib.Path, **kwargs: object) -> Counter[str]:
    """The op counts of the float model's export, its MatMul / Gemm counted as MatMulNBits."""
    counts = _op_counts(export_onnx_qcdq(model, example, tmp_path / "float.onnx", **kwargs).path)
    linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert counts["MatMul"] + counts["Gemm"] >= linear
    gemm = min(linear, counts.pop("Gemm", 0))
    counts["MatMul"] -= linear - gemm  # the other MatMuls (attention) stay
    counts["MatMulNBits"] = linear
    return +counts


def test_a_last_partial_group_is_quantized_like_pytorch_and_mlas(tmp_path: pathlib.Path) -> None:
    """688 input features in groups of 128 (the trained Llama's down_proj): the last group is 48 features."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(688, 64)).eval()
    x = torch.randn(3, 5, 688, generator=torch.Generator().manual_seed(6))
    x[..., 640:] *= 0.01  # the short group's scale differs from its neighbours': a wrong grouping shows
    padded = dataclasses.replace(WEIGHTS["int4 sym"](128), pad_groups=True)  # the short group is asked for
    quant = _quantize(model, padded, _input(128), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert _levels(report.path) == [INT8_ACCURACY_LEVEL]
    with torch.no_grad():
        reference = quant(x).numpy()
    assert np.abs(run_onnx(report.path, x)[0] - reference).max() < 1e-5 * np.abs(reference).max()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # 0 / 0 of the zero group's pinned codes (undefined casts)
def test_the_pinned_check_pins_the_per_group_codes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep model whose outputs drift by rounding flips is accepted by pinning every quantizer's codes: the fused
    kernels get explicit code nodes for the pinned run, which are found and fed PyTorch's codes (an all-zero group,
    scale 0, included; first output comparison forced to fail)."""
    from quark_brevitas.export.onnx import orchestrate

    measure = orchestrate.measure
    calls = []

    def failing_once(*args: object, **kwargs: object) -> object:
        result = measure(*args, **kwargs)
        calls.append(result)
        return result._replace(max_abs_diff=result.tolerance * 2) if len(calls) == 1 else result

    monkeypatch.setattr(orchestrate, "measure", failing_once)
    x = torch.randn(4, 7, 256, generator=torch.Generator().manual_seed(5))
    x[0, 0, :128] = 0
    quant = _quantize(_mlp(), WEIGHTS["uint4 asym"](128), _input(128), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx")
    assert report.verified_by == "pinned"
    assert "(2 pinned)" in report.tolerance_source and "unpinned" not in report.tolerance_source


def test_input_groups_other_than_the_weight_groups_are_an_export_error(tmp_path: pathlib.Path) -> None:
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    quant = _quantize(_mlp(), WEIGHTS["int4 sym"](128), _input(64), x)
    with pytest.raises(ExportError, match=r"0\.input_quant.*MatMulNBits"):
        export_onnx_qcdq(quant, x, tmp_path / "m.onnx")


def test_the_dequantize_form_quantizes_the_inputs_with_standard_ops(tmp_path: pathlib.Path) -> None:
    """``int4_kernel="dequantize"``: standard ONNX only (explicit per-group quantization, blocked DequantizeLinear,
    MatMul), still what the model computes."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    quant = _quantize(_mlp(), WEIGHTS["int4 sym"](128), _input(128), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx", int4_kernel="dequantize")
    ops = {node.op_type for node in onnx.load(str(report.path)).graph.node}
    assert "MatMulNBits" not in ops and {"DequantizeLinear", "Gemm", "Round"} <= ops
    with torch.no_grad():
        reference = quant(x).numpy()
    assert np.abs(run_onnx(report.path, x)[0] - reference).max() < 1e-5 * np.abs(reference).max()


@pytest.mark.parametrize("int4_kernel", ["dequantize", "matmulnbits"])
def test_explicit_and_fused_forms_compute_the_codes_at_near_ties(tmp_path: pathlib.Path, int4_kernel: str) -> None:
    """The rows where Brevitas's ``x / scale`` and MLAS's reciprocal round differently, through a whole layer: the
    explicit ops of ``int4_kernel="dequantize"`` (standard ONNX) compute the reciprocal codes as the model does, and
    so does the fused kernel; one flipped code would move an output by about ``scale * |w|`` (1e-3 here)."""
    block = 32
    x = torch.from_numpy(_adversarial_rows(block, np.random.default_rng(7))[0][:3])  # random, near ties, exact ties
    torch.manual_seed(3)
    quant = _quantize(nn.Sequential(nn.Linear(4 * block, 16)).eval(), WEIGHTS["int4 sym"](block), _input(block), x)
    report = export_onnx_qcdq(quant, x, tmp_path / "m.onnx", int4_kernel=int4_kernel)
    assert ("Round" in _op_counts(report.path)) == (int4_kernel == "dequantize")
    with torch.no_grad():
        reference = quant(x).numpy()
    per_row = np.abs(run_onnx(report.path, x)[0] - reference).max(-1) / np.abs(reference).max(-1)
    assert per_row.max() < 2e-6, per_row


def test_tiny_llama_with_past_key_values_decodes_like_pytorch(tmp_path: pathlib.Path) -> None:
    layers, vocab = 2, 64
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(6))
    quant = _quantize(llama(), WEIGHTS["int4 sym"](32), _input(32), ids)
    prompt = ids[:, :6]
    example = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    report = export_onnx_qcdq(quant, example, tmp_path / "llama.onnx", past_key_values=True)
    n_linear = sum(isinstance(m, nn.Linear) for m in llama().modules())
    assert _levels(report.path) == [INT8_ACCURACY_LEVEL] * n_linear  # lm_head included
    # fused: the float file's ops with its Linear MatMuls as MatMulNBits, no op quantizing an input
    assert _op_counts(report.path) == _float_op_counts(llama(), example, tmp_path, past_key_values=True)
    assert_decodes_like_pytorch(report.path, quant, prompt)  # prompt, then one token a step (M=1)
