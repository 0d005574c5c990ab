"""`--max-tool-rounds`: after N rounds of tool calls since the user's last message, the
model must answer in text.

Agent clients (Codex, Claude Code) run every call the model makes and ask again; they end
the turn only when the model answers without a call. A small model that repeats the same
call after each result never ends it, and Codex has no turn limit of its own. This is an
operator's turn limit on the server side: once the conversation has N assistant turns
with calls after its last user message, the request is served without tools (as with
`tool_choice: none`), so the answer is text. Off by default.
"""

from __future__ import annotations

import dataclasses
import logging

from compat_serve.chat.types import ChatRequest

log = logging.getLogger("compat_serve.server")


def tool_rounds(chat: ChatRequest) -> int:
    """Assistant turns with tool calls after the last user message."""
    rounds = 0
    for message in reversed(chat.messages):
        if message.get("role") == "user":
            break
        if message.get("role") == "assistant" and message.get("tool_calls"):
            rounds += 1
    return rounds


def limit_tool_rounds(chat: ChatRequest, limit: int | None) -> ChatRequest:
    """`chat`, or `chat` without tools once it has `limit` tool rounds."""
    if limit is None or not chat.tools:
        return chat
    rounds = tool_rounds(chat)
    if rounds < limit:
        return chat
    log.info("%d tool rounds since the user's last message: answering without tools", rounds)
    return dataclasses.replace(chat, tools=None, tool_choice="none", forced_tool=None)
