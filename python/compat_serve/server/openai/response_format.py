"""The output constraint of a chat or text completion request: at most one of

- OpenAI's `response_format`: `text` (none), `json_object`, `json_schema`;
- vLLM's `structured_outputs`: one of `json`, `regex`, `grammar` (Lark), `choice`,
  `json_object`;
- vLLM's older `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`.
"""

from __future__ import annotations

from typing import Any

from compat_serve.engine.types import Grammar
from compat_serve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from compat_serve.server.output_format import (
    bad,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

_ANY_OBJECT = {"type": "object"}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# structured_outputs keys that are constraints (the others are options, ignored).
_STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object")
_UNSUPPORTED_STRUCTURED = ("structural_tag",)
_GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


def output_grammar(body: ChatCompletionRequest | CompletionRequest) -> Grammar | None:
    """The grammar the output must match, None for free text; 400s name the field."""
    found: list[tuple[str, Grammar]] = []
    if body.response_format is not None:
        grammar = _response_format(body.response_format)
        if grammar is not None:
            found.append(("response_format", grammar))
    if body.structured_outputs is not None:
        grammar = _structured_outputs(body.structured_outputs)
        if grammar is not None:
            found.append(("structured_outputs", grammar))
    for name in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append((name, _guided(name, value)))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad(second, f"only one output constraint may be given, and {first} is set too")
    return found[0][1] if found else None


def _response_format(value: dict[str, Any]) -> Grammar | None:
    kind = value.get("type")
    if kind is None:
        raise bad("response_format.type", "field required")
    if kind not in _RESPONSE_FORMATS:
        allowed = ", ".join(repr(k) for k in _RESPONSE_FORMATS)
        raise bad("response_format.type", f"must be one of {allowed}, not {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(_ANY_OBJECT, "response_format")
    spec = value.get("json_schema")
    if spec is None:
        raise bad("response_format.json_schema", "field required when type is 'json_schema'")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "must be an object")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad("response_format.json_schema.name", "must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    field = "response_format.json_schema.schema"
    if spec.get("schema") is None:
        raise bad(field, "field required")
    if isinstance(spec["schema"], str):  # JSON text is for the vLLM fields only
        raise bad(field, "must be a JSON schema object")
    # `strict` or not, the output always follows the schema.
    return json_schema_grammar(spec["schema"], field)


def _structured_outputs(value: dict[str, Any]) -> Grammar | None:
    for kind in _UNSUPPORTED_STRUCTURED:
        if value.get(kind) is not None:
            raise bad(f"structured_outputs.{kind}", "is not supported")
    # Unset: absent or null (json_object also false); `0` is not `false` here.
    given = [k for k in _STRUCTURED_KINDS if not _unset(k, value.get(k))]
    if len(given) > 1:
        raise bad(
            f"structured_outputs.{given[1]}",
            f"only one constraint may be given, and structured_outputs.{given[0]} is set too",
        )
    if not given:
        return None
    kind = given[0]
    field = f"structured_outputs.{kind}"
    item = value[kind]
    if kind == "json_object":
        if item is not True:
            raise bad(field, "must be true")
        return json_schema_grammar(_ANY_OBJECT, field)
    return _build(kind, item, field)


def _unset(kind: str, value: object) -> bool:
    return value is None or (kind == "json_object" and value is False)


def _guided(name: str, value: object) -> Grammar:
    return _build(name.removeprefix("guided_"), value, name)


def _build(kind: str, value: object, field: str) -> Grammar:
    if kind == "json":
        return json_schema_grammar(value, field)
    if kind == "regex":
        return regex_grammar(value, field)
    if kind == "grammar":
        return lark_grammar(value, field)
    return choice_grammar(value, field)
