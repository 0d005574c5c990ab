"""Past tool calls reshaped for templates that refuse the usual shape (object arguments,
the server's own call ids), tried only when a conversation with calls fails to render.

- String arguments: templates that concatenate `arguments` into text (Functionary v3.1's
  `'<function=' + name + '>' + arguments`) need the JSON text, laid out as `tojson`
  writes it (`json.dumps`), which is also how the model wrote it under the grammar.
- Nine-character ids: Mistral's templates raise unless every call id (and the tool
  result's `tool_call_id`) is 9 alphanumerics; a stable digest of the id keeps call and
  result paired, and every turn renders it the same way (so the prefix cache still hits).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from compat_serve.chat.types import Message

_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def string_arguments(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls")
        reshaped = dict(message)
        if calls:
            reshaped["tool_calls"] = [_with_string_arguments(c) for c in calls]
        out.append(reshaped)
    return out


def nine_character_ids(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls")
        reshaped = dict(message)
        if calls:
            reshaped["tool_calls"] = [{**c, "id": short_id(c.get("id"))} for c in calls]
        if message.get("tool_call_id"):
            reshaped["tool_call_id"] = short_id(message["tool_call_id"])
        out.append(reshaped)
    return out


def short_id(call_id: Any) -> str:
    """A 9-alphanumeric id for `call_id` (kept when it already is one)."""
    text = str(call_id or "")
    if len(text) == 9 and text.isascii() and text.isalnum():
        return text
    number = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALNUM))
        chars.append(_ALNUM[digit])
    return "".join(chars)


def _with_string_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or isinstance(function.get("arguments"), str):
        return call
    arguments = json.dumps(function.get("arguments") or {}, ensure_ascii=False)
    return {**call, "function": {**function, "arguments": arguments}}


Reshape = Callable[[Sequence[Message]], list[Message]]
# In the order tried.
RESHAPES: tuple[Reshape, ...] = (
    string_arguments,
    nine_character_ids,
    lambda messages: nine_character_ids(string_arguments(messages)),
)
