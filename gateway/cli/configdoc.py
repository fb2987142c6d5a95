"""The configuration reference, written from the settings models.

Every field of :class:`~gateway.runtime.settings.Settings` (and of its sections) carries its
description as a docstring right under it. This module turns the models into the reference
table of ``docs/configuration.md`` and the settings part of ``config/fencegate.example.toml``,
each between a begin and an end marker (the text around the markers is written by hand)::

    python -m gateway.cli.configdoc           # rewrite both files (make config-docs)
    python -m gateway.cli.configdoc --check   # exit 1, naming what differs; write nothing

A field without a description stops both with its name (:func:`undocumented`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from gateway.runtime.settings import Settings

__all__ = [
    "DOCS",
    "EXAMPLE",
    "ConfigKey",
    "config_keys",
    "example_section",
    "main",
    "reference_table",
    "render",
    "section_model",
    "toml_value",
    "undocumented",
]

DOCS = Path("docs/configuration.md")
EXAMPLE = Path("config/fencegate.example.toml")
SOURCE = "gateway/runtime/settings.py"
COMMAND = "make config-docs"
DOCS_BEGIN = f"<!-- settings:begin: `{COMMAND}` writes this table from {SOURCE} -->"
DOCS_END = "<!-- settings:end -->"
TOML_BEGIN = f"# --- settings:begin: `{COMMAND}` writes this part from {SOURCE} ---"
TOML_END = "# --- settings:end ---"
WIDTH = 98
_LINK = re.compile(r"\[([^\]]+)\]\(\./([^)#]+)(#[^)]*)?\)")


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One key of the configuration: ``path`` as an operator writes it (``server.port``,
    ``auth.keys[].role``, ``quotas.tenants.<tenant>.payload_bytes``)."""

    path: str
    owner: type[BaseModel]
    name: str
    field: FieldInfo


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model inside a field's type (``X``, ``tuple[X, ...]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_model(arg)
        if found is not None:
            return found
    return None


def _nested_path(prefix: str, name: str, annotation: Any) -> str:
    if typing.get_origin(annotation) is dict:
        return f"{prefix}{name}.<{name.rstrip('s')}>"
    return f"{prefix}{name}[]"


def config_keys(model: type[BaseModel] = Settings, prefix: str = "") -> Iterator[ConfigKey]:
    """Every key under ``model``, depth first in the models' field order: a field holding a
    section (or a table of them) gives that section's keys, every other field is a key."""
    for name, field in model.model_fields.items():
        nested = section_model(field.annotation)
        if nested is None:
            table = typing.get_origin(field.annotation) is dict  # [adapters.<name>]
            yield ConfigKey(prefix + name + (".<name>" if table else ""), model, name, field)
        elif prefix == "":  # a section of the root: [name]
            yield from config_keys(nested, f"{name}.")
        else:
            yield ConfigKey(prefix + name, model, name, field)
            yield from config_keys(nested, _nested_path(prefix, name, field.annotation) + ".")


def undocumented(model: type[BaseModel] = Settings) -> list[str]:
    """The keys (and section models) without a description, as ``key (Model.field)``."""
    missing = [
        f"{key.path} ({key.owner.__name__}.{key.name})"
        for key in config_keys(model)
        if not (key.field.description or "").strip()
    ]
    for section in _sections(model):
        if not (section.__dict__.get("__doc__") or "").strip():
            missing.append(f"the section model {section.__name__} (its class docstring)")
    return missing


def _sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    out: list[type[BaseModel]] = []
    for field in model.model_fields.values():
        nested = section_model(field.annotation)
        if nested is not None and nested not in out:
            out.append(nested)
            out += [m for m in _sections(nested) if m not in out]
    return out


def _refuse_undocumented(model: type[BaseModel]) -> None:
    missing = undocumented(model)
    if missing:
        raise SystemExit(
            f"{SOURCE}: these settings have no description (write a docstring right under "
            "each field, or under the class line of a section): " + ", ".join(missing)
        )


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (the subset settings defaults use)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    raise TypeError(f"no TOML literal for {value!r}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "—"
    if field.default is None:
        return "unset"
    return f"`{toml_value(field.default)}`"


def reference_table(model: type[BaseModel] = Settings) -> str:
    """The Markdown table of every key: key, default, meaning."""
    _refuse_undocumented(model)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key in config_keys(model):
        meaning = _one_line(key.field.description or "").replace("|", "\\|")
        rows.append(f"| `{key.path}` | {_default(key.field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def _comment(text: str, first: str = "", rest: str = "") -> list[str]:
    """``text`` as wrapped TOML comment lines; a docs link becomes its title and page."""
    plain = _LINK.sub(lambda m: f"{m[1]} (docs/{m[2]})", _one_line(text)).replace("``", "`")
    return textwrap.wrap(
        plain,
        WIDTH,
        initial_indent=f"# {first}",
        subsequent_indent=f"# {rest}",
        break_on_hyphens=False,
        break_long_words=False,
    )


def _example_of(field: FieldInfo) -> Any:
    if field.examples:
        return field.examples[0]
    return None if field.is_required() else field.default


def _nested_block(prefix: str, name: str, field: FieldInfo, nested: type[BaseModel]) -> list[str]:
    """A section inside a section (``[[auth.keys]]``, ``[quotas.tenants.<tenant>]``): its
    keys described, then a commented-out table with example values."""
    path = _nested_path(prefix, name, field.annotation)
    header = f"[[{prefix}{name}]]" if path.endswith("[]") else f"[{prefix}{name}.acme]"
    lines = _comment(nested.__doc__ or "")
    for sub, subfield in nested.model_fields.items():
        lines += _comment(f"{sub}: {subfield.description or ''}", first="  ", rest="    ")
    lines.append(f"# {header}")
    for sub, subfield in nested.model_fields.items():
        value = _example_of(subfield)
        if value is not None:
            lines.append(f"# {sub} = {toml_value(value)}")
    return lines


def example_section(model: type[BaseModel] = Settings) -> str:
    """Every section of the settings as TOML: each key with its default (a key whose
    default is unset commented out, with an example value), under its description."""
    _refuse_undocumented(model)
    out: list[str] = []
    for section_name, section_field in model.model_fields.items():
        section = section_model(section_field.annotation)
        if section is None:  # [adapters.<name>]: written by hand below the marker
            continue
        out += ["", *_comment(section.__doc__ or ""), f"[{section_name}]"]
        for name, field in section.model_fields.items():
            out.append("")
            nested = section_model(field.annotation)
            if nested is not None:
                out += _nested_block(f"{section_name}.", name, field, nested)
                continue
            out += _comment(field.description or "")
            if field.default is None:
                example = _example_of(field)
                shown = toml_value(example) if example is not None else ""
                out.append(f"# {name} = {shown}".rstrip())
            else:
                out.append(f"{name} = {toml_value(field.default)}")
    return "\n".join(out).lstrip("\n") + "\n"


def _between(text: str, begin: str, end: str, generated: str, where: Path) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{where}: needs one line {begin!r} and, after it, one line {end!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n\n{generated}\n{end}{tail}"


def render(docs: str, example: str) -> tuple[str, str]:
    """``docs/configuration.md`` and the example config with their generated parts
    rewritten from the settings models."""
    return (
        _between(docs, DOCS_BEGIN, DOCS_END, reference_table(), DOCS),
        _between(example, TOML_BEGIN, TOML_END, example_section(), EXAMPLE),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.cli.configdoc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on a diff")
    parser.add_argument("--root", type=Path, default=Path(), help="the repository (default .)")
    args = parser.parse_args(argv)
    paths = (args.root / DOCS, args.root / EXAMPLE)
    now = tuple(p.read_text(encoding="utf-8") for p in paths)
    wanted = render(*now)
    stale = [str(p) for p, old, new in zip(paths, now, wanted, strict=True) if old != new]
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    for path, old, new in zip(paths, now, wanted, strict=True):
        if old != new:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
