"""The config schema's layer-type completions name the layer map's types.

The config package sits below the backend and loads without torch, so
:data:`quark_brevitas.config.schema.LAYER_TYPE_EXAMPLES` writes the layer map's type names out; this test is
what keeps the two from drifting (a layer added to the map must be added to the list, and the shipped
``config.schema.json`` regenerated with ``python -m quark_brevitas.config.schema``).
"""

from __future__ import annotations

from quark_brevitas.backend import DEFAULT_LAYER_MAP, OPTIONAL_LAYER_MAP
from quark_brevitas.config.model_config import type_name
from quark_brevitas.config.schema import LAYER_TYPE_EXAMPLES, config_json_schema


def test_the_schemas_layer_types_are_the_layer_maps() -> None:
    mapped = {type_name(cls) for cls in DEFAULT_LAYER_MAP} | {".".join(key) for key in OPTIONAL_LAYER_MAP}
    assert set(LAYER_TYPE_EXAMPLES) == mapped, (
        f"config.schema.LAYER_TYPE_EXAMPLES lacks {sorted(mapped - set(LAYER_TYPE_EXAMPLES))} and has "
        f"{sorted(set(LAYER_TYPE_EXAMPLES) - mapped)} beyond the layer map")
    keys = config_json_schema()["properties"]["layer_type_quant_config"]["propertyNames"]
    assert keys["examples"] == sorted(mapped)
