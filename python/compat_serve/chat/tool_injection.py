"""Tools for chat templates that ignore `tools`: told in the system prompt, answered in
the JSON envelope (parsers/formats/envelope.py).

`inject_tools` rewrites a conversation for such a template:

- a system text lists the tools (name, a brief description, the parameters' JSON schema
  as compact JSON in the given key order) and explains the envelope; it is appended to
  the leading system message, or becomes one. The same tools give the same bytes every
  turn, so the prompt prefix cache keeps hitting;
- assistant turns become the envelope the model would have generated for them
  (`{"tool_calls": [...]}` or `{"response": "..."}`, json.dumps layout), so the
  rendered history matches the generated tokens;
- tool results stay `tool` messages (when the template renders that role) or become
  user messages `Tool result (NAME): ...`.

Descriptions are shortened (first paragraph, a few hundred characters) so an 8k-context
model still has room for the conversation; the grammar uses the full schemas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from compat_serve.chat.types import Message

TOOL_DESCRIPTION_CHARS = 400
PARAMETER_DESCRIPTION_CHARS = 120

_HEADER = (
    "# Tools\n\n"
    "You can call these tools. One tool per line: its name, what it does and the JSON "
    "schema of its arguments.\n\n"
)
# The answer's example holds no text to copy: a small model copies whatever follows
# `{"response": "` in its prompt as its answer (#25: SmolLM2-135M answered "your answer"
# to 3 of 8 prompts), and without any answer example it calls tools for a greeting.
_FORMAT = (
    "\n\n# Reply format\n\n"
    "Reply with exactly one JSON object and nothing else. To call tools:\n"
    '{"tool_calls": [{"name": "TOOL_NAME", "arguments": {...}}]}\n'
    "Give only the arguments the call needs: leave optional ones out.\n"
    "To answer the user:\n"
    '{"response": MESSAGE}\n'
    "with MESSAGE your message as a JSON string. Tool results come back in the next message."
)


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text for template-shaped tools (`{"type": "function", "function": ...}`)."""
    lines = [_tool_line(tool.get("function") or {}) for tool in tools]
    return _HEADER + "\n".join(lines) + _FORMAT


def inject_tools(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_role: bool = True,
    continue_final_message: bool = False,
) -> list[Message]:
    """`messages` with the tools told in the system prompt and the history in envelope form.

    `tool_role`: keep tool results as `tool` messages (the template renders that role);
    otherwise they become user messages. `continue_final_message`: the last message is an
    assistant prefill to continue, left as it is.
    """
    out: list[Message] = []
    names: dict[str, str] = {}  # call id → tool name, for tool results
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and not (continue_final_message and i == last):
            out.append(_assistant(message, names))
        elif role == "tool":
            out.append(_tool_result(message, names, tool_role=tool_role))
        else:
            out.append(dict(message))
    text = tools_prompt(tools)
    if out and out[0].get("role") == "system":
        head = out[0].get("content") or ""
        out[0]["content"] = f"{head}\n\n{text}" if head else text
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def envelope_text(content: str, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """What the model writes for a turn: its calls, or its text as a response."""
    if not tool_calls:
        return _dump({"response": content})
    calls = []
    for call in tool_calls:
        function = call.get("function") or call
        calls.append({"name": function.get("name"), "arguments": _arguments(function)})
    envelope = _dump({"tool_calls": calls})
    # Text beside calls (history from another model): kept, ahead of the envelope.
    return f"{content}\n{envelope}" if content else envelope


def _assistant(message: Message, names: dict[str, str]) -> Message:
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        if isinstance(call.get("id"), str):
            names[call["id"]] = str(function.get("name"))
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = envelope_text(message.get("content") or "", calls)
    return out


def _tool_result(message: Message, names: dict[str, str], *, tool_role: bool) -> Message:
    if tool_role:
        return dict(message)
    call_id = message.get("tool_call_id")
    label = names.get(call_id, call_id) if isinstance(call_id, str) else None
    head = f"Tool result ({label})" if label else "Tool result"
    return {"role": "user", "content": f"{head}: {message.get('content') or ''}"}


def _tool_line(function: Mapping[str, Any]) -> str:
    entry: dict[str, Any] = {"name": function.get("name")}
    description = function.get("description")
    if isinstance(description, str) and description.strip():
        entry["description"] = _brief(description, TOOL_DESCRIPTION_CHARS)
    parameters = function.get("parameters")
    if isinstance(parameters, Mapping):
        entry["parameters"] = _brief_schema({k: v for k, v in parameters.items() if k != "$schema"})
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def _brief_schema(value: Any) -> Any:
    """The schema with every `description` text shortened."""
    if isinstance(value, Mapping):
        return {
            k: _brief(v, PARAMETER_DESCRIPTION_CHARS)
            if k == "description" and isinstance(v, str)
            else _brief_schema(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_brief_schema(v) for v in value]
    return value


def _brief(text: str, limit: int) -> str:
    """The first paragraph, cut at a word boundary within `limit` characters."""
    first = text.strip().split("\n\n", 1)[0].strip()
    if len(first) <= limit:
        return first
    cut = first[:limit].rsplit(" ", 1)[0].rstrip(" ,;:")
    return cut + "…"


def _arguments(function: Mapping[str, Any]) -> Any:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return {} if arguments is None else arguments


def _dump(value: Any) -> str:
    # json.dumps' default separators: the layout the envelope grammar generates.
    return json.dumps(value, ensure_ascii=False)
