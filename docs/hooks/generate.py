"""MkDocs hook: reference pages generated from the code, so that they cannot drift from it.

A page holds a marker comment, ``<!-- generated: NAME -->``, that this hook replaces while the site is built:

- ``config-schema``: every field of the config, its type, default and allowed values, from
  ``quark_brevitas.config.schema.config_json_schema()`` (the same walker that writes the shipped JSON Schema);
- ``cli``: the help of the command line and of every subcommand, from the argparse parser ``main`` runs.

It also renders the Sphinx roles of the docstrings (``:class:`~x.Y```) as code names on the API pages.

An unknown marker is an error (``mkdocs build --strict`` would otherwise publish the comment).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def _allowed(prop: dict[str, Any]) -> str:
    """The allowed values of one schema property, in words."""
    if "enum" in prop:
        return ", ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in prop:
        return " or ".join(_allowed(p) for p in prop["anyOf"])
    if "items" in prop:
        return f"list of {_allowed(prop['items'])}"
    kind = prop.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _table(properties: dict[str, Any]) -> list[str]:
    rows = ["| field | allowed | default | meaning |", "| --- | --- | --- | --- |"]
    for name, prop in properties.items():
        default = json.dumps(prop["default"]) if "default" in prop else "required"
        if len(default) > 60:
            default = default[:57] + "..."
        meaning = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {_allowed(prop)} | `{default}` | {meaning} |")
    return rows


def config_schema_markdown() -> str:
    from quark_brevitas.config.schema import config_json_schema

    schema = config_json_schema()
    lines = ["## Config", "", schema.get("description", ""), "", *_table(schema["properties"])]
    for name, definition in schema.get("$defs", {}).items():
        lines += ["", f"## {name}", "", definition.get("description", "")]
        if "properties" in definition:
            lines += ["", *_table(definition["properties"])]
        elif "oneOf" in definition or "anyOf" in definition:
            options = definition.get("oneOf") or definition.get("anyOf")
            lines += ["", "One of: " + ", ".join(_allowed(o) for o in options)]
    return "\n".join(lines)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public walk over subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_markdown() -> str:
    from quark_brevitas.cli.parser import build_parser

    parser = build_parser()
    parts = ["## quark-brevitas", "", "```text", parser.format_help().rstrip(), "```"]
    for name, sub in _subparsers(parser).items():
        parts += ["", f"## {name}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(parts)


GENERATORS = {"config-schema": config_schema_markdown, "cli": cli_markdown}

#: A Sphinx cross-reference role as it reaches the page from a docstring (the docstrings are written for
#: ``help()`` and Sphinx readers: ``:class:`~quark_brevitas.config.Config```): rendered as the plain code name.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([\w.]+)</code>")


def _role(match: re.Match[str]) -> str:
    name = match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """The API pages' Sphinx roles as code names (mkdocstrings keeps them as text)."""
    return SPHINX_ROLE.sub(_role, html)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated section {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)
