"""Responses input items → chat messages in the shape templates expect.

A run of assistant-side items (reasoning, an assistant message, function/custom calls)
becomes one assistant message: `reasoning_content`, `content`, `tool_calls` (arguments
as a dict; a custom call's raw input as `{"input": ...}`). Call outputs become `tool`
messages. `developer` is `system`. Items the server returned come back verbatim with
its ids; ids are ignored, call ids are kept.
"""

from __future__ import annotations

import json
from typing import Any

from compat_serve.chat.images import ImageError, ImageRef, join_parts, marker, url_image
from compat_serve.chat.types import Message
from compat_serve.server.output_format import bad
from compat_serve.server.responses.sealed_reasoning import ReasoningSeal
from compat_serve.server.responses.tools import CUSTOM_INPUT, chat_name

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
# Calls of hosted tools a client may send back: nothing to render.
HOSTED_ITEMS = (
    "web_search_call",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "tool_search_call",
    "tool_search_output",
    "mcp_list_tools",
)


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise bad(f"{where}.{key}", "field required")
    if not isinstance(value, str):
        raise bad(f"{where}.{key}", "must be a string")
    return value


def _optional_str(item: dict[str, Any], key: str, where: str) -> str | None:
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise bad(f"{where}.{key}", "must be a string")
    return value


def _image(part: dict[str, Any], where: str, images: list[ImageRef] | None) -> str:
    """An `input_image` part's marker, recording the image (a data: or http(s) URL)."""
    if images is None:
        raise bad(where, "this model is text-only and cannot read images")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        if part.get("file_id") is not None:
            raise bad(f"{where}.file_id", "files are not supported; send image_url")
        raise bad(f"{where}.image_url", "field required")
    try:
        images.append(url_image(url, f"{where}.image_url"))
    except ImageError as exc:
        raise bad(exc.param, str(exc).removeprefix(f"{exc.param}: ")) from exc
    return marker(len(images) - 1)


def content_text(content: object, where: str, images: list[ImageRef] | None = None) -> str:
    """A message's (or a call output's) content as text. `images`: where `input_image`
    parts go, each leaving its marker in the text (None: a text-only model, a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(at, "must be a content part object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise bad(f"{at}.{key}", "must be a string")
            texts.append(text)
        elif kind == "input_image":
            texts.append(_image(part, at, images))
        elif kind in ("input_file", "input_audio"):
            raise bad(at, f"{kind} parts are not supported")
        else:
            raise bad(f"{at}.type", f"unsupported content part type {kind!r}")
    return join_parts(texts)


class _Conversation:
    def __init__(self, seal: ReasoningSeal, images: list[ImageRef] | None) -> None:
        self.messages: list[Message] = []
        self.images = images
        self._seal = seal
        self._reasoning: list[str] = []
        self._call_names: dict[str, str] = {}

    def _assistant(self) -> Message:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"] = (last.get("reasoning_content") or "") + "".join(
                self._reasoning
            )
            self._reasoning = []
        return last

    def _close_assistant(self) -> None:
        self._reasoning = []  # reasoning with no answer after it is not rendered

    def message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(
                f"{where}.role", f"must be one of user, assistant, system, developer, not {role!r}"
            )
        text = content_text(item.get("content", ""), f"{where}.content", self.images)
        if role == "assistant":
            msg = self._assistant()
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + text
            return
        self._close_assistant()
        self.messages.append({"role": _ROLES[role], "content": text})

    def call(self, item: dict[str, Any], where: str, *, custom: bool) -> None:
        call_id = _str(item, "call_id", where)
        name = chat_name(_str(item, "name", where), _optional_str(item, "namespace", where))
        if custom:
            arguments: dict[str, Any] = {CUSTOM_INPUT: _str(item, "input", where)}
        else:
            raw = _str(item, "arguments", where)
            try:
                parsed = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as exc:
                raise bad(f"{where}.arguments", f"not valid JSON ({exc.msg})") from exc
            if not isinstance(parsed, dict):
                raise bad(f"{where}.arguments", "must be a JSON object")
            arguments = parsed
        self._call_names[call_id] = name
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self._assistant().setdefault("tool_calls", []).append(call)

    def output(self, item: dict[str, Any], where: str) -> None:
        call_id = _str(item, "call_id", where)
        if "output" not in item:
            raise bad(f"{where}.output", "field required")
        text = content_text(item["output"], f"{where}.output", self.images)
        self._close_assistant()
        msg: Message = {"role": "tool", "content": text, "tool_call_id": call_id}
        if call_id in self._call_names:
            msg["name"] = self._call_names[call_id]
        self.messages.append(msg)

    def reasoning(self, item: dict[str, Any], where: str) -> None:
        blob = item.get("encrypted_content")
        if blob is not None and not isinstance(blob, str):
            raise bad(f"{where}.encrypted_content", "must be a string")
        # The sealed text, else the content, else the summary; null or empty: none.
        texts = [self._seal.open(blob) if blob else None]
        for key in ("content", "summary"):
            value = item.get(key)
            texts.append(None if value is None else content_text(value, f"{where}.{key}"))
        restored = next((text for text in texts if text), None)
        if restored:
            self._reasoning.append(restored)


def input_messages(
    items: str | list[Any],
    seal: ReasoningSeal,
    where: str = "input",
    images: list[ImageRef] | None = None,
) -> list[Message]:
    """`images`: where `input_image` parts go (None: a text-only model, a 400)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    conversation = _Conversation(seal, images)
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "must be an input item object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            conversation.message(item, at)
        elif kind in ("function_call", "custom_tool_call"):
            conversation.call(item, at, custom=kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            conversation.output(item, at)
        elif kind == "reasoning":
            conversation.reasoning(item, at)
        elif kind in HOSTED_ITEMS:
            continue
        elif kind is None:
            raise bad(f"{at}.type", "field required")
        else:
            raise bad(f"{at}.type", f"unsupported input item type {kind!r}")
    return conversation.messages
