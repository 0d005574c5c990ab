"""What `/v1/responses` answers, for the OpenAPI document (server/openapi.py)."""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULL = {"type": "null"}
_ITEM = {
    "type": "object",
    "properties": {
        "type": {
            "type": "string",
            "enum": ["message", "reasoning", "function_call", "custom_tool_call"],
        },
        "id": _STR,
    },
    "required": ["type", "id"],
}

RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": _STR,
        "object": {"const": "response"},
        "created_at": _INT,
        "status": {"type": "string", "enum": ["completed", "incomplete", "failed"]},
        "model": _STR,
        "output": {"type": "array", "items": _ITEM},
        "error": {"anyOf": [{"type": "object"}, _NULL]},
        "incomplete_details": {"anyOf": [{"type": "object"}, _NULL]},
        "usage": {
            "type": "object",
            "properties": {
                "input_tokens": _INT,
                "input_tokens_details": {
                    "type": "object",
                    "properties": {"cached_tokens": _INT, "cache_write_tokens": _INT},
                    "required": ["cached_tokens"],
                },
                "output_tokens": _INT,
                "output_tokens_details": {
                    "type": "object",
                    "properties": {"reasoning_tokens": _INT},
                    "required": ["reasoning_tokens"],
                },
                "total_tokens": _INT,
            },
            "required": [
                "input_tokens",
                "input_tokens_details",
                "output_tokens",
                "output_tokens_details",
                "total_tokens",
            ],
        },
    },
    "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
}

# Server-sent events: `event: <type>`, `data: {"type": <type>, "sequence_number": n, ...}`;
# lines starting with `:` are keep-alive comments.
EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "pattern": "^response\\."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "properties": {"type": _STR, "sequence_number": _INT},
                "required": ["type", "sequence_number"],
            },
        },
    },
    "required": ["event", "data"],
}
