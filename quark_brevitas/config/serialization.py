"""One generic (de)serialiser and type check for dataclass configs, driven by their type hints.

A config class states each field's type once, in its annotation. This module reads the annotations
(:func:`typing.get_type_hints`) into a small tree (:class:`Hint`, see :func:`parse_hint`) and walks it:

- :func:`to_plain`: a dataclass -> JSON-compatible data: enums by name, nested dataclasses as mappings,
  polymorphic entries as ``{"name": ClassName, **fields}``;
- :func:`from_plain`: plain data (JSON, YAML) -> the dataclass. Unknown keys, wrong types and wrong enum
  names raise :class:`ConfigError` naming the path and what is allowed, with "did you mean" suggestions;
- :func:`check_fields`: an object built in Python -> the same type rules, in Python spellings
  (``True``/``None`` rather than ``true``/``null``); verification runs it before any semantic check;
- :mod:`quark_brevitas.config.schema` turns the same tree into the JSON Schema of config files.

Supported annotations: ``bool`` (never an ``int``), ``int`` (never a ``bool``), ``float`` (an ``int`` is
fine), ``str``, an ``Enum`` (written by member name; member values are accepted in files too),
``X | None``, ``list[X]``, ``dict[K, V]`` with scalar keys, dataclasses, ``Any``, and ``Annotated`` with
two markers: :class:`Text` (a non-empty string, named in messages) and :class:`Polymorphic` (an
instance of one of the registered subclasses of a base).

The module is generic: it imports nothing of quark_brevitas but its errors, and gets every class from
the annotations it walks, so the config dataclasses and the checks (which sit above it) can all use it
without importing each other.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass
from enum import Enum
from typing import Annotated, Any

from quark_brevitas.errors import ConfigError

__all__ = [
    "OMITTED_WHEN_NONE",
    "VERSION_KEY",
    "Hint",
    "Polymorphic",
    "Text",
    "check_fields",
    "did_you_mean",
    "expected",
    "field_hints",
    "field_path",
    "from_plain",
    "key_path",
    "parse_hint",
    "tag_default",
    "to_plain",
    "with_version",
    "without_version",
]


# ===================================================================== annotations
@dataclass(frozen=True)
class Text:
    """``Annotated[str, Text("module name or pattern")]``: a non-empty string, called ``what`` in messages."""

    what: str


@dataclass(frozen=True)
class Polymorphic:
    """``Annotated[Base, Polymorphic(registered)]``: an instance of one of ``registered(Base)``, written
    ``{tag: ClassName, **fields}`` in files (how Quark's configs list algorithms)."""

    registered: Callable[[type], list[type]]
    tag: str = "name"
    #: Appended to the message for a value that is not one of the classes (e.g. where such a value is accepted).
    note: str = ""

    def classes(self, base: type) -> dict[str, type]:
        """The allowed classes by name, looked up at each use so that subclasses registered later count.

        A class with a field named like the tag (Quark's LLM algorithm configs: ``name: str = "awq"``) is written
        with that field's value as its tag, so it is found by the field's default too, and by the other spellings
        it reads (:func:`tag_names`)."""
        found = {cls.__name__: cls for cls in sorted(self.registered(base), key=lambda cls: cls.__name__)}
        for cls in list(found.values()):
            for alias in tag_names(cls, self.tag)[1:]:
                found.setdefault(alias, cls)
        return found


def tag_names(cls: type, tag: str) -> list[str]:
    """Every name a file may give ``cls`` by: its class name, its own tag value (:func:`tag_default`), then the
    other spellings it reads (``tag_aliases``, e.g. Quark 0.13's ``"smooth"`` for SmoothQuantConfig)."""
    own = tag_default(cls, tag)
    return [cls.__name__, *([own] if own is not None else []), *getattr(cls, "tag_aliases", ())]


def tag_default(cls: type, tag: str) -> str | None:
    """The default of ``cls``'s field named ``tag`` if it is a string (the class's own tag value), else ``None``."""
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name == tag and isinstance(f.default, str):
            return f.default
    return None


@dataclass(frozen=True)
class Hint:
    """One annotation, parsed: what every walker here (and the JSON Schema) dispatches on.

    ``kind`` is one of ``bool``, ``int``, ``float``, ``str``, ``enum``, ``list``, ``dict``, ``dataclass``,
    ``any``; ``cls`` is the Enum or dataclass (for a :class:`Polymorphic` one, the base); ``args`` are
    ``(item,)`` for a list and ``(key, value)`` for a dict.
    """

    kind: str
    cls: type | None = None
    args: tuple[Hint, ...] = ()
    nullable: bool = False
    text: Text | None = None
    polymorphic: Polymorphic | None = None


_SCALARS: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "str"}


def parse_hint(annotation: Any) -> Hint:
    """The :class:`Hint` of an evaluated annotation; ``TypeError`` for annotations the walkers do not know."""
    nullable = False
    markers: list[Any] = []
    while True:  # Annotated and X | None may wrap each other
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            markers.extend(annotation.__metadata__)
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(options) != 1:
                raise TypeError(f"unsupported annotation {annotation!r}: the only union allowed is X | None")
            nullable, annotation = True, options[0]
        else:
            break
    extras: dict[str, Any] = {
        "nullable": nullable,
        "text": next((m for m in markers if isinstance(m, Text)), None),
        "polymorphic": next((m for m in markers if isinstance(m, Polymorphic)), None),
    }
    if origin is list:
        return Hint("list", args=(parse_hint(typing.get_args(annotation)[0]),), **extras)
    if origin is dict:
        key, value = (parse_hint(arg) for arg in typing.get_args(annotation))
        if key.kind not in _SCALARS.values():
            raise TypeError(f"unsupported annotation {annotation!r}: dict keys must be scalars")
        return Hint("dict", args=(key, value), **extras)
    if annotation in _SCALARS:
        return Hint(_SCALARS[annotation], **extras)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return Hint("enum", cls=annotation, **extras)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return Hint("dataclass", cls=annotation, **extras)
    if annotation is Any:
        return Hint("any", **extras)
    raise TypeError(f"unsupported annotation {annotation!r}")


@functools.cache
def field_hints(cls: type) -> tuple[tuple[dataclasses.Field[Any], Hint], ...]:
    """Each field of the dataclass ``cls`` with its parsed annotation, in field order."""
    annotations = typing.get_type_hints(cls, include_extras=True)
    return tuple((f, parse_hint(annotations[f.name])) for f in dataclasses.fields(cls))


# ===================================================================== paths and messages
def field_path(path: str, name: Any) -> str:
    """The path of a field: ``global_quant_config.weight`` (just the name at the top)."""
    return f"{path}.{name}" if path else str(name)


def key_path(path: str, key: Any) -> str:
    """The path of a dict entry, e.g. ``layer_quant_config["fc1"]`` (non-strings by ``repr``)."""
    shown = json.dumps(key, ensure_ascii=False) if isinstance(key, str) else repr(key)
    return f"{path}[{shown}]"


def did_you_mean(word: Any, candidates: list[str]) -> str:
    """``"did you mean 'x'? "`` for the closest candidate, or ``""`` when nothing is close."""
    close = difflib.get_close_matches(str(word), candidates, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _phrases(hint: Hint, python: bool) -> list[str]:
    kind = hint.kind
    if kind == "bool":
        return ["True", "False"] if python else ["true", "false"]
    if kind in ("int", "float", "any"):
        return [{"int": "an integer", "float": "a number", "any": "anything"}[kind]]
    if kind == "str":
        return [f"a non-empty {hint.text.what}" if hint.text else "a string"]
    if kind == "list":
        return [f"a list, each item {expected(hint.args[0], python)}"]
    if kind == "dict":
        return [f"a mapping from {expected(hint.args[0], python)} to {expected(hint.args[1], python)}"]
    assert hint.cls is not None
    name = hint.cls.__name__
    if hint.polymorphic is not None:
        names = list(hint.polymorphic.classes(hint.cls))
        note = f"; {hint.polymorphic.note}" if hint.polymorphic.note else ""
        if python:
            return [f"a {name} ({', '.join(names)}{note})"]
        return [f"a mapping with a {hint.polymorphic.tag!r} key naming a {name} (one of {names}{note})"]
    if kind == "dataclass" and not python:
        return [f"a mapping describing a {name}"]
    return [f"a {name}"]


def expected(hint: Hint, python: bool = False) -> str:
    """What a value of ``hint`` may be, in words: JSON spellings for files (``true or false or null``),
    Python ones for objects built in code (``True, False or None``)."""
    parts = _phrases(hint, python)
    if hint.nullable:
        parts.append("None" if python else "null")
    if python and len(parts) > 1:
        return f"{', '.join(parts[:-1])} or {parts[-1]}"
    return " or ".join(parts)


def _shown(value: Any) -> str:
    """A wrong value as a message shows it: scalars by repr, containers and objects by type name."""
    if isinstance(value, Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, str | int | float | type):
        return repr(value)
    return type(value).__name__


def _mismatch(hint: Hint, value: Any, path: str, python: bool) -> ConfigError:
    if hint.kind != "enum":
        return ConfigError(path, f"must be {expected(hint, python)}, got {_shown(value)}")
    assert hint.cls is not None
    names = [member.name for member in hint.cls]
    if python and isinstance(value, str) and value in names:
        suggestion = f"use {hint.cls.__name__}.{value}; "
    else:
        suggestion = did_you_mean(value, names) if isinstance(value, str) else ""
    none = (" or None" if python else " or null") if hint.nullable else ""
    return ConfigError(path, f"{_shown(value)} is not a {hint.cls.__name__}; {suggestion}allowed: {names}{none}")


def _entries(hint: Hint, value: Any, path: str, python: bool = False) -> Iterator[tuple[Any, Any, Hint, str]]:
    """``(index or key, item, item hint, item path)`` for each entry of a list or dict ``value``, after
    checking the container itself and each dict key. Lists may be tuples in code, never in files."""
    if hint.kind == "list":
        if not isinstance(value, list | tuple if python else list):
            raise _mismatch(hint, value, path, python)
        for index, item in enumerate(value):
            yield index, item, hint.args[0], f"{path}[{index}]"
        return
    if not isinstance(value, dict):
        raise _mismatch(hint, value, path, python)
    key_hint, item_hint = hint.args
    for key, item in value.items():
        if not _matches(key_hint, key):
            raise ConfigError(key_path(path, key), f"each key must be {expected(key_hint, python)}, got {_shown(key)}")
        yield key, item, item_hint, key_path(path, key)


def _matches(hint: Hint, value: Any) -> bool:
    """Whether a scalar (or enum member) fits ``hint``; containers and dataclasses are walked instead."""
    if value is None:
        return hint.nullable
    kind = hint.kind
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str) and (hint.text is None or value != "")
    if kind == "enum":
        return isinstance(value, hint.cls)  # type: ignore[arg-type]
    return kind == "any"


# ===================================================================== objects -> plain data
#: A dataclass may list, in a class attribute of this name, optional fields that are written only when set
#: (not ``None``): fields kept for an older generation of the format, so that a file says only what its author
#: wrote (reading the file back gives ``None`` for them again).
OMITTED_WHEN_NONE = "omitted_when_none"


def to_plain(value: Any, annotation: Any = None) -> Any:
    """JSON-compatible data for ``value``: enums by name, dataclasses as mappings in field order, entries
    annotated :class:`Polymorphic` with their class name first. Wrong types are passed through, not
    checked, so that an unverified config can still be shown."""
    hint = annotation if annotation is None or isinstance(annotation, Hint) else parse_hint(annotation)
    if isinstance(value, Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        omitted = getattr(type(value), OMITTED_WHEN_NONE, ())
        plain = {f.name: to_plain(getattr(value, f.name), field_hint) for f, field_hint in field_hints(type(value))
                 if not (f.name in omitted and getattr(value, f.name) is None)}
        if hint is not None and hint.polymorphic is not None:
            return {hint.polymorphic.tag: type(value).__name__, **plain}
        return plain
    if isinstance(value, list | tuple):
        item = hint.args[0] if hint is not None and hint.kind == "list" else None
        return [to_plain(v, item) for v in value]
    if isinstance(value, dict):
        item = hint.args[1] if hint is not None and hint.kind == "dict" else None
        return {key: to_plain(v, item) for key, v in value.items()}
    return value


# ===================================================================== plain data -> objects
def from_plain(annotation: Any, data: Any, path: str = "") -> Any:
    """The object ``annotation`` describes, built from plain ``data``; :class:`ConfigError` names the first
    path at fault. Dataclasses are built with their constructors (so ``__post_init__`` runs)."""
    hint = annotation if isinstance(annotation, Hint) else parse_hint(annotation)
    if data is None and hint.nullable:
        return None
    kind = hint.kind
    if kind == "enum":
        return _enum_from(hint, data, path)
    if kind in ("list", "dict"):
        entries = [(key, from_plain(item_hint, item, sub)) for key, item, item_hint, sub in _entries(hint, data, path)]
        return [item for _, item in entries] if kind == "list" else dict(entries)
    if kind == "dataclass":
        return _dataclass_from(hint, data, path)
    if not _matches(hint, data):
        raise _mismatch(hint, data, path, python=False)
    return data


def _enum_from(hint: Hint, value: Any, path: str) -> Enum:
    enum_cls = hint.cls
    assert enum_cls is not None and issubclass(enum_cls, Enum)
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        if value in enum_cls.__members__:
            return enum_cls[value]
        for member in enum_cls:
            if member.value == value:
                return member
    raise _mismatch(hint, value, path, python=False)


def _dataclass_from(hint: Hint, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise _mismatch(hint, data, path, python=False)
    cls, poly = hint.cls, hint.polymorphic
    assert cls is not None
    extra: list[str] = []
    if poly is not None:
        classes = poly.classes(cls)
        tag_path = field_path(path, poly.tag)
        if poly.tag not in data:
            raise ConfigError(tag_path, f"is required: the {cls.__name__} to use, one of {list(classes)}")
        name = data[poly.tag]
        if not isinstance(name, str) or name not in classes:
            suggestion = did_you_mean(name, list(classes)) if isinstance(name, str) else ""
            note = f"; {poly.note}" if poly.note else ""
            raise ConfigError(tag_path, f"{_shown(name)} is not a {cls.__name__}; {suggestion}allowed: "
                                        f"{list(classes)}{note}")
        cls, extra = classes[name], [poly.tag]
        # A class whose tag is one of its fields keeps that field at its default (the tag names the class).
        data = {key: value for key, value in data.items() if key != poly.tag}
    hints = field_hints(cls)
    allowed = [*extra, *(f.name for f, _ in hints)]
    for key in data:
        if key not in allowed:
            raise ConfigError(field_path(path, key), f"unknown key; {did_you_mean(key, allowed)}allowed: {allowed}")
    kwargs: dict[str, Any] = {}
    for f, field_hint in hints:
        sub = field_path(path, f.name)
        if f.name in data:
            kwargs[f.name] = from_plain(field_hint, data[f.name], sub)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(sub, "is required")
    return cls(**kwargs)


# ===================================================================== objects built in code
def check_fields(obj: Any, path: str = "") -> None:
    """Raise :class:`ConfigError` unless every field of the dataclass instance ``obj`` matches its own
    annotation, nested dataclasses, lists and dicts included."""
    for f, hint in field_hints(type(obj)):
        _check(getattr(obj, f.name), hint, field_path(path, f.name))


def _check(value: Any, hint: Hint, path: str) -> None:
    if value is None and hint.nullable:
        return
    kind = hint.kind
    if kind in ("list", "dict"):
        for _, item, item_hint, sub in _entries(hint, value, path, True):
            _check(item, item_hint, sub)
    elif kind == "dataclass":
        if not isinstance(value, hint.cls):  # type: ignore[arg-type]
            raise _mismatch(hint, value, path, python=True)
        check_fields(value, path)
    elif not _matches(hint, value):
        raise _mismatch(hint, value, path, python=True)


# ===================================================================== format versions
#: The key that records a file's format version (the first key of the mapping).
VERSION_KEY = "format_version"


def with_version(plain: dict[str, Any], version: int) -> dict[str, Any]:
    """``plain`` with its format version as the first key."""
    return {VERSION_KEY: version, **plain}


def without_version(data: Any, readable: tuple[int, ...]) -> Any:
    """``data`` without its format version, after checking that this release reads that version.

    Data without the key is returned as is: it predates recorded versions (the first one). Data that
    is not a mapping is returned as is too, for :func:`from_plain` to reject with its path.
    """
    if not isinstance(data, dict) or VERSION_KEY not in data:
        return data
    version = data[VERSION_KEY]
    versions = ", ".join(str(v) for v in readable)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(VERSION_KEY, f"must be an integer format version ({versions}), got {_shown(version)}")
    if version not in readable:
        newer = " (written by a newer quark_brevitas: upgrade it to read this file)" if version > max(readable) else ""
        raise ConfigError(VERSION_KEY, f"format version {version} is not supported{newer}; this release reads "
                          f"format versions {versions}")
    return {key: value for key, value in data.items() if key != VERSION_KEY}
