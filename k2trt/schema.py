"""The shape of a JSON file we wrote (a manifest), checked before anything reads it: a hand-edited or damaged
manifest whose `graphs` is a list, or whose entry is a string, is one clear line, never a KeyError or TypeError
somewhere downstream.

A schema is a Python type (or a tuple of them), `ListOf(schema)`, `MapOf(schema)` (any keys), or a dict of the
keys an object must have (further keys are allowed: newer writers may add some).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k2trt.errors import K2Error


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class MapOf:
    value: Any


def _name(schema: Any) -> str:
    if isinstance(schema, tuple):
        return " or ".join(_name(s) for s in schema)
    if isinstance(schema, ListOf):
        return "a list"
    if isinstance(schema, (MapOf, dict)):
        return "an object"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(schema, schema.__name__)


def check(value: Any, schema: Any, where: str, error=K2Error) -> None:
    """Raise `error` naming the first place (`where.key[3].name`) where `value` does not have the schema's shape."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {_json_type(value)}")
        missing = [k for k in schema if k not in value]
        if missing:
            raise error(f"{where}: missing {', '.join(missing)}")
        for key, sub in schema.items():
            check(value[key], sub, f"{where}.{key}", error)
    elif isinstance(schema, MapOf):
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {_json_type(value)}")
        for key, item in value.items():
            check(item, schema.value, f"{where}.{key}", error)
    elif isinstance(schema, ListOf):
        if not isinstance(value, list):
            raise error(f"{where}: expected a list, got {_json_type(value)}")
        for i, item in enumerate(value):
            check(item, schema.item, f"{where}[{i}]", error)
    else:
        types = schema if isinstance(schema, tuple) else (schema,)
        # JSON's true is not an integer, and an integer is a number
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise error(f"{where}: expected {_name(schema)}, got {_json_type(value)}")


def json_kind(value: Any) -> str:
    """A JSON value's type as a message about a wrong value names it ("a boolean", "a number", "null", ...)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__)
