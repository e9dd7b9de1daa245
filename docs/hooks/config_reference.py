"""mkdocs hook: the configuration page's reference, rendered at build time from the config models'
fields (type, default, constraints, description), so the documentation cannot drift from the code.

`docs/configuration.md` holds MARKER where the tables go.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from app.config import AppConfig
from policies.graph_policy import GraphPolicy

MARKER = "<!-- config-reference -->"
ROOTS = (AppConfig, GraphPolicy)
SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def models() -> list[type[BaseModel]]:
    """The roots, then every model their fields use, recursively, each once, in order of first use."""
    found = list(ROOTS)
    for model in found:  # grows while it is walked: nested models are walked too
        for field in model.model_fields.values():
            found += [m for m in nested(field.annotation) if m not in found]
    return found


def nested(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from nested(arg)


def type_name(annotation: Any) -> str:
    """A field's type in the words of a YAML file."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:  # StrictInt and the like: the type, taken only as itself
        return type_name(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if origin is Literal:
        return ("one of " if len(args) > 1 else "only ") + ", ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if args:  # a union
        return " or ".join(type_name(a) for a in args)
    return SCALARS[annotation]


def default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel) and value == type(value)():
        return f"[its defaults](#{type(value).__name__.lower()})"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def constraints(field: FieldInfo) -> str:
    return ", ".join(c for c in map(constraint, field.metadata) if c)


def constraint(metadata: Any) -> str:
    for key, sign in BOUNDS.items():
        if hasattr(metadata, key):
            return f"{sign} {getattr(metadata, key)}"
    if hasattr(metadata, "strict"):  # the type column already names the only type taken
        return ""
    if getattr(metadata, "allow_inf_nan", True) is False:
        return "finite"
    return str(metadata)


def cell(text: str) -> str:
    """Pipes outside code spans would end the table cell."""
    return re.sub(r"(`[^`]*`)|\|", lambda m: m.group(1) or r"\|", text)


def used_in(model: type[BaseModel]) -> list[str]:
    return [
        f"`{parent.__name__}.{name}`"
        for parent in models()
        for name, field in parent.model_fields.items()
        if model in nested(field.annotation)
    ]


def table(model: type[BaseModel]) -> str:
    lines = [f"### {model.__name__}", ""]
    if model.__doc__:
        lines += [inspect.cleandoc(model.__doc__), ""]
    if where := used_in(model):
        lines += [f"Used by {', '.join(where)}.", ""]
    extra = model.model_config.get("extra")
    lines += ["Keys not listed here are passed on as given." if extra == "allow" else "Any other key is refused.", ""]
    lines += ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        row = (f"`{name}`", type_name(field.annotation), default(field), constraints(field), field.description or "")
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    return "\n".join(lines)


def render() -> str:
    return "\n\n".join(table(m) for m in models())


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown
