"""``RoundType.half_up`` (FINN's ties-up thresholds): the quantizer rounds ties up, the QONNX file states it exactly
(quark_brevitas.export.onnx.ties_up), and specs that cannot hold it are refused naming the field."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from quark_brevitas import Config, ModelQuantizer, QLayerConfig, QTensorConfig
from quark_brevitas.config.enums import Backend, QSchemeType, RoundType, ScaleType
from quark_brevitas.errors import ConfigError
from quark_brevitas.export import ExportError
from quark_brevitas.export.onnx.qonnx import QONNX_DOMAIN, export_qonnx, run_qonnx
from quark_brevitas.export.onnx.ties_up import rewrite_ties_up
from quark_brevitas.quantizers import TIES_UP_MODE, RoundTiesUpSte


def test_rounding_is_ties_up_with_identity_gradient() -> None:
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4999, -2.5001, 3.7, -3.2], requires_grad=True)
    y = RoundTiesUpSte()(x)
    assert y.tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 2.0, -3.0, 4.0, -3.0]  # floor(x + 1/2), by hand
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize(("role", "spec", "field"), [
    ("weight", QTensorConfig(round_method=RoundType.half_up), "round_method"),
    ("input_tensors", QTensorConfig(round_method=RoundType.half_up, is_dynamic=True,
                                    qscheme=QSchemeType.per_channel), "round_method"),
])
def test_half_up_is_for_static_int_activations_only(role: str, spec: QTensorConfig, field: str) -> None:
    config = Config(QLayerConfig(**{role: spec}))
    with pytest.raises(ConfigError, match=f"global_quant_config.{role}.{field}"):
        ModelQuantizer(config).plan(nn.Sequential(nn.Linear(4, 4)))


def _two_layer_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _half_up_config(scale_type: ScaleType | None) -> Config:
    extra = {"scale_type": scale_type} if scale_type is not None else {}
    activation = QTensorConfig(bit_width=4, round_method=RoundType.half_up, **extra)
    weight = QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel, **extra)
    return Config(QLayerConfig(weight=weight, input_tensors=activation), backend=Backend.graph)


def test_qonnx_file_computes_ties_up_exactly(tmp_path) -> None:
    """Power-of-two scales: the inputs sit on ties of the input quantizer's grid (quarter steps of the digits-like
    grid), PyTorch rounds them up, and qonnx's execution of the written file gives PyTorch's values to the bit;
    the file has no DPU rounding left and an Add in front of every rewritten Quant."""
    model = _two_layer_net()
    x = torch.randint(-16, 16, (64, 8)).float() / 4
    quant = ModelQuantizer(_half_up_config(ScaleType.pof2)).quantize_model(model, [x])
    scale = float(quant.graph_quant__0_input.act_quant.scale().detach())
    ties = x / scale - torch.floor(x / scale) == 0.5
    assert bool(ties.any()), "the inputs must hold exact ties of the input grid for the check to mean anything"
    report = export_qonnx(quant, x, tmp_path / "m.onnx")
    assert report.max_abs_diff == 0.0
    proto = onnx.load(tmp_path / "m.onnx")
    modes = [a.s.decode() for n in proto.graph.node if n.op_type == "Quant" for a in n.attribute
             if a.name == "rounding_mode"]
    assert TIES_UP_MODE not in modes and modes
    assert sum(n.op_type == "Add" and n.name.endswith("_ties_up") for n in proto.graph.node) == 2  # input, ReLU
    with torch.no_grad():
        expected = quant(x).numpy()
    assert np.array_equal(run_qonnx(tmp_path / "m.onnx", x)[0], expected)
    # the input quantizer by hand: floor(x / s + 1/2) * s, clamped to the signed 4-bit codes
    with torch.no_grad():
        codes = quant.graph_quant__0_input(x) / scale
    assert torch.equal(codes, torch.clamp(torch.floor(x / scale + 0.5), -8, 7))


def test_float_scales_are_refused_at_export(tmp_path) -> None:
    model = _two_layer_net()
    x = torch.randn(16, 8)
    quant = ModelQuantizer(_half_up_config(None)).quantize_model(model, [x])
    with pytest.raises(ExportError, match="power-of-two scale"):
        export_qonnx(quant, x, tmp_path / "m.onnx")


def _quant_model(scale: float, relu: bool) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(0.0, np.float32), "z"),
             numpy_helper.from_array(np.array(4.0, np.float32), "b")]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if relu else []
    nodes.append(helper.make_node("Quant", ["r" if relu else "x", "s", "z", "b"], ["y"], name="q",
                                  domain=QONNX_DOMAIN, signed=0 if relu else 1, narrow=0, rounding_mode=TIES_UP_MODE))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits)
    return helper.make_model(graph)


@pytest.mark.parametrize("relu", [False, True])
def test_rewrite_puts_the_offset_in_front_of_the_quant_or_its_relu(relu: bool) -> None:
    model = _quant_model(0.25, relu)
    assert rewrite_ties_up(model) == 1
    nodes = list(model.graph.node)
    add = next(n for n in nodes if n.op_type == "Add")
    first = nodes[1]  # [Add, Relu, Quant] or [Add, Quant]
    assert first.op_type == ("Relu" if relu else "Quant") and first.input[0] == add.output[0]
    assert nodes.index(add) < nodes.index(first)
    offset = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == add.input[1]))
    # per channel (a scalar Add behind FINN's thresholds is taken for a sign bias), one value
    assert offset.shape == (1, 6) and np.all(offset == 0.25 * 2.0 ** -16)
    quant = next(n for n in nodes if n.op_type == "Quant")
    assert next(a.s for a in quant.attribute if a.name == "rounding_mode") == b"ROUND"


def test_rewrite_refuses_a_scale_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ExportError, match="'q'.*power-of-two"):
        rewrite_ties_up(_quant_model(0.3, False))


class _ForkedAccumulator(nn.Module):
    """A convolution's output read by two quantizers (a ReLU's and a residual add's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0, self.conv1 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv0(x)
        return torch.flatten(y + self.conv1(torch.relu(y)), 1)


def test_an_offset_on_a_forked_value_survives_qonnx_cleanups(tmp_path) -> None:
    """At small scales the 2^-16-step offset is below qonnx's identity tolerance (1e-5), and qonnx's
    RemoveIdentityOps would remove the Add by renaming the convolution's output, which its other reader still
    reads. On a forked value the offset is written as Mul(2^16 / s), Add(1), Mul(s / 2^16): still exact (the file
    gives PyTorch's values to the bit), and no constant qonnx takes for an identity."""
    from qonnx.core.modelwrapper import ModelWrapper
    from qonnx.transformation.remove import RemoveIdentityOps

    torch.manual_seed(0)
    x = torch.randn(16, 1, 6, 6) * 0.01
    config = Config(QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel,
                                                      scale_type=ScaleType.pof2_round),
                                 input_tensors=QTensorConfig(bit_width=4, scale_type=ScaleType.pof2_round,
                                                             round_method=RoundType.half_up)),
                    backend=Backend.graph)
    quant = ModelQuantizer(config).quantize_model(_ForkedAccumulator(), [x])
    report = export_qonnx(quant, x, tmp_path / "m.onnx")
    assert report.max_abs_diff == 0.0
    proto = onnx.load(tmp_path / "m.onnx")
    scaled = [n for n in proto.graph.node if n.name.endswith("_ties_up_scale")]
    assert scaled  # a quantizer reading the forked convolution output with an offset below 1e-5
    cleaned = ModelWrapper(proto).transform(RemoveIdentityOps())
    kept = {n.name for n in cleaned.graph.node}
    assert {n.name for n in scaled} <= kept  # (the input's own small Add, which nothing else reads, may go)
    produced = {o for n in cleaned.graph.node for o in n.output} | {i.name for i in cleaned.graph.input} | \
        {i.name for i in cleaned.graph.initializer}
    assert all(name in produced for n in cleaned.graph.node for name in n.input if name)  # no dangling reader
    run_qonnx(cleaned, x)
