"""The number-format fields of QTensorConfig: Quark's names and order, the ``dtype`` short form,
every Dtype member supported or rejected with a reason, rejections with field paths, serialisation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from brevitas import nn as qnn

from quark_brevitas.brevitas_adapter import calibration_mode
from quark_brevitas.config import (
    DTYPE_FIELDS,
    MX_ELEMENT_DTYPES,
    REJECTED_DTYPES,
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantType,
    verify_config,
)
from quark_brevitas.config.schema import config_json_schema
from quark_brevitas.errors import ConfigError
from quark_brevitas.quantizers import build_quantizer, verify_spec
from quark_brevitas.types import Dtype, QSchemeType, RoundType, ScaleType, ZeroPointType

PG, PC, PT = QSchemeType.per_group, QSchemeType.per_channel, QSchemeType.per_tensor
FLOAT_Q, INT_Q = QuantType.float_quant, QuantType.int_quant


def test_field_order_keeps_quarks_positional_order():
    names = [f.name for f in dataclasses.fields(QTensorConfig)]
    assert names[:8] == ["qscheme", "symmetric", "scale_type", "quant_type", "param_type", "bit_width",
                         "exponent_bit_width", "mantissa_bit_width"]
    assert names[8:] == ["dtype", "group_size", "ch_axis", "round_method", "is_dynamic", "zero_point_type",
                         "mx_element_dtype", "percentile", "observer_cls", "narrow_range", "pad_groups"]
    assert all(f.default is None for f in dataclasses.fields(QTensorConfig)[8:])
    assert QTensorConfig(PC, False, ScaleType.pof2, INT_Q, ParamType.mse, 4).bit_width == 4


# What each element dtype means, written out (not taken from the table under test).
SHORT_FORMS = {
    Dtype.int8: {"quant_type": INT_Q, "bit_width": 8, "symmetric": True},
    Dtype.int4: {"quant_type": INT_Q, "bit_width": 4, "symmetric": True},
    Dtype.uint8: {"quant_type": INT_Q, "bit_width": 8, "symmetric": False},
    Dtype.uint4: {"quant_type": INT_Q, "bit_width": 4, "symmetric": False},
    Dtype.fp8_e4m3: {"quant_type": FLOAT_Q, "bit_width": 8, "exponent_bit_width": 4, "mantissa_bit_width": 3},
    Dtype.fp8_e5m2: {"quant_type": FLOAT_Q, "bit_width": 8, "exponent_bit_width": 5, "mantissa_bit_width": 2},
    Dtype.fp6_e3m2: {"quant_type": FLOAT_Q, "bit_width": 6, "exponent_bit_width": 3, "mantissa_bit_width": 2},
    Dtype.fp6_e2m3: {"quant_type": FLOAT_Q, "bit_width": 6, "exponent_bit_width": 2, "mantissa_bit_width": 3},
    Dtype.fp4: {"quant_type": FLOAT_Q, "bit_width": 4, "exponent_bit_width": 2, "mantissa_bit_width": 1},
}
#: The element formats of OCP MX, in the order the library lists them.
MX_ELEMENTS = (Dtype.int8, Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp4)


@pytest.mark.parametrize(("dtype", "expected"), SHORT_FORMS.items(), ids=lambda v: getattr(v, "name", None))
def test_dtype_short_form_sets_the_fields(dtype, expected):
    spec = QTensorConfig(dtype=dtype)
    resolved = spec.resolved()
    assert {k: getattr(resolved, k) for k in expected} == expected
    assert resolved.dtype is dtype
    long_form = QTensorConfig(**expected)
    for role in ("weight", "input_tensors"):
        verify_spec(spec, role, role)
        # The short form builds exactly the long form's quantizer.
        _assert_same_quantizer(spec, long_form, role)
    # Agreeing explicit fields are fine; the other granularities combine freely.
    verify_spec(QTensorConfig(dtype=dtype, qscheme=PC, **expected), "weight", "w")
    verify_spec(QTensorConfig(dtype=dtype, qscheme=PG, group_size=32), "weight", "w")


def _quantized(spec: QTensorConfig, role: str) -> tuple:
    """What a layer built with ``spec`` makes of fixed data: the quantized tensor's type, values, scale and
    zero point (a QuantLinear's weight, or its input after calibration on the same data)."""
    torch.manual_seed(0)
    data = torch.randn(8, 64) * 3
    if role == "weight":
        layer = qnn.QuantLinear(64, 16, bias=False, weight_quant=build_quantizer(spec, role))
        quant = layer.quant_weight()
    else:
        layer = qnn.QuantLinear(64, 16, bias=False, input_quant=build_quantizer(spec, role))
        with torch.no_grad(), calibration_mode(layer):
            layer(data)
        layer.eval()
        with torch.no_grad():
            quant = layer.input_quant(data)
    return type(quant), quant.value, quant.scale, quant.zero_point


def _assert_same_quantizer(short: QTensorConfig, long: QTensorConfig, role: str) -> None:
    """Same Brevitas quantizer class (the table row) and bit-identical results on the same data."""
    assert build_quantizer(short, role).__bases__ == build_quantizer(long, role).__bases__, role
    short_type, *short_tensors = _quantized(short, role)
    long_type, *long_tensors = _quantized(long, role)
    assert short_type is long_type, role
    for a, b in zip(short_tensors, long_tensors, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), role


def test_mx_element_formats_are_ocp_mx():
    assert MX_ELEMENT_DTYPES == MX_ELEMENTS


@pytest.mark.parametrize("element", MX_ELEMENTS, ids=lambda d: d.name)
def test_mx_short_form(element):
    expected = SHORT_FORMS[element]
    spec = QTensorConfig(dtype=Dtype.mx, mx_element_dtype=element)
    resolved = spec.resolved()
    assert (resolved.qscheme, resolved.group_size, resolved.scale_type, resolved.symmetric) == (
        PG, 32, ScaleType.pof2, True)
    assert {name: getattr(resolved, name) for name in expected} == expected
    long_form = QTensorConfig(qscheme=PG, group_size=32, scale_type=ScaleType.pof2, **expected)
    for role in ("weight", "input_tensors", "output_tensors"):
        verify_spec(spec, role, role)
        verify_spec(long_form, role, role)
    for role in ("weight", "input_tensors"):
        _assert_same_quantizer(spec, long_form, role)
    assert spec.short().startswith("mx") and "g32" in spec.short()


@pytest.mark.parametrize("dtype", list(Dtype), ids=lambda d: d.name)
def test_every_dtype_member_is_supported_or_rejected_with_a_reason(dtype):
    spec = QTensorConfig(dtype=dtype, mx_element_dtype=Dtype.fp4 if dtype is Dtype.mx else None)
    if dtype in REJECTED_DTYPES:
        with pytest.raises(ConfigError) as info:
            verify_spec(spec, "weight", "w")
        assert info.value.path == "w.dtype"
        message = str(info.value)
        assert f"{dtype.name} is not supported" in message
        assert ("cast" in message) if dtype in (Dtype.bfloat16, Dtype.float16) else ("micro-exponent" in message)
    else:
        verify_spec(spec, "weight", "w")
        assert build_quantizer(spec, "weight") is not None
    assert set(REJECTED_DTYPES) | set(DTYPE_FIELDS) | {Dtype.mx} == set(Dtype)


CONTRADICTIONS = [
    (QTensorConfig(dtype=Dtype.int4, bit_width=6), "bit_width", "dtype=int4 means bit_width=4"),
    (QTensorConfig(dtype=Dtype.int8, quant_type=FLOAT_Q), "quant_type", "int_quant"),
    (QTensorConfig(dtype=Dtype.fp8_e4m3, exponent_bit_width=5), "exponent_bit_width", "exponent_bit_width=4"),
    (QTensorConfig(dtype=Dtype.fp4, bit_width=6), "bit_width", "bit_width=4"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, group_size=64), "group_size", "group_size=32"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8, qscheme=PC), "qscheme", "per_group"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8, symmetric=False), "symmetric", "True"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8, bit_width=4), "bit_width", "bit_width=8"),
    (QTensorConfig(dtype=Dtype.mx), "mx_element_dtype", "allowed"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.uint8), "mx_element_dtype", "fp8_e4m3"),
    (QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.mx), "mx_element_dtype", "int8"),
    (QTensorConfig(mx_element_dtype=Dtype.fp4), "mx_element_dtype", "dtype=mx"),
    (QTensorConfig(dtype=Dtype.int8, mx_element_dtype=Dtype.fp4), "mx_element_dtype", "dtype=mx"),
]


@pytest.mark.parametrize(("spec", "field", "needle"), CONTRADICTIONS,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(CONTRADICTIONS)])
def test_contradicting_fields_are_config_errors(spec, field, needle):
    with pytest.raises(ConfigError) as info:
        verify_spec(spec, "weight", "global_quant_config.weight")
    assert info.value.path == f"global_quant_config.weight.{field}"
    assert needle in str(info.value)
    with pytest.raises(ConfigError):
        verify_config(Config(QLayerConfig(weight=spec)))


REJECTED = [
    # (spec, role, field, needle)
    (QTensorConfig(group_size=32), "weight", "group_size", "only used with qscheme=per_group"),
    (QTensorConfig(qscheme=PG, group_size=1), "weight", "group_size", ">= 2"),
    (QTensorConfig(qscheme=PC, ch_axis=1), "weight", "ch_axis", "allowed: None, 0"),
    (QTensorConfig(qscheme=PG, group_size=32, ch_axis=0), "weight", "ch_axis", "allowed: None, 1"),
    (QTensorConfig(ch_axis=0), "weight", "ch_axis", "allowed: None"),
    (QTensorConfig(qscheme=PG, group_size=32, is_dynamic=True, ch_axis=-1), "input_tensors", "ch_axis", "follow"),
    (QTensorConfig(is_dynamic=True), "weight", "is_dynamic", "activations"),
    (QTensorConfig(qscheme=PC), "input_tensors", "qscheme", "is_dynamic=True"),
    (QTensorConfig(qscheme=PG, group_size=32, is_dynamic=False), "input_tensors", "is_dynamic", "dynamic"),
    (QTensorConfig(qscheme=PG, group_size=32, symmetric=False), "input_tensors", "symmetric", "asymmetric"),
    (QTensorConfig(qscheme=PG, group_size=32, scale_type=ScaleType.pof2, symmetric=False), "weight", "symmetric",
     "OCP MX"),
    (QTensorConfig(qscheme=PG, group_size=32, scale_type=ScaleType.pof2, param_type=ParamType.mse), "weight",
     "param_type", "max|block|"),
    (QTensorConfig(is_dynamic=True, param_type=ParamType.mse), "input_tensors", "param_type", "stats"),
    (QTensorConfig(percentile=99.9), "weight", "percentile", "static activations"),
    (QTensorConfig(percentile=99.9, is_dynamic=True), "input_tensors", "percentile", "static activations"),
    (QTensorConfig(percentile=99.9, param_type=ParamType.mse), "input_tensors", "percentile", "static"),
    (QTensorConfig(percentile=0), "input_tensors", "percentile", "(0, 100]"),
    (QTensorConfig(percentile=100.5), "input_tensors", "percentile", "(0, 100]"),
    (QTensorConfig(percentile=True), "input_tensors", "percentile", "number"),
    (QTensorConfig(zero_point_type=ZeroPointType.float32), "weight", "zero_point_type", "asymmetric"),
    (QTensorConfig(dtype=Dtype.fp8_e4m3, zero_point_type=ZeroPointType.int32), "weight", "zero_point_type",
     "no zero point"),
    (QTensorConfig(symmetric=False, qscheme=PG, group_size=32, zero_point_type=ZeroPointType.float32), "weight",
     "zero_point_type", "int32"),
    (QTensorConfig(qscheme=PG, group_size=32, bit_width=12, is_dynamic=True), "input_tensors", "bit_width", "2..8"),
    (QTensorConfig(dtype="int4"), "weight", "dtype", "Dtype"),
    (QTensorConfig(round_method="floor"), "weight", "round_method", "RoundType"),
    (QTensorConfig(is_dynamic=1), "input_tensors", "is_dynamic", "True, False or None"),
    (QTensorConfig(group_size=32.0), "weight", "group_size", "integer"),
    (QTensorConfig(bit_width=32, dtype=Dtype.int8), "bias", "dtype", "only bit_width"),
    (QTensorConfig(bit_width=32, round_method=RoundType.floor), "bias", "round_method", "only bit_width"),
]


@pytest.mark.parametrize(("spec", "role", "field", "needle"), REJECTED,
                         ids=[f"{i}-{r[1]}-{r[2]}" for i, r in enumerate(REJECTED)])
def test_new_fields_are_checked_with_paths(spec, role, field, needle):
    with pytest.raises(ConfigError) as info:
        verify_spec(spec, role, "layer.x")
    assert info.value.path == f"layer.x.{field}"
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "layer",
    [
        QLayerConfig(weight=QTensorConfig(qscheme=PG, group_size=32), input_tensors=QTensorConfig(),
                     bias=QTensorConfig(bit_width=32)),
        QLayerConfig(weight=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.int8), input_tensors=QTensorConfig(),
                     bias=QTensorConfig(bit_width=32)),
        QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(is_dynamic=True),
                     bias=QTensorConfig(bit_width=32)),
        QLayerConfig(weight=QTensorConfig(), input_tensors=QTensorConfig(dtype=Dtype.fp8_e4m3),
                     bias=QTensorConfig(bit_width=32)),
    ],
    ids=["per_group weight", "mx weight", "dynamic input", "fp8 input via dtype"],
)
def test_bias_needs_static_per_tensor_input_and_per_channel_weight_scales(layer):
    with pytest.raises(ConfigError) as info:
        verify_config(Config(layer))
    assert info.value.path == "global_quant_config.bias"


def test_accepted_granularities_and_options():
    accepted = [
        (QTensorConfig(qscheme=PC, ch_axis=0), "weight"),
        (QTensorConfig(qscheme=PG, group_size=128, ch_axis=1, bit_width=4), "weight"),
        (QTensorConfig(qscheme=PG, group_size=32, symmetric=False, bit_width=3, param_type=ParamType.mse), "weight"),
        (QTensorConfig(is_dynamic=True), "input_tensors"),
        (QTensorConfig(is_dynamic=True, symmetric=False), "input_tensors"),
        (QTensorConfig(qscheme=PC, is_dynamic=True), "input_tensors"),
        (QTensorConfig(dtype=Dtype.fp8_e4m3, qscheme=PC, is_dynamic=True), "output_tensors"),
        (QTensorConfig(qscheme=PG, group_size=16), "input_tensors"),
        (QTensorConfig(percentile=99.0), "input_tensors"),
        (QTensorConfig(percentile=100, symmetric=False), "input_tensors"),
        (QTensorConfig(dtype=Dtype.fp8_e4m3, percentile=99.9), "input_tensors"),
        (QTensorConfig(symmetric=False, zero_point_type=ZeroPointType.float32), "weight"),
        (QTensorConfig(symmetric=False, zero_point_type=ZeroPointType.float32), "input_tensors"),
        (QTensorConfig(zero_point_type=ZeroPointType.int32), "weight"),
        (QTensorConfig(round_method=RoundType.floor, dtype=Dtype.fp6_e3m2), "weight"),
        (QTensorConfig(round_method=RoundType.round), "input_tensors"),
    ]
    for spec, role in accepted:
        verify_spec(spec, role, role)
        assert build_quantizer(spec, role) is not None


def test_short_names():
    assert QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=128).short() == "int4 per_group g128 sym stats"
    assert QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4).short() == "mxfp4_e2m1 g32"
    assert QTensorConfig(dtype=Dtype.uint8, is_dynamic=True, qscheme=PC).short() == \
        "int8 per_channel asym stats dynamic"
    assert QTensorConfig(round_method=RoundType.floor, percentile=99.0).short() == "int8 per_tensor sym stats floor p99"


def _full_config() -> Config:
    return Config(
        QLayerConfig(
            weight=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp6_e2m3, round_method=RoundType.half_even),
            input_tensors=QTensorConfig(dtype=Dtype.uint8, percentile=99.5, zero_point_type=ZeroPointType.float32),
            output_tensors=QTensorConfig(qscheme=PC, is_dynamic=True, round_method=RoundType.round),
        ),
        layer_quant_config={"fc1": QLayerConfig(weight=QTensorConfig(dtype=Dtype.int4, qscheme=PG, group_size=32,
                                                                      ch_axis=1))},
        pre_quant_opt_config=[],
    )


def test_new_fields_round_trip_through_dict_json_yaml_and_validate_against_the_schema():
    config = _full_config()
    verify_config(config)
    data = config.to_dict()
    assert data["global_quant_config"]["weight"]["mx_element_dtype"] == "fp6_e2m3"
    assert data["global_quant_config"]["input_tensors"]["zero_point_type"] == "float32"
    assert Config.from_dict(data) == config
    assert Config.from_json(config.to_json()) == config
    assert Config.from_yaml(config.to_yaml()) == config
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(config_json_schema()).validate(json.loads(config.to_json()))
    spec_schema = config_json_schema()["$defs"]["QuantizationSpec"]["properties"]
    assert spec_schema["dtype"]["anyOf"][0]["enum"] == [d.name for d in Dtype]
    assert spec_schema["percentile"]["type"] == ["number", "null"]
    assert "MX" in spec_schema["scale_type"]["description"]


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("dtype", "int5", "not a Dtype"),
        ("mx_element_dtype", "fp5", "not a Dtype"),
        ("round_method", "ceil", "not a RoundType"),
        ("zero_point_type", "int8", "not a ZeroPointType"),
        ("is_dynamic", "yes", "true or false"),
        ("percentile", "99", "number"),
        ("group_size", 3.5, "integer"),
    ],
)
def test_from_dict_rejects_bad_values_of_new_fields(key, value, needle):
    data = {"global_quant_config": {"weight": {key: value}}}
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert info.value.path == f"global_quant_config.weight.{key}"
    assert needle in str(info.value)


def test_from_dict_accepts_yaml_style_short_forms():
    text = """
global_quant_config:
  weight: {dtype: mx, mx_element_dtype: fp8_e4m3}
  input_tensors: {dtype: fp8_e5m2, is_dynamic: true}
"""
    config = Config.from_yaml(text)
    assert config.global_quant_config.weight.resolved().group_size == 32
    assert config.global_quant_config.input_tensors.resolved().exponent_bit_width == 5


def test_layer_dependent_activation_schemes_are_checked_per_module():
    from torch import nn

    from quark_brevitas.api import ModelQuantizer

    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2))
    per_token = QLayerConfig(input_tensors=QTensorConfig(qscheme=PC, is_dynamic=True))
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(Config(per_token, pre_quant_opt_config=[])).plan(conv)
    assert info.value.path == "global_quant_config.input_tensors"
    assert "'0' (Conv2d)" in str(info.value) and "Linear" in str(info.value)
    # Per token on the Linear only: fine.
    ModelQuantizer(Config(QLayerConfig(weight=QTensorConfig()), layer_type_quant_config={"Linear": per_token},
                          pre_quant_opt_config=[])).plan(conv)

    attention = nn.Sequential(nn.MultiheadAttention(32, 2))
    grouped = QLayerConfig(input_tensors=QTensorConfig(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3))
    with pytest.raises(ConfigError, match="MultiheadAttention.*per_group / MX activations"):
        ModelQuantizer(Config(grouped, pre_quant_opt_config=[])).plan(attention)
