"""Anthropic Messages request bodies. Lenient: unknown fields are ignored, never an error.

Clients (Claude Code above all) add fields on every release: `cache_control` on any
block, `output_config` at the top level and per message, `context_management`,
`service_tier`, `container`, `defer_loading` on tools... All of them are accepted and
dropped here, except the structured-output schema in `output_config.format`.
Content blocks stay loosely typed (`type` plus whatever else was sent): the adapter
validates the block types it knows, so an unknown one gets a 400 that names
its position instead of a pydantic union error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.config import JsonDict

from compat_serve.engine.types import Usage
from compat_serve.server.json_types import INTEGRAL, U32_MAX, JsonInt
from compat_serve.server.schema_rules import needs, nullable, unless


class _Lenient(BaseModel):
    # Unknown fields are ignored; known ones must have their documented JSON type
    # (strict: no "1" for 1, no 0 for false), so the OpenAPI document tells the truth.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentBlock(BaseModel):
    """Any content block: `type` plus its other fields, kept as extras."""

    model_config = ConfigDict(extra="allow")

    type: str


# Block types by how the adapter treats them. Server-tool blocks (`*_tool_result`,
# `server_tool_use`...) and `redacted_thinking` are ignored wherever they appear.
IGNORED_BLOCKS = frozenset(
    {
        "redacted_thinking",
        "tool_reference",
        "server_tool_use",
        "mcp_tool_use",
        "mcp_tool_result",
        "container_upload",
    }
)
TEXT_ONLY_BLOCKS = {"image": "images", "document": "documents"}
KNOWN_BLOCKS = frozenset({"text", "tool_use", "tool_result", "thinking", "search_result"})
USER_BLOCKS = frozenset({"text", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "tool_use"})
TEXT_BLOCKS = frozenset({"text"})


# Typed views of the blocks the adapter understands (validated there, per position).


class TextBlock(_Lenient):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Lenient):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None


# The OpenAPI document's view of content blocks: per role, the types the adapter takes
# (and those it ignores); the runtime keeps them loose so a 400 names the position.
_NULL: JsonDict = {"type": "null"}
_TEXT = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_IGNORED = {
    "type": "object",
    "description": "accepted and ignored (server-tool and redacted blocks)",
    "properties": {
        "type": {
            "type": "string",
            "pattern": "^(" + "|".join(sorted(IGNORED_BLOCKS)) + ")$|_tool_result$",
        }
    },
    "required": ["type"],
}
_THINKING = {
    "type": "object",
    "properties": {
        "type": {"const": "thinking"},
        "thinking": {"type": "string"},
        "signature": {"anyOf": [{"type": "string"}, _NULL]},
    },
    "required": ["type", "thinking"],
}
_TOOL_USE = {
    "type": "object",
    "properties": {
        "type": {"const": "tool_use"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
    "required": ["type", "id", "name", "input"],
}
# Only in the document of a vision-language model (server/openapi.py).
_IMAGE = {
    "type": "object",
    "properties": {"type": {"const": "image"}, "source": {"type": "object"}},
    "required": ["type", "source"],
    "description": "a base64 or URL image source the server can read",
    "x-vision-only": True,
}
_TOOL_RESULT = {
    "type": "object",
    "properties": {
        "type": {"const": "tool_result"},
        "tool_use_id": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT, _IGNORED, _IMAGE]}},
                _NULL,
            ]
        },
        "is_error": {"anyOf": [{"type": "boolean"}, _NULL]},
    },
    "required": ["type", "tool_use_id"],
}


def _content(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": list(blocks)}}]}


def _message(roles: list[str], content: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"role": {"type": "string", "enum": roles}, "content": content},
        "required": ["role", "content"],
    }


SYSTEM_CONTENT_SCHEMA = _content(_TEXT, _IGNORED)
MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            _message(["user"], _content(_TEXT, _TOOL_RESULT, _IGNORED, _IMAGE)),
            _message(["assistant"], _content(_TEXT, _THINKING, _TOOL_USE, _IGNORED)),
            _message(["system", "developer"], SYSTEM_CONTENT_SCHEMA),
        ]
    },
    # Rules on the last message, which JSON Schema cannot state.
    "description": "A final assistant message (a prefill) cannot hold tool_use blocks nor "
    "end with whitespace, nor come with a structured output format. It may be empty, as "
    "Anthropic allows: an empty prefill is no prefill (alone, the model answers an empty "
    "conversation).",
}


class InputMessage(_Lenient):
    # `system` is an inline system message (Claude Code sends one after the user turn);
    # `developer` is not Anthropic but is treated as `system` when a client sends it.
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentBlock]


class ToolDef(_Lenient):
    """A client tool (`type` absent or `custom`) or a server tool (`bash_20250124`, ...)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {
                    "description": "a client tool: input_schema required",
                    "properties": {
                        "type": {"anyOf": [{"const": "custom"}, _NULL]},
                        "input_schema": {"type": "object"},
                    },
                    "required": ["input_schema"],
                },
                {
                    "description": "a server tool (ignored)",
                    "properties": {"type": {"type": "string", "not": {"const": "custom"}}},
                    "required": ["type"],
                },
            ]
        },
    )

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Strict tools: constrained calls always validate their input, so this changes nothing.
    strict: bool | None = None
    # A breakpoint after the tools (server/anthropic/breakpoints.py checks its shape).
    cache_control: Any = None

    @property
    def is_server_tool(self) -> bool:
        return self.type not in (None, "custom")


class ToolChoice(_Lenient):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {"properties": {"type": {"enum": ["auto", "any", "none"]}}},
                {
                    "properties": {"type": {"const": "tool"}, "name": {"type": "string"}},
                    "required": ["name"],
                    "description": "the name of one of the client tools",
                },
            ]
        },
    )

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {
                    "properties": {
                        "type": {"const": "enabled"},
                        "budget_tokens": {"type": "integer", "minimum": 1024},
                    },
                    "required": ["budget_tokens"],
                    "description": "budget_tokens must be less than max_tokens",
                },
                {"properties": {"type": {"enum": ["disabled", "adaptive"]}}},
            ]
        },
    )

    type: Literal["enabled", "disabled", "adaptive"]
    # Required (≥ 1024 and < max_tokens) when type is `enabled`; checked by the adapter.
    budget_tokens: JsonInt | None = None
    display: str | None = None


OUTPUT_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
            "required": ["type", "schema"],
        },
        _NULL,
    ]
}


_UNFORCED = nullable({"type": "object", "properties": {"type": {"enum": ["auto", "none"]}}})
_CLIENT_TOOL = {"type": "object", "properties": {"type": nullable({"const": "custom"})}}
_MESSAGES_RULES: list[Any] = [
    needs(
        "tool_choice",
        _UNFORCED,
        "tools",
        {"type": "array", "contains": _CLIENT_TOOL},
        "tool_choice any or tool needs a client tool; a named tool must be one of them.",
    ),
    unless(
        "tool_choice",
        _UNFORCED,
        {"properties": {"thinking": nullable({"properties": {"type": {"const": "disabled"}}})}},
        "Thinking may not be enabled when tool_choice forces tool use.",
    ),
]


class _MessagesBase(_Lenient):
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra={"allOf": _MESSAGES_RULES}
    )

    model: str
    messages: Annotated[list[InputMessage], WithJsonSchema(MESSAGES_SCHEMA)]
    system: Annotated[
        str | list[ContentBlock] | None,
        WithJsonSchema({"anyOf": [*SYSTEM_CONTENT_SCHEMA["anyOf"], _NULL]}),
    ] = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Structured outputs: `output_config.format` (GA) or the beta's top-level
    # `output_format`, both `{"type": "json_schema", "schema": {...}}`. The rest of
    # `output_config` (`effort`, ...) is accepted and ignored.
    output_config: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "object", "properties": {"format": OUTPUT_FORMAT_SCHEMA}},
                    _NULL,
                ]
            }
        ),
    ] = None
    # Both given: they must be equal (a rule JSON Schema cannot state).
    output_format: Annotated[dict[str, Any] | None, WithJsonSchema(OUTPUT_FORMAT_SCHEMA)] = None


class CountTokensRequest(_MessagesBase):
    """`POST /v1/messages/count_tokens`: a messages body without `max_tokens`."""


class MessagesRequest(_MessagesBase):
    """`POST /v1/messages`."""

    # 0 is valid: only fill the prompt cache.
    max_tokens: Annotated[int, Field(ge=0, le=U32_MAX), INTEGRAL]
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    stream: bool = False
    # `user_id` may be any JSON (Claude Code sends a JSON document as a string).
    metadata: dict[str, Any] | None = None


# Response side: the `usage` object of a message (and of the stream's message events).


@dataclass(frozen=True)
class AnthropicUsage:
    """Token counts; prompt tokens = input + cache_read + cache_creation."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    # Of the creation, the tokens under a 1-hour `cache_control` breakpoint.
    cache_creation_1h_tokens: int = 0

    @classmethod
    def from_usage(cls, usage: Usage) -> AnthropicUsage:
        """Exact figures from the engine: read = served from the prefix cache, creation =
        prompt tokens this request newly stored, input = the rest."""
        read, creation = usage.cached_tokens, usage.cache_creation_tokens
        uncached = usage.prompt_tokens - read - creation
        if uncached < 0:
            raise ValueError(f"inconsistent usage: {usage}")
        return cls(
            uncached, usage.completion_tokens, read, creation, usage.cache_creation_1h_tokens
        )

    def to_json(self) -> dict[str, Any]:
        """`cache_creation` splits `cache_creation_input_tokens` by TTL class, as Anthropic's
        does: the two always add up to it."""
        one_hour = min(self.cache_creation_1h_tokens, self.cache_creation_input_tokens)
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.cache_creation_input_tokens - one_hour,
                "ephemeral_1h_input_tokens": one_hour,
            },
        }
