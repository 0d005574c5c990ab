"""Grammar pieces shared by the formats: a choice of tools, JSON call objects, and
arguments written as tagged key/value pairs (the grammar side of `arguments.py`).

A tool's declared arguments may come in any order (`property_order.py`), as JSON
(`json_arguments`) and as tagged pairs (`tagged_arguments`) alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from compat_serve.parsers.lark import GrammarBuilder, arguments_schema
from compat_serve.parsers.property_order import any_order, declared_properties

Schema = Mapping[str, Any]

# Keys of a tool whose schema names no properties (any object is valid).
_ANY_KEY = "/[A-Za-z_][A-Za-z0-9_]{0,63}/"
# Schema keywords carried into each parameter's own schema so `$ref`s still resolve.
_SHARED_KEYWORDS = ("$defs", "definitions")
# What an arguments schema may say besides its properties for `json_arguments` to write
# them in any order; any other keyword (patternProperties, minProperties, allOf, ...) is
# left to the grammar engine's own JSON, in schema order.
_PLAIN_OBJECT_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "title",
        "$schema",
        "$id",
        "$comment",
        "default",
        "examples",
        *_SHARED_KEYWORDS,
    }
)


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
    arguments = json_arguments(g, f"args_{name}", schema)
    return f"{g.lit(head)} {arguments} {extra} {g.lit('}')}"


def json_arguments(g: GrammarBuilder, hint: str, schema: Schema | None) -> str:
    """A tool's arguments as one compact JSON object valid against `schema`, its declared
    properties in any order.

    An object schema that says more than its properties (pattern properties, bounds on
    their number, combinators) or allows undeclared ones goes to the grammar engine
    whole, which writes the properties in schema order. Where `additionalProperties` is
    left out, only the declared properties are written (a model is better off naming
    the tool's own arguments).
    """
    schema = arguments_schema(schema)
    if not _plain_object(schema):
        return g.json(schema)
    properties, required = declared_properties(schema)
    shared = _shared(schema)

    def item(key: str) -> str:
        prop = _with_shared(properties[key], shared)
        return f"{g.lit(json.dumps(key, ensure_ascii=False) + ': ')} {g.json(prop)}"

    body = any_order(g, hint, list(properties), required, item, separator=g.lit(", "))
    return f'"{{" {body} "}}"'


def _plain_object(schema: Schema) -> bool:
    properties = schema.get("properties")
    return (
        schema.get("type") == "object"
        and set(schema) <= _PLAIN_OBJECT_KEYWORDS
        and schema.get("additionalProperties", False) is False
        and isinstance(properties, Mapping)
        and bool(properties)
        and all(isinstance(p, Mapping | bool) for p in properties.values())
    )


def _shared(schema: Schema) -> dict[str, Any]:
    return {k: schema[k] for k in _SHARED_KEYWORDS if k in schema}


def _with_shared(prop: Any, shared: Mapping[str, Any]) -> Any:
    """A property's schema with the definitions its `$ref`s may point to."""
    return {**prop, **shared} if isinstance(prop, Mapping) and shared else prop


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

    Declared properties come in any order (`property_order.any_order`), each at most
    once, optional ones may be left out. A value is raw text when the parser reads it as
    a string (the schema says `string`, or says nothing), JSON otherwise.
    """
    schema = arguments_schema(schema)
    params, required = declared_properties(schema)
    if not params:
        pair = g.rule(f"{hint}_any", style.key(g, _ANY_KEY) + " " + _value(g, hint, True, style))
        return f"{pair}*"
    shared = _shared(schema)

    def item(key: str) -> str:
        sub = _with_shared(params[key], shared)
        return style.key(g, g.lit(key)) + " " + _value(g, f"{hint}_{key}_value", sub, style)

    return any_order(g, hint, list(params), required, item)


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
