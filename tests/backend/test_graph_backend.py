"""Backend.graph: whole networks quantized end to end (quark_brevitas.backend.graph), and the FINN readiness check."""

from __future__ import annotations

import onnx
import pytest
import torch
from helpers.graph_zoo import GRAPH_ZOO, input_batch, randomised
from torch import nn

from quark_brevitas import load_quantized, save_quantized
from quark_brevitas.api import ModelQuantizer
from quark_brevitas.backend.graph import GraphBackend, plan_points, points_table
from quark_brevitas.backend.graph.points import QuantPoint
from quark_brevitas.cli import main
from quark_brevitas.config import Backend, Config, QConfig, QLayerConfig, QTensorConfig
from quark_brevitas.config.enums import QSchemeType, QuantizationMode
from quark_brevitas.config.presets import get_preset
from quark_brevitas.container import Container
from quark_brevitas.errors import ConfigError, ModelError
from quark_brevitas.export import ExportError, export_onnx_qcdq, export_qonnx, finn_readiness
from quark_brevitas.export.intweights import integer_weights
from quark_brevitas.qat import prepare_qat

A4 = QTensorConfig(bit_width=4)


def test_container_serves_the_graph_backend() -> None:
    assert isinstance(Container().backends()["graph"], GraphBackend)


def _quantize(name: str, bits: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    x = input_batch(32)
    model = randomised(GRAPH_ZOO[name]())
    return model, ModelQuantizer(get_preset(f"finn_w{bits}a{bits}")).quantize_model(model, [x[:16], x[16:]]), x


def _points(name: str) -> list[QuantPoint]:
    return plan_points(randomised(GRAPH_ZOO[name]()), get_preset("finn_w4a4"))


def test_plan_lists_every_point_with_owner_sign_and_shared_group() -> None:
    points = {p.tensor: p for p in _points("residual_cnn")}
    assert points["x"].kind == "layer_input" and points["x"].signed and points["x"].layers == ("conv0",)
    assert not points["relu0"].signed and points["relu0"].kind == "activation"
    shared = points["add"]
    assert shared.kind == "shared" and set(shared.inputs) == {"relu0", "bn2"} and shared.signed
    assert points["gap"].kind == "requant" and not points["gap"].signed  # an average of ReLU outputs
    assert all(p.spec.bit_width == 4 for p in points.values())
    table = points_table(list(points.values()))
    assert "shared" in table and ("relu0, bn2" in table or "bn2, relu0" in table)


def test_plan_rows_carry_the_graph_points_each_layer_owns() -> None:
    from quark_brevitas.backend import plan_table

    rows = {row.name: row for row in ModelQuantizer(get_preset("finn_w4a4")).plan(GRAPH_ZOO["residual_cnn"]())}
    owned = {name: {(p.tensor, p.kind) for p in row.graph_points} for name, row in rows.items()}
    assert owned["conv0"] == {("x", "layer_input")} and owned["conv1"] == {("relu0", "activation")}
    # the head owns everything behind the residual block: the shared group, its ReLU and the average pool
    assert owned["fc"] == {("relu0", "activation"), ("add", "shared"), ("relu2", "activation"), ("gap", "requant")}
    shared = next(p for p in rows["fc"].graph_points if p.kind == "shared")
    assert set(shared.inputs) == {"relu0", "bn2"} and shared.signed and shared.spec.bit_width == 4
    assert not rows["bn0"].graph_points  # float modules own no point
    every = {(p.tensor, p.kind) for row in rows.values() for p in row.graph_points}
    assert every == {(p.tensor, p.kind) for p in _points("residual_cnn")}  # the rows miss no point
    table = plan_table(list(rows.values()))
    assert "graph points" in table.splitlines()[0] and "add int4 shared(" in table


def test_concat_inputs_share_one_quantizer_and_fork_gets_private_call() -> None:
    points = {(p.tensor, p.kind): p for p in _points("encoder_decoder")}
    shared = points["cat", "shared"]
    assert set(shared.inputs) == {"up", "relu_e"} and not shared.signed  # both inputs are ReLU outputs
    # the concat's output is on the shared grid, but FINN cannot move the two inputs' scales past a Concat:
    # the decoder conv gets its own input quantizer
    assert points["cat", "layer_input"].layers == ("dec",)
    _, quant, _ = _quantize("encoder_decoder", 4)
    code = quant.code
    # relu_e feeds the max-pool (-> mid) and the concat: mid reads its own call of relu_e's quantizer
    assert code.count("self.relu_e(") == 2 and code.count("self.graph_quant_cat(") == 2


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("name", sorted(GRAPH_ZOO))
def test_zoo_qonnx_runs_as_pytorch_and_is_finn_ready(name: str, bits: int, tmp_path) -> None:
    _, quant, x = _quantize(name, bits)
    report = export_qonnx(quant, x[:1], tmp_path / "m.onnx")
    with torch.no_grad():
        scale = quant(x[:1]).abs().max().item()
    assert report.max_abs_diff <= 1e-5 * max(scale, 1.0)
    assert finn_readiness(tmp_path / "m.onnx") == []
    model = onnx.load(tmp_path / "m.onnx")
    quants = [n for n in model.graph.node if n.op_type == "Quant"]
    assert len(quants) > len([n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")])


def test_layerwise_file_has_the_findings_the_graph_file_lacks(tmp_path) -> None:
    model = randomised(GRAPH_ZOO["residual_cnn"]())
    x = input_batch(32)
    config = Config(QLayerConfig(weight=A4, input_tensors=A4))
    quant = ModelQuantizer(config).quantize_model(model, [x])
    export_qonnx(quant, x[:1], tmp_path / "layerwise.onnx")
    kinds = {f.kind for f in finn_readiness(tmp_path / "layerwise.onnx")}
    assert "scale_mismatch" in kinds  # the residual add's inputs: one quantized, one float
    assert main(["check", "--target", "finn", str(tmp_path / "layerwise.onnx")]) == 1
    graph = ModelQuantizer(get_preset("finn_w4a4")).quantize_model(model, [x])
    export_qonnx(graph, x[:1], tmp_path / "graph.onnx")
    assert main(["check", "--target", "finn", str(tmp_path / "graph.onnx")]) == 0


@pytest.mark.slow
def test_readiness_names_refused_relu_quantizer(tmp_path) -> None:
    import brevitas.nn as qnn
    from brevitas.quant import Int8ActPerTensorFloat

    model = nn.Sequential(qnn.QuantIdentity(return_quant_tensor=False), nn.Conv2d(1, 2, 1),
                          qnn.QuantReLU(act_quant=Int8ActPerTensorFloat, return_quant_tensor=False)).eval()
    from brevitas.export import export_qonnx as brevitas_qonnx

    brevitas_qonnx(model, torch.randn(1, 1, 4, 4), str(tmp_path / "s.onnx"))
    findings = finn_readiness(tmp_path / "s.onnx")
    assert any(f.kind == "refused_quant" and "unsigned and non-narrow" in f.message for f in findings)
    assert any(f.kind == "float_weight" for f in findings)


def test_quant_mode_fx_graph_mode_selects_graph_backend() -> None:
    config = QConfig(global_quant_config=QLayerConfig(weight=A4, input_tensors=A4),
                     quant_mode=QuantizationMode.fx_graph_mode)
    assert config.backend is Backend.graph
    assert Config.from_dict({**config.to_dict(), "quant_mode": "fx_graph_mode"}).backend is Backend.graph
    with pytest.raises(ConfigError, match="backend"):
        QConfig(global_quant_config=QLayerConfig(weight=A4), quant_mode="fx_graph_mode", backend=Backend.layerwise)


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_untraceable_model_is_a_model_error_at_plan_time() -> None:
    with pytest.raises(ModelError, match="Backend.layerwise") as info:
        ModelQuantizer(get_preset("finn_w8a8")).plan(_Untraceable())
    assert "TraceError" in str(info.value) or "symbolically traced" in str(info.value)


def test_shared_point_with_disagreeing_specs_names_both_layers() -> None:
    config = get_preset("finn_w4a4")
    config.layer_quant_config["conv1"] = QLayerConfig(input_tensors=QTensorConfig(bit_width=8))
    with pytest.raises(ConfigError, match="conv1") as info:
        ModelQuantizer(config).plan(randomised(GRAPH_ZOO["residual_cnn"]()))
    assert "conv0" in str(info.value) or "fc" in str(info.value) or "conv2" in str(info.value)


@pytest.mark.parametrize(("spec", "field"), [
    (QTensorConfig(bit_width=4, symmetric=False), "input_tensors.symmetric"),
    (QTensorConfig(bit_width=8, is_dynamic=True), "input_tensors.is_dynamic"),
])
def test_specs_the_backend_cannot_hold_are_config_errors(spec: QTensorConfig, field: str) -> None:
    config = Config(QLayerConfig(weight=A4, input_tensors=spec), backend=Backend.graph)
    with pytest.raises(ConfigError, match=field):
        ModelQuantizer(config).plan(randomised(GRAPH_ZOO["mlp"]()))


def test_integer_bias_takes_the_scale_of_the_quantizer_upstream() -> None:
    """``bias=QTensorConfig(bit_width=32)`` in graph mode: each layer's bias codes are ``round(b / (s_in * s_w))``
    with ``s_in`` the scale of the point its input comes from (through the max pooling and flatten between),
    computed here by hand, and the layer's input quantizer is that point's (one scale, one calibration)."""
    x = input_batch(32)
    config = Config(QLayerConfig(weight=QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel),
                                 input_tensors=A4, bias=QTensorConfig(bit_width=32)), backend=Backend.graph)
    model = randomised(GRAPH_ZOO["residual_cnn"]())
    quant = ModelQuantizer(config).quantize_model(model, [x[:16], x[16:]])
    assert quant.fc.input_quant is quant.graph_quant_gap.act_quant
    assert quant.conv1.input_quant is quant.relu0.act_quant
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [getattr(quant, name).register_forward_hook(
        lambda module, args, out, name=name: seen.__setitem__(name, (args[0].detach(), out.detach())))
        for name in ("conv0", "conv1", "conv2", "fc")]
    with torch.no_grad():
        quant(x)
    for hook in hooks:
        hook.remove()
    for name, (inputs, output) in seen.items():
        layer = getattr(quant, name)
        with torch.no_grad():
            s_in = layer.input_quant.scale().detach()
            weight = layer.quant_weight()
            s_acc = s_in * weight.scale.detach().reshape(-1)
            bias = torch.round(layer.bias / s_acc) * s_acc  # the integer bias, by hand
            if isinstance(layer, nn.Linear):
                expected = torch.nn.functional.linear(inputs, weight.value, bias)
            else:
                expected = torch.nn.functional.conv2d(inputs, weight.value, bias, layer.stride, layer.padding,
                                                      layer.dilation, layer.groups)
        assert torch.allclose(output, expected, rtol=0, atol=1e-5 * float(expected.abs().max())), name
        assert not torch.equal(bias, layer.bias.detach()), name  # the float bias is not already on the grid


class _SharedLinear(nn.Module):
    """One Linear called on the outputs of two different quantizers (a ReLU and a Tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(x)) + self.fc(torch.tanh(x))


def test_integer_bias_of_a_layer_fed_by_two_quantizers_is_refused() -> None:
    config = Config(QLayerConfig(weight=A4, input_tensors=A4, bias=QTensorConfig(bit_width=32)),
                    backend=Backend.graph)
    with pytest.raises(ConfigError, match="'fc'.*2 quantizers"):
        ModelQuantizer(config).quantize_model(_SharedLinear(), [torch.randn(4, 8)])


def test_output_quantized_only_when_asked() -> None:
    config = get_preset("finn_w8a8")
    _, quant, x = _quantize("mlp", 8)
    assert quant.fc3.output_quant.is_quant_enabled is False
    config.layer_quant_config["fc3"] = QLayerConfig(output_tensors=QTensorConfig())
    quant = ModelQuantizer(config).quantize_model(randomised(GRAPH_ZOO["mlp"]()), [x])
    assert quant.fc3.output_quant.is_quant_enabled


def test_checkpoint_qat_integer_weights_and_qcdq_on_graph_model(tmp_path) -> None:
    model, quant, x = _quantize("residual_cnn", 4)
    save_quantized(quant, tmp_path / "ck", example_input=x[:1])
    rebuilt = load_quantized(randomised(GRAPH_ZOO["residual_cnn"]()), tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(quant(x), rebuilt(x))
    assert set(integer_weights(quant)) == {"conv0", "conv1", "conv2", "fc"}
    report = export_qonnx(quant, x[:1], tmp_path / "q.onnx")  # finn_w4a4 rounds ties up: QONNX, not QCDQ
    assert report.max_abs_diff == 0.0
    with pytest.raises(ExportError, match="QuantizeLinear rounds half to even"):
        export_onnx_qcdq(quant, x[:1], tmp_path / "qcdq.onnx")
    trained = prepare_qat(quant)
    shared = trained.graph_quant_add
    optimizer = torch.optim.SGD(trained.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in shared.parameters()]
    loss = trained(x).square().mean()
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, shared.parameters()))  # the shared scale trains
    assert "graph_quant_add_1" not in dict(trained.named_modules())  # and stays one module for both inputs
