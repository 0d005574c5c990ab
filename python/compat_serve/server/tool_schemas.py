"""Tool parameter schemas as every API path hands them to the template and the grammar."""

from __future__ import annotations

from typing import Any


def prompt_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` without its top-level `$schema`: the dialect's URI (the AI SDK sends
    `http://json-schema.org/draft-07/schema#` on every tool) is metadata, ~21 prompt
    tokens per tool that tell the model nothing."""
    return {key: value for key, value in schema.items() if key != "$schema"}
