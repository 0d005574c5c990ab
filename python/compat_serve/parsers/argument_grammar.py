"""Grammar pieces shared by the formats: a choice of tools, JSON call objects, and
arguments written as tagged key/value pairs (the grammar side of `arguments.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from compat_serve.parsers.lark import GrammarBuilder, arguments_schema

Schema = Mapping[str, Any]

# Keys of a tool whose schema names no properties (any object is valid).
_ANY_KEY = "/[A-Za-z_][A-Za-z0-9_]{0,63}/"
# Schema keywords carried into each parameter's own schema so `$ref`s still resolve.
_SHARED_KEYWORDS = ("$defs", "definitions")


def one_of_tools(
    g: GrammarBuilder, tools: Mapping[str, Schema], call: Callable[[str, Schema], str]
) -> str:
    """A rule choosing one call among `tools` (`call(name, schema)` writes one call)."""
    return g.choice(
        "call", (g.rule(f"call_{name}", call(name, schema)) for name, schema in tools.items())
    )


def json_call(
    g: GrammarBuilder, name: str, schema: Schema, *, args_key: str = "arguments", extra: str = ""
) -> str:
    """`{"name": NAME, "arguments": {...}}` laid out as the templates render it; `extra`
    (a Lark expression) goes before the closing brace."""
    head = '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": '
    return f"{g.lit(head)} {g.json(arguments_schema(schema))} {extra} {g.lit('}')}"


@dataclass(frozen=True)
class TagStyle:
    """How a format writes one argument: `key(name_expr)`, then the value between
    `value_prefix` and `end_prefix` + `end`, then `after`."""

    key: Callable[[GrammarBuilder, str], str]
    end: str
    # Markup that ends a value in the parser: a string value can never contain it.
    stops: tuple[str, ...]
    value_prefix: str = ""
    end_prefix: str = ""
    after: str = "\n"
    # False where the parser trims a newline at either edge of a value.
    edge_newlines: bool = True


def tagged_arguments(g: GrammarBuilder, hint: str, schema: Schema, style: TagStyle) -> str:
    """The arguments of one call as tagged pairs, valid against `schema`.

    Declared properties come in schema order, optional ones may be left out. A value is
    raw text when the parser reads it as a string (the schema says `string`, or says
    nothing), JSON otherwise.
    """
    schema = arguments_schema(schema)
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = [r for r in schema.get("required") or () if isinstance(r, str)]
    params: dict[str, Any] = dict(properties)
    params.update({r: {} for r in required if r not in params})
    if not params:
        pair = g.rule(f"{hint}_any", style.key(g, _ANY_KEY) + " " + _value(g, hint, True, style))
        return f"{pair}*"
    shared = {k: schema[k] for k in _SHARED_KEYWORDS if k in schema}
    parts = []
    for key, prop in params.items():
        sub = {**prop, **shared} if isinstance(prop, Mapping) and shared else prop
        body = style.key(g, g.lit(key)) + " " + _value(g, f"{hint}_{key}_value", sub, style)
        pair = g.rule(f"{hint}_{key}", body)
        parts.append(pair if key in required else f"{pair}?")
    return " ".join(parts)


def _value(g: GrammarBuilder, hint: str, schema: Mapping[str, Any] | bool, style: TagStyle) -> str:
    close = g.lit(style.end_prefix, style.end, style.after)
    opening = g.lit(style.value_prefix)
    if _is_string(schema):
        assert isinstance(schema, Mapping)
        literals = _string_literals(schema)
        if literals is not None:
            return f"{opening} ({' | '.join(g.lit(v) for v in literals)}) {close}"
    if _is_string(schema) or _is_any(schema):
        text = g.text_until(
            hint,
            style.end,
            style.stops,
            prefix=style.end_prefix,
            edge_newlines=style.edge_newlines,
            length=_length(schema),
        )
        return f"{opening} {text} {g.lit(style.after)}"
    return f"{opening} {g.json(schema)} {close}"


def _is_string(schema: Mapping[str, Any] | bool) -> bool:
    # Exactly the parser's test (CallSink.param_is_string).
    return isinstance(schema, Mapping) and schema.get("type") == "string"


def _is_any(schema: Mapping[str, Any] | bool) -> bool:
    if isinstance(schema, bool):
        return schema
    return not (set(schema) - {"description", "title", "$defs", "definitions"})


def _string_literals(schema: Mapping[str, Any]) -> list[str] | None:
    if isinstance(schema.get("const"), str):
        return [schema["const"]]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return list(enum)
    return None


def _length(schema: Mapping[str, Any] | bool) -> tuple[int, int | None] | None:
    """A string's `minLength`/`maxLength`, when it sets either."""
    if not isinstance(schema, Mapping):
        return None
    low, high = schema.get("minLength"), schema.get("maxLength")
    if not isinstance(low, int) and not isinstance(high, int):
        return None
    return (low if isinstance(low, int) else 0, high if isinstance(high, int) else None)
