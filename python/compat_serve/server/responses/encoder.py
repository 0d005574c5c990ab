"""Parsed output → Responses output items and the stream events that build them.

One `ResponseBuilder` per request turns parser events into OpenAI's event sequence
(`response.created`, `response.in_progress`, `response.output_item.added`, content
parts, deltas, `.done` events, `response.completed` / `.incomplete` / `.failed`),
numbering every event. The non-streamed response is the builder's final `response`:
the same code builds both, so they cannot disagree.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from compat_serve.engine.types import EngineEvent, FinishReason, Usage
from compat_serve.parsers import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from compat_serve.server.responses.sealed_reasoning import ReasoningSeal
from compat_serve.server.responses.tools import CUSTOM_INPUT, ResponseTools, ToolEntry

Event = dict[str, Any]
_INCOMPLETE = (FinishReason.LENGTH, FinishReason.CONTEXT)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_json(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_creation_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def custom_input(arguments: str) -> str:
    """A custom call's raw input from the function-shaped call the model wrote."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments
    value = parsed.get(CUSTOM_INPUT) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


class ResponseBuilder:
    def __init__(
        self,
        response: dict[str, Any],
        tools: ResponseTools,
        *,
        raw_custom: ToolEntry | None = None,
        seal: ReasoningSeal | None = None,
        summary: bool = False,
    ) -> None:
        """`response`: the response object's request-derived fields (id, model, ...)."""
        self.response = {**response, "status": "in_progress", "output": [], "usage": None}
        self._tools = tools
        self._raw_custom = raw_custom
        self._seal = seal
        self._summary = summary
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being generated
        self._open_kind = ""
        self._buffer = ""  # the open item's text / arguments so far
        self._calls: dict[int, dict[str, Any]] = {}
        self.reasoning_tokens = 0
        self.finish_reason: FinishReason | None = None
        # The turn ended in tool calls (an abort once the allowed calls were made).
        self.ended_in_tool_calls = False

    # ---- events -----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return _copy(self.response)

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _add(self, item: dict[str, Any], kind: str) -> list[Event]:
        events = self._close()
        self.response["output"].append(item)
        self._open, self._open_kind, self._buffer = item, kind, ""
        added = _copy(item)
        events.append(
            self._event("response.output_item.added", output_index=self._index, item=added)
        )
        return events

    def feed(self, engine: EngineEvent, output: list[OutputEvent]) -> list[Event]:
        if any(isinstance(e, ReasoningDelta) for e in output):
            self.reasoning_tokens += len(engine.token_ids)
        events: list[Event] = []
        for piece in output:
            events += self._piece(piece)
        return events

    def _piece(self, piece: OutputEvent) -> list[Event]:
        if isinstance(piece, TextDelta):
            if self._raw_custom is not None:
                return self._custom_text(piece.text)
            return self._text(piece.text)
        if isinstance(piece, ReasoningDelta):
            return self._reasoning(piece.text)
        if isinstance(piece, ToolCallStart):
            return self._call_start(piece)
        if isinstance(piece, ToolCallArgsDelta):
            return self._call_args(piece.fragment)
        if isinstance(piece, ToolCallEnd):
            return self._close()
        return []

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self._open_kind != "message":
            message = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            events += self._add(message, "message")
            events.append(self._part_event("response.content_part.added", _output_text("")))
        self._buffer += text
        assert self._open is not None
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._open["id"],
                output_index=self._index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> Event:
        assert self._open is not None
        return self._event(
            kind, item_id=self._open["id"], output_index=self._index, content_index=0, part=part
        )

    def _reasoning(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self._open_kind != "reasoning":
            item = {
                "id": item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
            }
            events += self._add(item, "reasoning")
            events.append(self._part_event("response.content_part.added", _reasoning_text("")))
        self._buffer += text
        assert self._open is not None
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self._open["id"],
                output_index=self._index,
                content_index=0,
                delta=text,
            )
        )
        return events

    def _call_item(self, entry: ToolEntry, call_id: str) -> dict[str, Any]:
        if entry.kind == "custom":
            item = {"id": item_id("ctc"), "type": "custom_tool_call", "call_id": call_id}
            item.update({"name": entry.name, "input": ""})
        else:
            item = {"id": item_id("fc"), "type": "function_call", "call_id": call_id}
            item.update({"name": entry.name, "arguments": "", "status": "in_progress"})
        if entry.namespace:
            item["namespace"] = entry.namespace
        return item

    def _call_start(self, start: ToolCallStart) -> list[Event]:
        entry = self._tools.entry(start.name)
        kind = "custom" if entry.kind == "custom" else "function"
        return self._add(self._call_item(entry, start.id), kind)

    def _call_args(self, fragment: str) -> list[Event]:
        self._buffer += fragment
        if self._open_kind != "function" or not fragment:
            return []  # a custom call's input is sent whole once its JSON is complete
        assert self._open is not None
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=self._open["id"],
                output_index=self._index,
                delta=fragment,
            )
        ]

    def _custom_text(self, text: str) -> list[Event]:
        """A forced custom tool: the output text is the call's input, streamed as is."""
        if not text:
            return []
        events: list[Event] = []
        if self._open_kind != "raw_custom":
            assert self._raw_custom is not None
            item = self._call_item(self._raw_custom, item_id("call"))
            events += self._add(item, "raw_custom")
        self._buffer += text
        assert self._open is not None
        events.append(
            self._event(
                "response.custom_tool_call_input.delta",
                item_id=self._open["id"],
                output_index=self._index,
                delta=text,
            )
        )
        return events

    # ---- closing ------------------------------------------------------------------------

    def _close(self, status: str = "completed") -> list[Event]:
        item, kind, text = self._open, self._open_kind, self._buffer
        if item is None:
            return []
        self._open, self._open_kind, self._buffer = None, "", ""
        where = {"item_id": item["id"], "output_index": self._index}
        events: list[Event] = []
        if kind == "message":
            part = _output_text(text)
            item["content"] = [part]
            item["status"] = status
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif kind == "reasoning":
            events += self._close_reasoning(item, text, where, status)
        elif kind == "function":
            item["arguments"] = text
            item["status"] = status
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=text)
            )
        else:  # custom, raw_custom
            value = custom_input(text) if kind == "custom" else text
            item["input"] = value
            if kind == "custom" and value:
                events.append(
                    self._event("response.custom_tool_call_input.delta", **where, delta=value)
                )
            events.append(self._event("response.custom_tool_call_input.done", **where, input=value))
        done = _copy(item)
        events.append(
            self._event("response.output_item.done", output_index=where["output_index"], item=done)
        )
        return events

    def _close_reasoning(
        self, item: dict[str, Any], text: str, where: dict[str, Any], status: str
    ) -> list[Event]:
        events = [
            self._event("response.reasoning_text.done", **where, content_index=0, text=text),
            self._event(
                "response.content_part.done", **where, content_index=0, part=_reasoning_text(text)
            ),
        ]
        item["content"] = [_reasoning_text(text)]
        item["status"] = status
        if self._summary:
            part = {"type": "summary_text", "text": text}
            empty = {"type": "summary_text", "text": ""}
            at = {**where, "summary_index": 0}
            events += [
                self._event("response.reasoning_summary_part.added", **at, part=empty),
                self._event("response.reasoning_summary_text.delta", **at, delta=text),
                self._event("response.reasoning_summary_text.done", **at, text=text),
                self._event("response.reasoning_summary_part.done", **at, part=part),
            ]
            item["summary"] = [part]
        if self._seal is not None:
            item["encrypted_content"] = self._seal.seal(text)
        return events

    def finish(self, final: EngineEvent, *, ended_in_tool_calls: bool) -> list[Event]:
        """Close the open item and end the response (completed, incomplete or failed)."""
        reason = self.finish_reason = final.finish_reason
        self.ended_in_tool_calls = ended_in_tool_calls
        cut = reason in _INCOMPLETE and not ended_in_tool_calls
        if reason in (FinishReason.ERROR, FinishReason.SHUTDOWN):
            return self.fail("server_error", final.error or "the server is shutting down")
        events = self._close("incomplete" if cut else "completed")
        assert final.usage is not None
        self.response["usage"] = usage_json(final.usage, self.reasoning_tokens)
        if cut:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return [*events, self._event("response.completed", response=self._snapshot())]

    def fail(self, code: str, message: str) -> list[Event]:
        events = self._close("incomplete")
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self._snapshot())]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def base_response(response_id: str, body: Any, tool_choice: Any) -> dict[str, Any]:
    """The request-derived fields of a response object."""
    reasoning = body.reasoning or {}
    fmt = (body.text or {}).get("format") or {"type": "text"}
    response = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": {"format": fmt},
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
    }
    if body.prompt_cache_key is not None:
        response["prompt_cache_key"] = body.prompt_cache_key
    return response


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A deep copy (events keep the item as it was when they were sent)."""
    copied: dict[str, Any] = json.loads(json.dumps(value))
    return copied
