"""Cross-field rules of request bodies, as JSON Schema for the OpenAPI document.

Each helper returns a schema to put in a request model's `allOf`, so that a request the
document calls valid is one the adapter accepts (and the other way round). They are
written as unions of plain constraints (no `not`), which fuzzers can generate from.
"""

from __future__ import annotations

from typing import Any

JsonSchema = dict[str, Any]
NULL: JsonSchema = {"type": "null"}
# The JSON text of an object, or blank (`{}`); that it parses is a rule in words.
JSON_OBJECT_TEXT: JsonSchema = {
    "type": "string",
    "contentMediaType": "application/json",
    "pattern": "^\\s*(\\{[\\s\\S]*\\}\\s*)?$",
}


def nullable(schema: JsonSchema) -> JsonSchema:
    return {"anyOf": [schema, NULL]}


def at_most_one(unset: dict[str, JsonSchema], description: str) -> JsonSchema:
    """At most one of the fields is set; `unset[name]` is the schema of an unset value
    (absent always counts as unset)."""
    names = list(unset)
    return {
        "anyOf": [
            {"properties": {other: unset[other] for other in names if other != name}}
            for name in names
        ],
        "description": description,
    }


def unless(field: str, exempt: JsonSchema, then: JsonSchema, description: str) -> JsonSchema:
    """Unless `field` is absent or matches `exempt`, the body must match `then`."""
    return {"anyOf": [{"properties": {field: exempt}}, then], "description": description}


def needs(
    field: str, exempt: JsonSchema, required: str, value: JsonSchema, description: str
) -> JsonSchema:
    """Unless `field` is absent or matches `exempt`, `required` must be present and match
    `value`."""
    return unless(
        field, exempt, {"required": [required], "properties": {required: value}}, description
    )
