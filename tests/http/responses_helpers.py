"""Helpers for the Responses API tests: raw SSE events checked against the openai SDK's
own event types, and Codex's real `apply_patch` grammar with an independent checker."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

_EVENT = TypeAdapter(ResponseStreamEvent)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

# Codex's freeform apply_patch tool grammar, verbatim (openai/codex,
# codex-rs/core/src/tool_apply_patch.lark).
APPLY_PATCH_LARK = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""
APPLY_PATCH_TOOL: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK},
}

# The same language as a regular expression, written from the grammar by hand: a check
# that does not go through the grammar engine under test.
_L = r"[^\n]"
_ADD = rf"\*\*\* Add File: {_L}+\n(?:\+{_L}*\n)+"
_DELETE = rf"\*\*\* Delete File: {_L}+\n"
_CHANGE = rf"(?:(?:@@|@@ {_L}+)\n|[-+ ]{_L}*\n)+(?:\*\*\* End of File\n)?"
_UPDATE = rf"\*\*\* Update File: {_L}+\n(?:\*\*\* Move to: {_L}+\n)?(?:{_CHANGE})?"
_PATCH = re.compile(rf"\*\*\* Begin Patch\n(?:{_ADD}|{_DELETE}|{_UPDATE})+\*\*\* End Patch\n?")


def is_apply_patch(text: str) -> bool:
    return _PATCH.fullmatch(text) is not None


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


def _sdk_view(event: dict[str, Any]) -> dict[str, Any]:
    """The event as the SDK's types check it. One deliberate difference: a prompt past the
    context fails with code `context_length_exceeded` (what OpenAI sends and Codex
    reads), which the SDK's `ResponseError.code` literal does not list."""
    error: dict[str, Any] = (event.get("response") or {}).get("error") or {}
    if event["type"] == "response.failed" and error.get("code") == "context_length_exceeded":
        response = {**event["response"], "error": {**error, "code": "server_error"}}
        return {**event, "response": response}
    return event


def stream_events(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streamed request; every event validated as the SDK's event type, numbered
    from 0, named like its `type`, opened by created/in_progress, closed by a terminal
    event."""
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{base_url}/v1/responses", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                parsed = _EVENT.validate_python(_sdk_view(event))
                assert parsed.type == event["type"]
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in events) == 1
    return events


def final_response(events: list[dict[str, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = events[-1]["response"]
    return response
