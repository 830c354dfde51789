"""Regression tests for models beyond the digits CNN (issue 13): each on the smallest model that showed it.

Layer configurations either work, checked against the float layer run with hand-quantized weights, or are
refused by ``plan()`` with the reason; transformers' attention follows PyTorch's slow path; calibration
input that used to mislead is handled or rejected up front; tied weights, meta-device models, MSE
calibration, the command line's export errors and tracing warnings.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import brevitas.nn as qnn
import pytest
import torch
from torch import nn

from quark_brevitas import ModelQuantizer, load_quantized, save_quantized
from quark_brevitas.backend import DEFAULT_LAYER_MAP, LayerMapping
from quark_brevitas.brevitas_adapter import iter_quantizers, quantization_disabled
from quark_brevitas.cli import main
from quark_brevitas.config import Config, QLayerConfig, QTensorConfig
from quark_brevitas.config.presets import get_preset
from quark_brevitas.container import Container
from quark_brevitas.errors import CalibrationDataError, ConfigError, ModelError
from quark_brevitas.types import Dtype, ParamType, QSchemeType

INT8 = QTensorConfig()
PER_CHANNEL = QTensorConfig(qscheme=QSchemeType.per_channel)


def _weight_only(weight: QTensorConfig) -> Config:
    return Config(QLayerConfig(weight=weight), pre_quant_opt_config=[])


def _hand_int8(weight: torch.Tensor, axis: int | None) -> torch.Tensor:
    """Symmetric int8 (narrow range): scale = max|w| / 127 over the tensor or per index of ``axis``."""
    if axis is None:
        scale = weight.abs().max() / 127
    else:
        dims = [d for d in range(weight.dim()) if d != axis]
        scale = weight.abs().amax(dim=dims, keepdim=True) / 127
    return torch.round(weight / scale).clamp(-127, 127) * scale


def _relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm())


# ===================================================================== layer configurations (item 2)
def _conv_reference(layer: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The float layer's own functional call with ``weight`` in place of its weight."""
    reference = copy.deepcopy(layer)
    reference.weight = nn.Parameter(weight)
    with torch.no_grad():
        return reference(x)


LAYERS: dict[str, tuple[Any, tuple[int, ...], int]] = {
    # name: (builder, input shape, output-channel axis of the weight)
    "linear_3d": (lambda: nn.Linear(16, 8), (2, 3, 16), 0),
    "conv1d_groups_dilation": (lambda: nn.Conv1d(8, 4, 3, groups=2, dilation=2, padding="same"), (2, 8, 9), 0),
    "conv2d_depthwise_reflect": (lambda: nn.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode="reflect"),
                                 (2, 8, 6, 6), 0),
    "conv2d_groups_stride": (lambda: nn.Conv2d(8, 4, 3, stride=2, groups=2), (2, 8, 7, 7), 0),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(8, 4, 3, stride=2, output_padding=1), (2, 8, 5), 1),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(8, 4, 2, stride=2), (2, 8, 5, 5), 1),
    "conv_transpose1d_groups": (lambda: nn.ConvTranspose1d(8, 4, 2, stride=2, groups=2), (2, 8, 5), 1),
    "conv_transpose2d_groups": (lambda: nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2), (2, 8, 5, 5), 1),
    "conv_transpose2d_depthwise": (lambda: nn.ConvTranspose2d(8, 8, 3, groups=8, dilation=2), (2, 8, 5, 5), 1),
}


def _layer_and_input(name: str) -> tuple[nn.Sequential, torch.Tensor, int]:
    build, shape, axis = LAYERS[name]
    torch.manual_seed(0)
    return nn.Sequential(build()).eval(), torch.randn(shape), axis


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_int8_weights_match_hand_quantized_float_layer_or_are_refused(name: str, scheme: str) -> None:
    layer, x, axis = _layer_and_input(name)
    quantizer = ModelQuantizer(_weight_only(PER_CHANNEL if scheme == "per_channel" else INT8))
    grouped_transposed = "transpose" in name and layer[0].groups > 1
    if grouped_transposed and scheme == "per_channel":
        with pytest.raises(ConfigError, match=r"global_quant_config\.weight\.qscheme: module '0': per_channel "
                                              r"weights are not supported for a grouped ConvTranspose"):
            quantizer.plan(layer)
        return
    quantized = quantizer.quantize_model(layer)
    expected = _conv_reference(layer[0], _hand_int8(layer[0].weight.detach(), axis if scheme == "per_channel"
                                                    else None), x)
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("weight", [
    QTensorConfig(dtype=Dtype.int4, qscheme=QSchemeType.per_group, group_size=8, pad_groups=True),  # depthwise: 1 input
    QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3),
    QTensorConfig(dtype=Dtype.fp8_e4m3),
], ids=["int4_g8", "mxfp8", "fp8"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_other_weight_formats_work_on_every_layer_variant(name: str, weight: QTensorConfig) -> None:
    layer, x, _ = _layer_and_input(name)
    config = Config(QLayerConfig(weight=weight, input_tensors=INT8))
    quantized = ModelQuantizer(config).quantize_model(layer, [torch.randn_like(x) for _ in range(2)] + [x])
    with torch.no_grad():
        assert _relative_error(quantized(x), layer(x)) < 0.15


def test_grouped_conv_transpose_refusal_names_the_level_and_a_per_tensor_override_works() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2)).eval()
    config = Config(QLayerConfig(weight=INT8), layer_type_quant_config={"ConvTranspose2d": QLayerConfig(
        weight=PER_CHANNEL)}, pre_quant_opt_config=[])
    with pytest.raises(ConfigError, match=r'layer_type_quant_config\["ConvTranspose2d"\]\.weight\.qscheme'):
        ModelQuantizer(config).plan(model)
    config.layer_quant_config = {"1": QLayerConfig(weight=INT8)}
    quantized = ModelQuantizer(config).quantize_model(model)
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        assert _relative_error(quantized(x), model(x)) < 0.05


@pytest.mark.parametrize("transposed", [nn.ConvTranspose1d, nn.ConvTranspose2d])
def test_batch_norm_after_a_grouped_conv_transpose_is_merged_exactly(transposed: type[nn.Module]) -> None:
    torch.manual_seed(0)
    two_d = transposed is nn.ConvTranspose2d
    bn = nn.BatchNorm2d(4) if two_d else nn.BatchNorm1d(4)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.2, 0.2)
    model = nn.Sequential(transposed(8, 4, 2, stride=2, groups=2, bias=False), bn, nn.ReLU()).eval()
    x = torch.randn((2, 8, 5, 5) if two_d else (2, 8, 5))
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(model, [x])
    assert not any(isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d) for m in quantized.modules())
    with torch.no_grad(), quantization_disabled(quantized):
        torch.testing.assert_close(quantized(x), model(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert _relative_error(quantized(x), model(x)) < 0.05


def test_a_model_that_is_a_single_layer_is_quantized() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8).eval()
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(layer, [torch.randn(4, 16)])
    assert isinstance(quantized, qnn.QuantLinear)


# ===================================================================== attention (item 3)
class Attention(nn.Module):
    """One nn.MultiheadAttention, keys and values sliced to kdim/vdim."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs
        self.attn = nn.MultiheadAttention(16, 4, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = x[..., :self.kwargs.get("kdim", 16)]
        value = x[..., :self.kwargs.get("vdim", 16)]
        return self.attn(x, key, value, need_weights=False)[0]


def _float_attention_with(quant: nn.Module, float_attn: nn.MultiheadAttention) -> nn.MultiheadAttention:
    """``float_attn`` with the quantized attention's (hand-checkable) quantized weights: the slow-path
    reference for weight-only quantization."""
    reference = copy.deepcopy(float_attn)
    weights = [quant.q_proj.quant_weight().value, quant.k_proj.quant_weight().value, quant.v_proj.quant_weight().value]
    with torch.no_grad():
        if reference.in_proj_weight is not None:
            reference.in_proj_weight.copy_(torch.cat(weights))
        else:
            for name, w in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), weights):
                getattr(reference, name).copy_(w)
        reference.out_proj.weight.copy_(quant.out_proj.quant_weight().value)
    return reference


@pytest.mark.parametrize("kwargs", [{}, {"batch_first": True}, {"kdim": 8, "vdim": 12},
                                    {"add_bias_kv": True, "add_zero_attn": True}, {"bias": False}],
                         ids=["plain", "batch_first", "kdim_vdim", "bias_kv_zero_attn", "no_bias"])
def test_multihead_attention_variants_match_the_float_layer_with_quantized_weights(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = Attention(**kwargs).eval()
    x = torch.randn((2, 5, 16) if kwargs.get("batch_first") else (5, 2, 16))
    quantized = ModelQuantizer(_weight_only(PER_CHANNEL)).quantize_model(model)
    attn = quantized.attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
        assert torch.equal(proj.quant_weight().value, _hand_int8(proj.weight.detach(), 0))
    reference = _float_attention_with(attn, model.attn)
    with torch.no_grad():
        expected = reference(x, x[..., :kwargs.get("kdim", 16)], x[..., :kwargs.get("vdim", 16)],
                             need_weights=False)[0]
        torch.testing.assert_close(quantized(x), expected, rtol=1e-5, atol=1e-5)


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def _slow_path_reference(encoder: nn.TransformerEncoder, quantized: nn.Module) -> nn.TransformerEncoder:
    """The float encoder with every weight replaced by its quantized value."""
    reference = copy.deepcopy(encoder)
    for float_layer, quant_layer in zip(reference.layers, quantized.layers):
        float_layer.self_attn = _float_attention_with(quant_layer.self_attn, float_layer.self_attn)
        for name in ("linear1", "linear2"):
            with torch.no_grad():
                getattr(float_layer, name).weight.copy_(getattr(quant_layer, name).quant_weight().value)
    return reference


ENCODER_MASKS = {
    "no_mask": lambda x: {},
    "padding": lambda x: {"src_key_padding_mask": torch.tensor([[False] * 7 + [True] * 3, [False] * 10])},
    "causal": lambda x: {"mask": nn.Transformer.generate_square_subsequent_mask(10), "is_causal": True},
}


@pytest.mark.parametrize("mask", list(ENCODER_MASKS))
def test_transformer_encoder_takes_the_slow_path_with_quantized_weights(mask: str) -> None:
    """In eval + no_grad PyTorch's encoder runs a fused kernel on the raw float weights: the quantized
    model must differ from that fast path and match the slow path run with the quantized weights."""
    encoder = _encoder()
    x = torch.randn(2, 10, 16)
    kwargs = ENCODER_MASKS[mask](x)
    quantized = ModelQuantizer(_weight_only(QTensorConfig(bit_width=4, qscheme=QSchemeType.per_channel))
                               ).quantize_model(encoder)
    reference = _slow_path_reference(encoder, quantized)
    with torch.no_grad():
        fast = encoder(x, **kwargs)
        output = quantized(x, **kwargs)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            expected = reference(x, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    valid = ~kwargs["src_key_padding_mask"] if "src_key_padding_mask" in kwargs else torch.ones(2, 10, dtype=bool)
    torch.testing.assert_close(output[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert float((output[valid] - fast[valid]).abs().max()) > 1e-3, "the quantized encoder returned float results"


@pytest.mark.parametrize("mask", list(ENCODER_MASKS))
def test_transformer_encoder_with_activation_quantization_matches_float_semantics(mask: str) -> None:
    encoder = _encoder()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 10, 16, generator=g) for _ in range(3)]
    kwargs = ENCODER_MASKS[mask](batches[0])
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(
        encoder, batches, batch_to_inputs=lambda batch: ((batch,), kwargs))
    valid = ~kwargs["src_key_padding_mask"] if "src_key_padding_mask" in kwargs else torch.ones(2, 10, dtype=bool)
    with torch.no_grad():
        output, reference = quantized(batches[0], **kwargs), encoder(batches[0], **kwargs)
        with quantization_disabled(quantized):
            unquantized = quantized(batches[0], **kwargs)
    torch.testing.assert_close(unquantized[valid], reference[valid], rtol=1e-5, atol=1e-5)
    assert 1e-4 < _relative_error(output[valid], reference[valid]) < 0.05


def test_transformer_decoder_cross_attention_quantizes() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    decoder = nn.TransformerDecoder(layer, 1).eval()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 6, 16, generator=g), torch.randn(2, 9, 16, generator=g)) for _ in range(3)]
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(
        decoder, batches, batch_to_inputs=lambda batch: (tuple(batch), {}))
    cross = quantized.layers[0].multihead_attn
    assert cross.k_proj.input_quant.scale() is not None
    with torch.no_grad():
        output, reference = quantized(*batches[0]), decoder(*batches[0])
    assert 1e-4 < _relative_error(output, reference) < 0.05


class _BrokenQuantLinear(qnn.QuantLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the quantized layer cannot run this")


def test_a_library_failure_on_good_data_is_a_model_error_not_a_data_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    container = Container()
    container.layer_map.override({**DEFAULT_LAYER_MAP, nn.Linear: LayerMapping(_BrokenQuantLinear)})
    with pytest.raises(ModelError, match="failed on calibration batch 0, which the float model accepts") as info:
        ModelQuantizer(get_preset("w8a8"), container=container).quantize_model(model, [torch.randn(2, 4)])
    assert not isinstance(info.value, CalibrationDataError)
    assert "in module '0'" in str(info.value) and "exclude=['0']" in str(info.value)  # names the layer at fault
    with pytest.raises(CalibrationDataError, match="calibration batch 0"):
        ModelQuantizer(get_preset("w8a8")).quantize_model(model, [torch.randn(2, 5)])  # the data's fault


# ===================================================================== GPTQ leaves no float copies (item 4)
def test_gptq_checkpoint_is_the_size_of_a_round_to_nearest_one(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
    batches = [torch.randn(32, 256) for _ in range(2)]
    sizes = {}
    for preset in ("w8a8", "w4a8_gptq"):
        quantized = ModelQuantizer(get_preset(preset)).quantize_model(model, batches)
        sizes[preset] = (save_quantized(quantized, tmp_path / preset) / "model.safetensors").stat().st_size
        assert not any("weight_orig" in name for name in quantized.state_dict())
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert sizes["w4a8_gptq"] <= 1.02 * sizes["w8a8"], sizes
    assert sizes["w4a8_gptq"] < 1.1 * float_bytes, (sizes, float_bytes)


# ===================================================================== calibration input (item 6)
def test_a_one_shot_generator_feeds_gptq_like_a_list(caplog: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    batches = [torch.randn(8, 16) for _ in range(3)]
    from_list = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(model, batches)
    with caplog.at_level(logging.INFO, logger="quark_brevitas.calibration.data"):
        from_generator = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(model, (b for b in batches))
    assert any("one-shot" in r.message for r in caplog.records)
    with torch.no_grad():
        assert torch.equal(from_generator(batches[0]), from_list(batches[0]))


@pytest.mark.parametrize("loader, message", [
    (torch.randn(8, 16), "single tensor; iterating it would feed the model one row at a time"),
    ({"x": torch.randn(8, 16)}, "single dict"),
], ids=["bare_tensor", "single_dict"])
def test_a_bare_tensor_or_dict_is_rejected_before_anything_runs(loader: Any, message: str) -> None:
    model = nn.Sequential(nn.Linear(16, 4)).eval()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CalibrationDataError, match=message):
        ModelQuantizer(get_preset("w8a8")).quantize_model(model, loader)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def test_batch_to_inputs_calibrates_a_model_with_two_positional_inputs() -> None:
    torch.manual_seed(0)
    model = TwoInputs().eval()
    batches = [(torch.randn(16, 8), 10 * torch.randn(16, 8)) for _ in range(3)]
    with pytest.raises(CalibrationDataError):  # read as (inputs, target): the model misses y
        ModelQuantizer(get_preset("w8a8")).quantize_model(model, batches)
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(
        model, batches, batch_to_inputs=lambda batch: (tuple(batch), {}))
    ratio = float(quantized.b.input_quant.scale() / quantized.a.input_quant.scale())
    assert 5 < ratio < 20, ratio  # y is ten times x: each input calibrated on its own data


# ===================================================================== other rough edges (item 8)
def test_a_meta_device_model_is_refused_before_anything_runs_but_can_be_planned() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    quantizer = ModelQuantizer(get_preset("w8a8"))
    assert [row.name for row in quantizer.plan(model) if row.quantized] == ["0", "2"]
    with pytest.raises(ModelError, match=r"modules on the 'meta' device \(0, 2\).*Load the weights first"):
        quantizer.quantize_model(model, [torch.randn(2, 4)])


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(ids))


@pytest.mark.parametrize("preset, tied", [("w8a8", True), ("w4a8_gptq", False)])
def test_tied_weights_stay_tied_unless_an_algorithm_changes_them(preset: str, tied: bool, tmp_path: Any,
                                                                 caplog: Any) -> None:
    torch.manual_seed(0)
    model = TiedLM().eval()
    ids = [torch.randint(0, 32, (4, 8)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="quark_brevitas.algorithms.ties"):
        quantized = ModelQuantizer(get_preset(preset)).quantize_model(model, ids)
    assert (quantized.lm_head.weight is quantized.embed.weight) is tied
    assert torch.equal(quantized.embed.weight, model.embed.weight)  # the embedding is never changed behind its back
    warned = [r.message for r in caplog.records if "untied" in r.message]
    if tied:
        assert not warned
    else:
        assert len(warned) == 1 and "lm_head.weight" in warned[0] and "embed.weight" in warned[0], warned
        assert not torch.equal(quantized.lm_head.weight, model.embed.weight)
    save_quantized(quantized, tmp_path)
    loaded = load_quantized(model, tmp_path)
    assert (loaded.lm_head.weight is loaded.embed.weight) is tied
    with torch.no_grad():
        assert torch.equal(loaded(ids[0]), quantized(ids[0]))


def test_sampled_mse_calibration_finds_the_scales_of_the_full_search(monkeypatch: Any) -> None:
    """Activations of 16 x 64 x 96 = 98,304 values a batch, more than the 65,536 the search scores."""
    from quark_brevitas import calibration

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 8)).eval()
    batches = [torch.randn(16, 64, 96) * (1 + i) for i in range(3)]
    scales = {}
    original = calibration.sampled_activation_mse
    for mode in ("sampled", "full"):
        if mode == "full":
            monkeypatch.setattr(calibration, "sampled_activation_mse", lambda m: original(m, max_elements=1 << 40))
        for symmetric in (True, False):
            config = Config(QLayerConfig(weight=INT8, input_tensors=QTensorConfig(param_type=ParamType.mse,
                                                                                  symmetric=symmetric)))
            quantized = ModelQuantizer(config).quantize_model(model, batches)
            scales[mode, symmetric] = [float(s.proxy.scale()) for s in iter_quantizers(quantized) if s.kind == "act"]
    assert scales["sampled", True] == scales["full", True]
    assert scales["sampled", False] == scales["full", False]


def test_tracing_shows_no_children_specs_future_warning() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelQuantizer(get_preset("w8a8")).quantize_model(model.eval(), [torch.randn(2, 1, 8, 8)])
    assert not [w for w in caught if "children_specs" in str(w.message)]


class _OptionalInput(nn.Module):
    """``forward(x, y=None)``: a symbolic trace takes ``y`` as given, so the traced graph would always add
    ``b(y)`` (and fail on the calibration batches, which do not give ``y``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.a(x)
        return out if y is None else out + self.b(y)


def test_a_model_with_optional_inputs_is_not_traced_and_keeps_both_call_forms(caplog: Any) -> None:
    torch.manual_seed(0)
    model, x, y = _OptionalInput().eval(), torch.randn(3, 4), torch.randn(3, 4)
    with caplog.at_level("WARNING", logger="quark_brevitas.algorithms.preprocess"):
        quant = ModelQuantizer(get_preset("w8a8")).quantize_model(model, [((x,),), ((x, y),)])
    assert any("optional inputs (y)" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        for args in ((x,), (x, y)):
            expected = model(*args)
            assert (quant(*args) - expected).abs().max() < 0.05 * expected.abs().max()


# ===================================================================== command line (item 8)
@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory: Any, digits_model: nn.Module, digits_data: Any) -> Any:
    from quark_brevitas.cli.digits import example_input

    directory = tmp_path_factory.mktemp("digits_ckpt")
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(digits_model, digits_data.calib)
    save_quantized(quantized, directory, example_input=example_input(digits_data))
    return directory


def _one_line_error(capsys: Any, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    return lines[0]


def test_cli_export_with_a_wrong_input_shape_is_one_line(capsys: Any, digits_checkpoint: Any, tmp_path: Any) -> None:
    line = _one_line_error(capsys, ["-q", "export", str(digits_checkpoint), "--output", str(tmp_path / "a.onnx"),
                                    "--input-shape", "1,3,4,4"])
    assert "--input-shape: the model rejects the example input (random, shape [1, 3, 4, 4])" in line


@pytest.mark.parametrize("spec, message", [
    ("quark_brevitas.cli.digits:DigitsData", "calling it failed (TypeError"),
    ("no_such_module_here:Model", "cannot import it (ModuleNotFoundError"),
    ("quark_brevitas.cli.options:DEFAULT_MODEL", "is a str, not a callable"),
])
def test_cli_export_with_a_bad_model_is_one_line(capsys: Any, digits_checkpoint: Any, tmp_path: Any, spec: str,
                                                 message: str) -> None:
    line = _one_line_error(capsys, ["-q", "export", str(digits_checkpoint), "--output", str(tmp_path / "a.onnx"),
                                    "--model", spec])
    assert message in line, line


def test_cli_export_of_a_checkpoint_of_another_model_is_one_line(capsys: Any, tmp_path: Any) -> None:
    # (dict examples are exported since the Hugging Face export; a checkpoint of a model other than the one
    # --model names must still fail in one line that names both)
    model = nn.Sequential(nn.Linear(64, 10)).eval()
    quantized = ModelQuantizer(get_preset("w8a8")).quantize_model(model, [torch.randn(4, 64)])
    save_quantized(quantized, tmp_path / "ckpt", example_input={"input": torch.randn(1, 64)})
    line = _one_line_error(capsys, ["-q", "export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "a.onnx")])
    assert "does not fit DigitsCNN" in line and "QuantLinear" in line and str(tmp_path / "ckpt") in line


def test_cli_plan_error_names_the_config_file(capsys: Any, tmp_path: Any) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("global_quant_config: {weight: {}}\nlayer_quant_config:\n  fc_1: {weight: {bit_width: 4}}\n")
    line = _one_line_error(capsys, ["-q", "plan", "--config", str(path)])
    assert line.startswith(f"error: {path}: layer_quant_config[\"fc_1\"]: matches no module"), line


def test_gptq_on_a_model_that_is_one_layer() -> None:
    """The GPTQ hook sits on the root module, outside Brevitas's catch inside forward(): it used to escape as a
    raw StopFwdException. On correlated inputs GPTQ must beat round-to-nearest on the calibration data."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 8)
    mixing = torch.randn(64, 64)
    batches = [torch.randn(64, 64) @ mixing for _ in range(4)]
    gptq = ModelQuantizer(get_preset("w4a8_gptq")).quantize_model(layer, batches)
    plain_config = get_preset("w4a8_gptq")
    plain_config.algo_config = []
    plain = ModelQuantizer(plain_config).quantize_model(layer, batches)
    x = torch.cat(batches)
    with torch.no_grad():
        reference = layer(x)
        assert (gptq(x) - reference).pow(2).mean() < 0.8 * (plain(x) - reference).pow(2).mean()
