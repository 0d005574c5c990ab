"""Output-format constraints from request fields, checked the same way for every API.

Each helper turns one request field into a `Grammar` whose `field` names it, or raises a
400 naming the field. Only the shape is checked here; whether the schema or grammar
compiles is the grammar engine's answer (a 400 naming the same field at submission).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from compat_serve.engine.types import Grammar
from compat_serve.server.errors import ApiError

# Characters that are syntax in the grammar engine's (Rust `regex`) patterns.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def bad(field: str, reason: str) -> ApiError:
    return ApiError(400, f"{field}: {reason}", param=field)


def json_schema_grammar(schema: object, field: str) -> Grammar:
    """A JSON schema (an object, or its JSON text) → a json_schema grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad(field, f"not valid JSON ({exc.msg})") from exc
    if isinstance(schema, bool):
        raise bad(field, "a boolean schema is not supported; give a JSON schema object")
    if not isinstance(schema, dict):
        raise bad(field, "must be a JSON schema object")
    return Grammar("json_schema", json.dumps(schema), field)


def regex_grammar(pattern: object, field: str) -> Grammar:
    if not isinstance(pattern, str) or not pattern:
        raise bad(field, "must be a non-empty regular expression string")
    return Grammar("regex", pattern, field)


def lark_grammar(source: object, field: str) -> Grammar:
    if not isinstance(source, str) or not source.strip():
        raise bad(field, "must be a non-empty Lark grammar string")
    return Grammar("lark", source, field)


def choice_grammar(choices: object, field: str) -> Grammar:
    """The output is exactly one of the given strings."""
    if not isinstance(choices, Sequence) or isinstance(choices, str) or not choices:
        raise bad(field, "must be a non-empty list of strings")
    for k, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise bad(f"{field}[{k}]", "must be a string")
    return Grammar("regex", "|".join(f"({escape_regex(c)})" for c in choices), field)


def escape_regex(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)
