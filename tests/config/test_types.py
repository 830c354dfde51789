"""Every enum and member of reference 000 exists, with string values that serialise."""

from __future__ import annotations

import pytest

from quark_brevitas import types

REFERENCE_000 = {
    "QSchemeType": ["per_tensor", "per_channel", "per_group"],
    "ZeroPointType": ["int32", "float32"],
    "Dtype": ["int8", "uint8", "int4", "uint4", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2",
              "fp6_e2m3", "fp4", "mx", "mx6", "mx9"],
    "ScaleType": ["float", "pof2", "float32", "float16", "bfloat16"],
    "RoundType": ["round", "floor", "half_even"],
    "DeviceType": ["CPU", "IPU"],
    "QuantizationMode": ["eager_mode", "fx_graph_mode"],
    "TQTThresholdInitMeth": ["_3SD", "_LL_J"],
}
#: Members quark_brevitas adds after the reference's (documented in the schema): ``gguf_k`` is the GGUF K-quant scale
#: grid (group scales as small integer multiples of one float16 number per 256 channels); ``gguf_0`` llama.cpp's signed
#: Q4_0 / Q5_0 block scale.
ADDED_000 = {"ScaleType": ["gguf_k", "gguf_0", "pof2_round"], "RoundType": ["half_up"]}


@pytest.mark.parametrize("enum_name", sorted(REFERENCE_000))
def test_enum_members_match_reference(enum_name: str) -> None:
    enum_cls = getattr(types, enum_name)
    assert [m.name for m in enum_cls] == REFERENCE_000[enum_name] + ADDED_000.get(enum_name, [])
    assert all(isinstance(m.value, str) for m in enum_cls)
    assert len({m.value for m in enum_cls}) == len(enum_cls)


def test_brevitas_extension_enums_are_one_object_under_both_modules() -> None:
    """Reference 003's enums live in types (no dependencies) and config re-exports the same classes."""
    import quark_brevitas.config as config

    assert config.QuantType is types.QuantType and config.ParamType is types.ParamType
    assert config.Backend is types.Backend
    assert [m.name for m in types.QuantType] == ["int_quant", "float_quant"]
    assert [m.name for m in types.ParamType] == ["stats", "mse"]
    assert [m.name for m in types.Backend] == ["layerwise", "graph"]  # reference 003's, then Quark's fx_graph_mode
