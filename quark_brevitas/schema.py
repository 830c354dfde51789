"""The JSON Schema of config files, generated from the config dataclasses and enums.

Config files are meant to be written by hand, so editors should validate and complete them. The
schema is derived from :class:`~quark_brevitas.config.Config` and its parts (field types,
defaults, enum names, the registered algorithms, and the ``- ``field``: text`` lines of their
docstrings as descriptions), so it cannot drift from the code: ``quark_brevitas/config.schema.json``
is written by ``python -m quark_brevitas.schema`` and a test checks it equals
:func:`config_json_schema`. Point an editor at it, e.g. in a YAML file::

    # yaml-language-server: $schema=<path to quark_brevitas>/config.schema.json

The schema covers structure, types and allowed names. What depends on combinations (bit widths per
tensor role, bias needing input and weight quantization, layer names existing in the model) is
checked by :func:`~quark_brevitas.config.verify_config` and :mod:`quark_brevitas.resolve`.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any

from quark_brevitas import algos
from quark_brevitas.config import Config, QuantizationConfig, QuantizationSpec, type_name

__all__ = ["SCHEMA_PATH", "config_json_schema", "write_schema"]

#: The schema file shipped inside the package.
SCHEMA_PATH = Path(__file__).with_name("config.schema.json")

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_BULLET = re.compile(r"^- (?P<names>(?:``\w+``(?: / )?)+): (?P<text>.*)$")


def _plain(text: str) -> str:
    """Docstring RST as editor text: ``x`` and :func:`x` become `x`."""
    return re.sub(r":\w+:`~?", "`", text).replace("``", "`")


def _description(cls: type) -> str:
    """The first paragraph of a class docstring, on one line."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return _plain(" ".join(doc.split()))


def _field_docs(cls: type) -> dict[str, str]:
    """Descriptions from the ``- ``field``: text`` bullet lines of a class docstring."""
    docs: dict[str, str] = {}
    current: list[str] = []
    for raw in (cls.__doc__ or "").splitlines():
        line = raw.strip()
        match = _BULLET.match(line)
        if match:
            current = re.findall(r"``(\w+)``", match["names"])
            for name in current:
                docs[name] = match["text"]
        elif current and line and not line.startswith("- "):
            for name in current:
                docs[name] += " " + line
        else:
            current = []
    return {name: _plain(text) for name, text in docs.items()}


def _type_schema(hint: Any) -> dict[str, Any]:
    """JSON Schema for a field's type hint (enums by member name, ``X | None`` as nullable)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [_type_schema(arg) for arg in args if arg is not type(None)]
        nullable = type(None) in args
        if len(options) == 1 and "type" in options[0] and nullable:
            return {**options[0], "type": [options[0]["type"], "null"]}
        return {"anyOf": options + ([{"type": "null"}] if nullable else [])}
    if isinstance(hint, type) and issubclass(hint, Enum):
        return {"enum": [member.name for member in hint]}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}


def _dataclass_properties(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    properties: dict[str, Any] = {}
    for f in fields(cls):
        prop = _type_schema(hints[f.name])
        if f.name in docs:
            prop = {"description": docs[f.name], **prop}
        if f.default is not MISSING:
            prop["default"] = f.default.name if isinstance(f.default, Enum) else f.default
        properties[f.name] = prop
    return properties


def _spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": _description(QuantizationSpec),
        "properties": _dataclass_properties(QuantizationSpec),
        "additionalProperties": False,
    }


def _layer_schema() -> dict[str, Any]:
    spec_or_null = {"anyOf": [{"$ref": "#/$defs/QuantizationSpec"}, {"type": "null"}]}
    roles = [f.name for f in fields(QuantizationConfig)]
    return {
        "type": "object",
        "description": _description(QuantizationConfig) + " In layer_type_quant_config and layer_quant_config "
        "a null (or absent) tensor defers to the next level up.",
        "properties": {role: {**spec_or_null, "default": None} for role in roles},
        "additionalProperties": False,
    }


def _algorithm_schema(cls: type) -> dict[str, Any]:
    return {
        "type": "object",
        "description": _description(cls),
        "properties": {"name": {"const": cls.__name__}, **_dataclass_properties(cls)},
        "required": ["name"],
        "additionalProperties": False,
    }


def _library_algorithms(base: type) -> list[type]:
    # Only the library's own algorithms: the shipped file must not depend on what else was imported.
    return sorted((cls for cls in algos.registered(base) if cls.__module__ == algos.__name__),
                  key=lambda cls: cls.__name__)


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`Config.to_dict` output and of config files.

    It lists the library's algorithms only; a config using an algorithm class defined elsewhere still
    loads with :meth:`Config.from_dict`, but an editor will flag it.
    """
    from quark_brevitas.backend import DEFAULT_LAYER_MAP

    pre, post = _library_algorithms(algos.PreQuantOptConfig), _library_algorithms(algos.AlgoConfig)
    layer_ref = {"$ref": "#/$defs/QuantizationConfig"}
    config_docs = _field_docs(Config)
    layer_types = sorted(type_name(cls) for cls in DEFAULT_LAYER_MAP)
    properties: dict[str, Any] = {
        "global_quant_config": layer_ref,
        "pre_quant_opt_config": {"type": "array", "items": {"$ref": "#/$defs/PreQuantOptConfig"},
                                 "default": [{"name": "Preprocess"}]},
        "algo_config": {"type": "array", "items": {"$ref": "#/$defs/AlgoConfig"}, "default": []},
        "backend": {**_type_schema(typing.get_type_hints(Config)["backend"]), "default": "layerwise"},
        "layer_type_quant_config": {"type": "object", "propertyNames": {"minLength": 1, "examples": layer_types},
                                    "additionalProperties": layer_ref, "default": {}},
        "layer_quant_config": {"type": "object", "propertyNames": {"minLength": 1},
                               "additionalProperties": layer_ref, "default": {}},
        "exclude": {"type": "array", "items": {"type": "string", "minLength": 1}, "default": []},
    }
    for name, prop in properties.items():
        if name in config_docs:
            properties[name] = {"description": config_docs[name], **prop}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "quark_brevitas Config",
        "description": _description(Config) + " Generated by `python -m quark_brevitas.schema`.",
        "type": "object",
        "properties": properties,
        "required": ["global_quant_config"],
        "additionalProperties": False,
        "$defs": {
            "QuantizationSpec": _spec_schema(),
            "QuantizationConfig": _layer_schema(),
            "PreQuantOptConfig": {"oneOf": [{"$ref": f"#/$defs/{cls.__name__}"} for cls in pre]},
            "AlgoConfig": {"oneOf": [{"$ref": f"#/$defs/{cls.__name__}"} for cls in post]},
            **{cls.__name__: _algorithm_schema(cls) for cls in [*pre, *post]},
        },
    }


def schema_text() -> str:
    """The schema as the shipped file holds it."""
    return json.dumps(config_json_schema(), indent=2) + "\n"


def write_schema(path: str | Path = SCHEMA_PATH) -> Path:
    """Write the schema to ``path`` (default: the file shipped in the package) and return the path."""
    path = Path(path)
    path.write_text(schema_text())
    return path


if __name__ == "__main__":
    target = write_schema(sys.argv[1] if len(sys.argv) > 1 else SCHEMA_PATH)
    sys.stderr.write(f"wrote {target}\n")
