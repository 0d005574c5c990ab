"""Anthropic response side: the message body and its SSE stream, from parsed output.

Blocks follow generation order: `thinking` (closed by a `signature_delta`), `text`, and
`tool_use` (opened with `input: {}`, then `input_json_delta` fragments that concatenate
to the input). Starting a block closes the open one.
"""

from __future__ import annotations

import hashlib
from typing import Any

from compat_serve.engine.types import EngineEvent, FinishReason
from compat_serve.parsers import (
    OutputEvent,
    ParsedTurn,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from compat_serve.parsers.events import ReasoningPart, TextPart
from compat_serve.server.anthropic.protocol import AnthropicUsage
from compat_serve.server.errors import anthropic_error_payload, generation_error
from compat_serve.server.lifecycle import SHUTTING_DOWN
from compat_serve.server.sse import event

STOP_REASONS = {
    FinishReason.STOP_TOKEN: "end_turn",
    FinishReason.STOP_STRING: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.CONTEXT: "model_context_window_exceeded",
}


def stop_fields(final: EngineEvent, *, tool_use: bool = False) -> tuple[str | None, str | None]:
    """`(stop_reason, stop_sequence)` for a request's final event."""
    if tool_use:
        return "tool_use", None
    reason = STOP_REASONS.get(final.finish_reason) if final.finish_reason else None
    sequence = final.matched_stop if final.finish_reason is FinishReason.STOP_STRING else None
    return reason, sequence


def thinking_signature(thinking: str) -> str:
    """A stable signature for a thinking block (clients echo it back; we never check it)."""
    return "compat-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _message(
    message_id: str, model: str, content: list[dict[str, Any]], usage: AnthropicUsage
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage.to_json(),
    }


def content_blocks(turn: ParsedTurn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in turn.parts:
        if isinstance(part, TextPart):
            blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ReasoningPart):
            signature = thinking_signature(part.text)
            blocks.append({"type": "thinking", "thinking": part.text, "signature": signature})
        elif isinstance(part, ToolCall):
            blocks.append(
                {
                    "type": "tool_use",
                    "id": part.id,
                    "name": part.name,
                    "input": part.parsed_arguments(),
                }
            )
    return blocks


def message_response(
    message_id: str,
    model: str,
    output: str | ParsedTurn,
    final_event: EngineEvent,
    usage: AnthropicUsage,
    *,
    tool_use: bool = False,
) -> dict[str, Any]:
    turn = ParsedTurn([TextPart(output)] if output else []) if isinstance(output, str) else output
    body = _message(message_id, model, content_blocks(turn), usage)
    body["stop_reason"], body["stop_sequence"] = stop_fields(final_event, tool_use=tool_use)
    return body


class MessageStreamEncoder:
    """Turns engine events (and their parsed output) into Anthropic SSE frames."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.finished = False
        self._usage: AnthropicUsage | None = None
        self._block_types: list[str] = []
        self._open: int | None = None
        self._thinking = ""  # text of the open thinking block, for its signature
        self._output_tokens = 0

    def start(
        self,
        prompt_tokens: int,
        cache_read: int = 0,
        cache_creation: int = 0,
        cache_creation_1h: int = 0,
    ) -> str:
        uncached = max(0, prompt_tokens - cache_read - cache_creation)
        self._usage = AnthropicUsage(uncached, 0, cache_read, cache_creation, cache_creation_1h)
        message = _message(self.message_id, self.model, [], self._usage)
        return event("message_start", {"type": "message_start", "message": message})

    def ping(self) -> str:
        return event("ping", {"type": "ping"})

    def feed(
        self,
        engine_event: EngineEvent,
        output: list[OutputEvent] | None = None,
        *,
        tool_use: bool = False,
    ) -> str:
        """Frames for one engine event. `output` is its parsed text (default: all text);
        `tool_use` on the final event makes the stop reason `tool_use`."""
        if self._usage is None:
            raise RuntimeError("MessageStreamEncoder.start() must come before feed()")
        if self.finished:
            return ""
        self._output_tokens += len(engine_event.token_ids)
        reason = engine_event.finish_reason
        if reason is FinishReason.SHUTDOWN:
            return self.error("overloaded_error", SHUTTING_DOWN)
        if reason in (FinishReason.ERROR, FinishReason.ABORTED) and not tool_use:
            aborted = reason is FinishReason.ABORTED
            if aborted:
                detail = engine_event.error or "request aborted"
                return self.error("api_error", f"generation failed: {detail}")
            error = generation_error(engine_event.error)
            kind = "api_error" if error.status >= 500 else "invalid_request_error"
            return self.error(kind, error.message)
        if output is None:
            output = [TextDelta(engine_event.text)] if engine_event.text else []
        frames = "".join(self._output(e) for e in output)
        if reason is not None:
            frames += self._finish(engine_event, self._usage, tool_use)
        return frames

    def error(self, kind: str, message: str) -> str:
        self.finished = True
        return event("error", anthropic_error_payload(kind, message))

    # -- blocks

    def _output(self, item: OutputEvent) -> str:
        if isinstance(item, TextDelta):
            return self._ensure("text", {"type": "text", "text": ""}) + self._delta(
                {"type": "text_delta", "text": item.text}
            )
        if isinstance(item, ReasoningDelta):
            frames = self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking += item.text
            return frames + self._delta({"type": "thinking_delta", "thinking": item.text})
        if isinstance(item, ToolCallStart):
            block = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
            return self._start_block(block)
        if isinstance(item, ToolCallArgsDelta):
            return self._delta({"type": "input_json_delta", "partial_json": item.fragment})
        if isinstance(item, ToolCallEnd):
            return self._stop_block()
        return ""

    def _ensure(self, kind: str, content_block: dict[str, Any]) -> str:
        if self._open is not None and self._block_types[self._open] == kind:
            return ""
        return self._start_block(content_block)

    def _start_block(self, content_block: dict[str, Any]) -> str:
        frames = self._stop_block()
        index = len(self._block_types)
        self._block_types.append(str(content_block["type"]))
        self._open = index
        payload = {"type": "content_block_start", "index": index, "content_block": content_block}
        return frames + event("content_block_start", payload)

    def _delta(self, delta: dict[str, Any]) -> str:
        payload = {"type": "content_block_delta", "index": self._open, "delta": delta}
        return event("content_block_delta", payload)

    def _stop_block(self) -> str:
        if self._open is None:
            return ""
        frames = ""
        if self._block_types[self._open] == "thinking":
            signature = thinking_signature(self._thinking)
            frames = self._delta({"type": "signature_delta", "signature": signature})
            self._thinking = ""
        index, self._open = self._open, None
        return frames + event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _finish(self, final: EngineEvent, usage: AnthropicUsage, tool_use: bool) -> str:
        self.finished = True
        output = final.usage.completion_tokens if final.usage else self._output_tokens
        if final.usage is not None:  # exact cache figures replace the admission preview
            usage = AnthropicUsage.from_usage(final.usage)
        stop_reason, stop_sequence = stop_fields(final, tool_use=tool_use)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {**usage.to_json(), "output_tokens": output},
        }
        return (
            self._stop_block()
            + event("message_delta", delta)
            + event("message_stop", {"type": "message_stop"})
        )
