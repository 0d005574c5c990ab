"""What `/v1/responses` takes and answers, for the OpenAPI document (server/openapi.py)."""

from __future__ import annotations

from typing import Any

from compat_serve.server.responses.items import HOSTED_ITEMS, TEXT_PARTS
from compat_serve.server.schema_rules import JSON_OBJECT_TEXT

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


# ------------------------------------------------------------------ request fields
# What the adapter (items.py, tools.py, adapter.py) accepts, field by field. Rules JSON
# Schema cannot state are in the descriptions: call arguments are the JSON text of an
# object, a named tool must be one of `tools` (and of the named kind), tool names are
# unique, grammars and JSON schemas must compile, `previous_response_id` must be stored.

_TEXT_PART_TYPES = [kind for kind in TEXT_PARTS if kind != "refusal"]
_PARTS = [
    {
        "type": "object",
        "properties": {"type": {"enum": _TEXT_PART_TYPES}, "text": _STR},
        "required": ["type", "text"],
    },
    {
        "type": "object",
        "properties": {"type": {"const": "refusal"}, "refusal": _STR},
        "required": ["type", "refusal"],
    },
    {
        "type": "object",
        "properties": {"type": {"const": "input_image"}, "image_url": {**_STR, "minLength": 1}},
        "required": ["type", "image_url"],
        "description": "a data: URL or an http(s) URL of an image the server can read",
        # Only in the document of a vision-language model (server/openapi.py).
        "x-vision-only": True,
    },
]
_CONTENT = {"anyOf": [_STR, {"type": "array", "items": {"anyOf": _PARTS}}]}
# Reasoning text (content, summary): no images.
_TEXT_CONTENT = {"anyOf": [_STR, {"type": "array", "items": {"anyOf": _PARTS[:2]}}]}
_ARGUMENTS = {**JSON_OBJECT_TEXT, "description": "the JSON text of an object (or blank)"}
_OPTIONAL_STR = {"anyOf": [_STR, _NULL]}


def _item(kind: str, fields: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"type": {"const": kind}, **fields},
        "required": ["type", *required],
    }


_MESSAGE_ITEM = {
    "type": "object",
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": _CONTENT,
    },
    "required": ["role"],
    "description": "`type` may be left out",
}
_CALL = {"call_id": _STR, "name": _STR, "namespace": _OPTIONAL_STR}
# Items that become a message of the conversation (reasoning alone renders nothing).
_RENDERED_ITEMS = [
    _MESSAGE_ITEM,
    _item("function_call", {**_CALL, "arguments": _ARGUMENTS}, ["call_id", "name", "arguments"]),
    _item("custom_tool_call", {**_CALL, "input": _STR}, ["call_id", "name", "input"]),
    *(
        _item(kind, {"call_id": _STR, "output": _CONTENT}, ["call_id", "output"])
        for kind in ("function_call_output", "custom_tool_call_output")
    ),
]
_REASONING_ITEM = _item(
    "reasoning",
    {
        "encrypted_content": _OPTIONAL_STR,
        "content": {"anyOf": [_TEXT_CONTENT, _NULL]},
        "summary": {"anyOf": [_TEXT_CONTENT, _NULL]},
    },
    [],
)
_HOSTED_ITEM = {
    "type": "object",
    "properties": {"type": {"enum": list(HOSTED_ITEMS)}},
    "required": ["type"],
    "description": "a hosted tool's item: ignored",
}
INPUT_ITEM = {"anyOf": [*_RENDERED_ITEMS, _REASONING_ITEM, _HOSTED_ITEM]}
INPUT = {
    "anyOf": [_STR, {"type": "array", "items": INPUT_ITEM}],
    "description": "a user message, or input items",
}

_NAME = {"type": "string", "minLength": 1}
_FUNCTION_TOOL = _item(
    "function",
    {
        "name": _NAME,
        "description": _OPTIONAL_STR,
        "parameters": {"anyOf": [{"type": "object"}, _NULL]},
        "strict": {"anyOf": [{"type": "boolean"}, _NULL]},
    },
    ["name"],
)
_CUSTOM_FORMAT = {
    "anyOf": [
        _NULL,
        {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
        _item(
            "grammar",
            {"syntax": {"const": "lark"}, "definition": {**_STR, "pattern": "\\S"}},
            ["syntax", "definition"],
        ),
        _item(
            "grammar",
            {"syntax": {"const": "regex"}, "definition": {**_STR, "minLength": 1}},
            ["syntax", "definition"],
        ),
    ]
}
_CUSTOM_TOOL = _item(
    "custom",
    {"name": _NAME, "description": _OPTIONAL_STR, "format": _CUSTOM_FORMAT},
    ["name"],
)
_NAMESPACE_TOOL = _item(
    "namespace",
    {"name": _NAME, "tools": {"type": "array", "items": {"anyOf": [_FUNCTION_TOOL, _CUSTOM_TOOL]}}},
    ["name", "tools"],
)
_HOSTED_TOOL = {
    "type": "object",
    "properties": {
        "type": {
            "type": "string",
            "minLength": 1,
            "not": {"enum": ["function", "custom", "namespace"]},
        }
    },
    "required": ["type"],
    "description": "a hosted tool (web_search, ...): ignored",
}
TOOLS = {
    "anyOf": [
        {
            "type": "array",
            "items": {"anyOf": [_FUNCTION_TOOL, _CUSTOM_TOOL, _NAMESPACE_TOOL, _HOSTED_TOOL]},
        },
        _NULL,
    ],
    "description": "tool names (with their namespace) are unique",
}
_NAMED = {"name": _STR, "namespace": _OPTIONAL_STR}
_LOCAL_CHOICE = {
    "type": "object",
    "properties": {"type": {"enum": ["function", "custom"]}},
    "required": ["type"],
}
TOOL_CHOICE = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {"type": {"enum": ["function", "custom"]}, **_NAMED},
            "required": ["type", "name"],
            "description": "one of tools, of this type",
        },
        _item(
            "allowed_tools",
            {
                "mode": {"enum": ["auto", "required"]},
                "tools": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {
                                "type": "object",
                                "properties": {"type": {"enum": ["function", "custom"]}, **_NAMED},
                                "required": ["type", "name"],
                                "description": "one of tools",
                            },
                            {
                                "type": "object",
                                "properties": {"type": {"not": {"enum": ["function", "custom"]}}},
                            },
                        ]
                    },
                },
            },
            ["tools"],
        )
        | {
            "anyOf": [
                {"properties": {"mode": {"const": "auto"}}},
                {"properties": {"tools": {"contains": _LOCAL_CHOICE}}},
            ]
        },
        {
            "type": "object",
            "properties": {
                "type": {
                    "type": "string",
                    "minLength": 1,
                    "not": {"enum": ["function", "custom", "allowed_tools"]},
                }
            },
            "required": ["type"],
            "description": "a hosted tool type: the model may still call the client's tools",
        },
        _NULL,
    ]
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
REASONING = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "effort": {"enum": [*EFFORTS, None]},
                "summary": {"enum": [*SUMMARIES, "none", None]},
            },
        },
        _NULL,
    ]
}
_TEXT_FORMAT = {
    "anyOf": [
        _NULL,
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        _item(
            "json_schema",
            {"name": _OPTIONAL_STR, "schema": {"type": "object", "description": "must compile"}},
            ["schema"],
        ),
    ]
}
TEXT = {"anyOf": [{"type": "object", "properties": {"format": _TEXT_FORMAT}}, _NULL]}

# A tool the model can call (`tool_choice: "required"` needs one).
_CALLABLE_TOOL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["function", "custom"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {"type": {"const": "namespace"}, "tools": {"minItems": 1}},
            "required": ["type", "tools"],
        },
    ]
}
REQUEST_RULES: list[Any] = [
    {
        "anyOf": [
            {
                "required": ["input"],
                "properties": {
                    "input": {
                        "anyOf": [
                            {**_STR, "minLength": 1},
                            {"type": "array", "contains": {"anyOf": _RENDERED_ITEMS}},
                        ]
                    }
                },
            },
            {
                "required": ["instructions"],
                "properties": {"instructions": {**_STR, "minLength": 1}},
            },
            {"required": ["previous_response_id"], "properties": {"previous_response_id": _STR}},
        ],
        "description": "Something to answer: a non-empty input (a message, a call or a call "
        "output; reasoning alone renders nothing), instructions, or a previous response.",
    },
    {
        "anyOf": [
            {"properties": {"tool_choice": {"not": {"const": "required"}}}},
            {
                "required": ["tools"],
                "properties": {"tools": {"type": "array", "contains": _CALLABLE_TOOL}},
            },
        ],
        "description": "tool_choice 'required' needs a function or custom tool.",
    },
]
