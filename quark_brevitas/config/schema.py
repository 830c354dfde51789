"""The JSON Schema of config files, generated from the config dataclasses and enums.

Config files are meant to be written by hand, so editors should validate and complete them. The
schema is derived from :class:`~quark_brevitas.config.Config` and its parts by the same walk over their
annotations that reads and writes config files (:mod:`quark_brevitas.config.serialization`): field types,
defaults, enum names, the registered algorithms, and the ``- ``field``: text`` lines of the
docstrings as descriptions. So it cannot drift from the code: ``quark_brevitas/config.schema.json``
is written by ``python -m quark_brevitas.config.schema`` and a test checks it equals
:func:`config_json_schema`. Point an editor at it, e.g. in a YAML file::

    # yaml-language-server: $schema=<path to quark_brevitas>/config.schema.json

The schema covers structure, types and allowed names. What depends on combinations (bit widths per
tensor role, bias needing input and weight quantization, layer names existing in the model) is
checked by :func:`~quark_brevitas.config.verify_config` and :mod:`quark_brevitas.resolve`.

The layer types editors complete are :data:`LAYER_TYPE_EXAMPLES`, the type names of the library's layer map
(:mod:`quark_brevitas.backend`). They are written out here because the config package sits below the backend and
loads without torch; a backend test checks that the list and the layer map name the same types.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from quark_brevitas.config.model_config import READABLE_FORMAT_VERSIONS, Config
from quark_brevitas.config.serialization import VERSION_KEY, Hint, field_hints, tag_default, tag_names, to_plain

__all__ = ["LAYER_TYPE_EXAMPLES", "SCHEMA_PATH", "config_json_schema", "write_schema"]

#: The schema file shipped inside the package.
SCHEMA_PATH = Path(__file__).parent.with_name("config.schema.json")

#: The layer types of the library's layer map as ``layer_type_quant_config`` keys name them: the default map's
#: classes by ``model_config.type_name``, the optional packages' layers by module path and class (listed whether
#: or not the package is installed where the schema is generated). tests/backend checks it against the layer map.
LAYER_TYPE_EXAMPLES: tuple[str, ...] = (
    "Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d", "Embedding", "Linear", "MultiheadAttention",
    "transformers.pytorch_utils.Conv1D",
)

_JSON_TYPES = {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}
#: The package whose algorithms the shipped schema lists.
_PACKAGE = Config.__module__.partition(".")[0]
_BULLET = re.compile(r"^- (?P<names>(?:``\w+``(?: / )?)+): (?P<text>.*)$")


def _plain(text: str) -> str:
    """Docstring RST as editor text: ``x`` and :func:`x` become `x`."""
    return re.sub(r":\w+:`~?", "`", text).replace("``", "`")


def _description(cls: type) -> str:
    """The prose of a class docstring (its paragraphs that are not ``- ``field``: text`` lists), on one line."""
    paragraphs = [" ".join(p.split()) for p in (cls.__doc__ or "").strip().split("\n\n")]
    return _plain(" ".join(p for p in paragraphs if p and not p.startswith("- ")))


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


def _type_schema(hint: Hint, defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for a parsed annotation; dataclasses go to ``defs`` once and are referenced."""
    kind = hint.kind
    schema: dict[str, Any]
    if kind in _JSON_TYPES:
        schema = {"type": _JSON_TYPES[kind], **({"minLength": 1} if hint.text else {})}
    elif kind == "enum":
        schema = {"enum": [member.name for member in hint.cls]}  # type: ignore[union-attr]
    elif kind == "list":
        schema = {"type": "array", "items": _type_schema(hint.args[0], defs)}
    elif kind == "dict":
        schema = {"type": "object", "propertyNames": _type_schema(hint.args[0], defs),
                  "additionalProperties": _type_schema(hint.args[1], defs)}
    elif kind == "dataclass":
        schema = {"$ref": f"#/$defs/{_define(hint, defs)}"}
    else:
        schema = {}
    if not hint.nullable:
        return schema
    if isinstance(schema.get("type"), str) and len(schema) == 1:
        return {"type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _define(hint: Hint, defs: dict[str, Any]) -> str:
    """Add the definition of a dataclass (or, for a polymorphic base, of each of the library's subclasses
    and of the base as their ``oneOf``) to ``defs``; return its name."""
    cls = hint.cls
    assert cls is not None
    if cls.__name__ in defs:
        return cls.__name__
    if hint.polymorphic is None:
        defs[cls.__name__] = {}  # reserved first: a dataclass may refer to itself
        defs[cls.__name__] = _object_schema(cls, defs)
        return cls.__name__
    tag = hint.polymorphic.tag
    # Only the library's own classes: the shipped file must not depend on what else was imported.
    classes = hint.polymorphic.classes(cls).values()  # a class found by two names (an alias) is listed once
    library = list(dict.fromkeys(c for c in classes if c.__module__.partition(".")[0] == _PACKAGE))
    defs[cls.__name__] = {"oneOf": [{"$ref": f"#/$defs/{c.__name__}"} for c in library]}
    for sub in library:
        schema = _object_schema(sub, defs)
        own = tag_default(sub, tag)  # Quark's LLM configs: the tag is their own field, e.g. name = "awq"
        tag_schema = {"const": sub.__name__} if own is None else \
            {**schema["properties"][tag], "enum": [*tag_names(sub, tag)[1:], sub.__name__]}
        tag_schema.pop("type", None)
        schema["properties"] = {tag: tag_schema, **{k: v for k, v in schema["properties"].items() if k != tag}}
        schema["required"] = [tag, *schema.get("required", [])]
        defs[sub.__name__] = schema
    return cls.__name__


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    """An object with one property per field: its type, docstring description and default."""
    docs = _field_docs(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f, hint in field_hints(cls):
        prop = _type_schema(hint, defs)
        if f.name in docs:
            prop = {"description": docs[f.name], **prop}
        if f.default is not MISSING:
            prop["default"] = to_plain(f.default, hint)
        elif f.default_factory is not MISSING:
            prop["default"] = to_plain(f.default_factory(), hint)
        else:
            required.append(f.name)
        properties[f.name] = prop
    schema: dict[str, Any] = {"type": "object", "description": _description(cls), "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`Config.to_dict` output and of config files.

    It lists the library's algorithms only; a config using an algorithm class defined elsewhere still
    loads with :meth:`Config.from_dict`, but an editor will flag it.
    """
    defs: dict[str, Any] = {}
    root = _object_schema(Config, defs)
    versions = list(READABLE_FORMAT_VERSIONS)
    root["properties"] = {
        VERSION_KEY: {"description": f"the format of this file: {versions[-1]} is written; files without it are "
                                     "format 1. A newer format than this release knows is an error.",
                      "enum": versions, "default": versions[-1]},
        **root["properties"],
    }
    # Editors complete layer types from the layers the library knows how to quantize.
    type_keys = root["properties"]["layer_type_quant_config"]["propertyNames"]
    type_keys["examples"] = sorted(LAYER_TYPE_EXAMPLES)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "quark_brevitas Config",
        **root,
        "description": root["description"] + " Generated by `python -m quark_brevitas.config.schema`.",
        "$defs": defs,
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
