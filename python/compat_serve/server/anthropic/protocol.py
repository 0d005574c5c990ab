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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from compat_serve.engine.types import Usage


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class InputMessage(_Lenient):
    # `system` is an inline system message (Claude Code sends one after the user turn);
    # `developer` is not Anthropic but is treated as `system` when a client sends it.
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentBlock]


class ToolDef(_Lenient):
    """A client tool (`type` absent or `custom`) or a server tool (`bash_20250124`, ...)."""

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Strict tools: constrained calls always validate their input, so this changes nothing.
    strict: bool | None = None

    @property
    def is_server_tool(self) -> bool:
        return self.type not in (None, "custom")


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    # Required (≥ 1024 and < max_tokens) when type is `enabled`; checked by the adapter.
    budget_tokens: int | None = None
    display: str | None = None


class _MessagesBase(_Lenient):
    model: str
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Structured outputs: `output_config.format` (GA) or the beta's top-level
    # `output_format`, both `{"type": "json_schema", "schema": {...}}`. The rest of
    # `output_config` (`effort`, ...) is accepted and ignored.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None


class CountTokensRequest(_MessagesBase):
    """`POST /v1/messages/count_tokens`: a messages body without `max_tokens`."""


class MessagesRequest(_MessagesBase):
    """`POST /v1/messages`."""

    # 0 is valid: only fill the prompt cache.
    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
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

    @classmethod
    def from_usage(cls, usage: Usage) -> AnthropicUsage:
        """Exact figures from the engine: read = served from the prefix cache, creation =
        prompt tokens this request newly stored, input = the rest."""
        read, creation = usage.cached_tokens, usage.cache_creation_tokens
        uncached = usage.prompt_tokens - read - creation
        if uncached < 0:
            raise ValueError(f"inconsistent usage: {usage}")
        return cls(uncached, usage.completion_tokens, read, creation)

    def to_json(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
        }
