"""Per-model message normalization, applied after an API adapter and before rendering.

Both rules are chosen once per model by probing its template (chat/probe.py):
inline system messages are kept in place (`preserve`) or folded into the neighbouring
user turn (`fold`, never hoisted to the top: that would change token 0 and destroy the
prefix cache); consecutive same-role turns are merged only if the template demands
strict alternation.
"""

from __future__ import annotations

from compat_serve.chat.types import Message

FOLD_SEPARATOR = "\n\n"


def _leading_system_count(messages: list[Message]) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return n


def _append_text(message: Message, text: str) -> Message:
    content = message.get("content") or ""
    return {**message, "content": f"{content}{FOLD_SEPARATOR}{text}" if content else text}


def _prepend_text(message: Message, text: str) -> Message:
    content = message.get("content") or ""
    return {**message, "content": f"{text}{FOLD_SEPARATOR}{content}" if content else text}


def fold_inline_system(messages: list[Message]) -> list[Message]:
    """Merge each inline system message into the user turn next to it.

    After a user turn: appended to it. After tool results (or between a tool call and
    its results): appended to the user turn that follows the results, or a new user
    turn placed right after them. Otherwise: prepended to the next user turn.
    """
    lead = _leading_system_count(messages)
    out: list[Message] = list(messages[:lead])
    pending: list[str] = []  # inline texts waiting for the next user turn
    for message in messages[lead:]:
        role = message.get("role")
        if role == "system":
            text = message.get("content") or ""
            if not text:
                continue
            if out and out[-1].get("role") == "user" and not pending:
                out[-1] = _append_text(out[-1], text)
            else:
                pending.append(text)
            continue
        if pending and role == "user":
            out.append(_prepend_text(message, FOLD_SEPARATOR.join(pending)))
            pending = []
            continue
        if pending and role != "tool":
            out.append({"role": "user", "content": FOLD_SEPARATOR.join(pending)})
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": FOLD_SEPARATOR.join(pending)})
    return out


def merge_same_roles(messages: list[Message]) -> list[Message]:
    """Merge consecutive user (or assistant) text turns for templates that need alternation."""
    out: list[Message] = []
    for message in messages:
        prev = out[-1] if out else None
        mergeable = (
            prev is not None
            and message.get("role") in ("user", "assistant")
            and prev.get("role") == message.get("role")
            and not prev.get("tool_calls")
            and not message.get("tool_calls")
        )
        if prev is not None and mergeable:
            out[-1] = _append_text(prev, message.get("content") or "")
        else:
            out.append(message)
    return out


def normalize_messages(
    messages: list[Message], *, inline_system: str, requires_alternation: bool
) -> list[Message]:
    if inline_system == "fold":
        messages = fold_inline_system(messages)
    if requires_alternation:
        messages = merge_same_roles(messages)
    return messages
