"""Replies the server generated, kept so that a next turn which echoes one continues from
the very tokens the model read and wrote (#14 item 3).

Many chat templates render a past assistant turn otherwise than the model produced it:
the generation prompt's `<think>` or empty thinking block is not kept (Qwen3, QwQ,
DeepSeek-R1, MiniMax-M2, Gemma 4, Nemotron), past calls are not rendered at all
(Granite 3.x, SmolLM3, LFM2.5), or calls come back in another syntax (GigaChat, Apriel).
The next turn's prompt then leaves the prefix cache right after the history, and the
whole reply and everything after it is computed again on every turn of an agent loop.

When the client echoes a reply this server generated (same tool-call ids, names and
arguments, same text), and the conversation before it renders exactly as it did when
the reply was generated, the prompt builder (chat/prompt.py) writes that earlier prompt
and the reply's own tokens where the template would have re-rendered them, and the
template's rendering of everything after the reply behind them. What the model reads is
what it saw and wrote, and the prefix cache serves all of it.

`--reply-history` chooses which echoed replies get this: `loop` (the default) those
after the last user message, the current tool loop, as Anthropic and Qwen3 keep
thinking within a tool loop; earlier turns render as the template says. `all` keeps
every recognised reply (the cache then survives new user messages too, and the prompt
keeps reasoning the template would drop). `template` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

REPLY_HISTORY_MODES = ("loop", "all", "template")
# Prompt tokens kept in memory for recognised replies, at the most (about 4 bytes each
# as ids, and about as much again as text: some 32 MB). An agent needs only its latest
# reply's.
DEFAULT_TOKEN_BUDGET = 4_000_000


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class GeneratedReply:
    """One reply as generated: the prompt it answered and its own tokens."""

    prompt_text: str
    # An array("I") in the server: 4 bytes a token instead of a tuple's ~36.
    prompt_ids: Sequence[int]
    # The template's own rendering of the conversation it answered (`Prompt.rendered`).
    rendered_digest: bytes
    reply_text: str
    reply_ids: tuple[int, ...]  # without the stop token
    # Texts that end the reply in the template's rendering: the stop token the model
    # wrote, or the model's end-of-turn tokens when generation was cut short.
    end_markers: tuple[str, ...]
    reasoning: str


def _folded(text: str) -> str:
    """Text without white space: APIs join and trim text blocks differently."""
    return "".join(text.split())


def _arguments(value: Any) -> str:
    """Arguments as canonical JSON (an object, or the JSON text of one)."""
    if isinstance(value, str):
        text: str = value
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return "\x02" + text
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def reply_key(text: str, calls: Iterable[tuple[str, str, Any]]) -> str:
    """What identifies a reply: its text and its calls' (id, name, arguments)."""
    parts = [_folded(text)]
    parts += [f"{call_id}\x00{name}\x00{_arguments(args)}" for call_id, name, args in calls]
    return "\x01".join(parts)


def content_text(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def message_key(message: dict[str, Any]) -> str | None:
    """`reply_key` of an assistant message as a client sends it back (None otherwise)."""
    if message.get("role") != "assistant":
        return None
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return None
        calls.append((call.get("id", ""), function.get("name", ""), function.get("arguments")))
    return reply_key(content_text(message.get("content")), calls)


def echoes_reasoning_of(message: dict[str, Any], reply: GeneratedReply) -> bool:
    """The message carries no reasoning (OpenAI clients drop it) or the reply's own."""
    reasoning = message.get("reasoning_content")
    return not reasoning or _folded(str(reasoning)) == reply.reasoning


class ReplyHistory:
    """Recent generated replies by `reply_key` and the digest of the conversation they
    answered; the oldest go first beyond `capacity` replies or `token_budget` prompt
    tokens. The first generation of a (reply, conversation) pair stays: a later identical
    reply to the same conversation changes nothing, so an echo of it keeps rendering the
    same prompt. Thread-safe."""

    def __init__(self, capacity: int = 256, token_budget: int = DEFAULT_TOKEN_BUDGET) -> None:
        self.capacity = capacity
        self.token_budget = token_budget
        self._replies: OrderedDict[tuple[str, bytes], GeneratedReply] = OrderedDict()
        self._keys: dict[str, int] = {}  # reply key -> entries with it
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, key: str, reply: GeneratedReply) -> None:
        size = len(reply.prompt_ids) + len(reply.reply_ids)
        if size > self.token_budget:
            return
        entry = (key, reply.rendered_digest)
        with self._lock:
            if entry in self._replies:
                self._replies.move_to_end(entry)
                return
            self._replies[entry] = reply
            self._keys[key] = self._keys.get(key, 0) + 1
            self._tokens += size
            while len(self._replies) > self.capacity or self._tokens > self.token_budget:
                (old, _), dropped = self._replies.popitem(last=False)
                self._tokens -= len(dropped.prompt_ids) + len(dropped.reply_ids)
                self._keys[old] -= 1
                if not self._keys[old]:
                    del self._keys[old]

    def knows(self, key: str) -> bool:
        """Some reply with this key is kept (for some conversation)."""
        with self._lock:
            return key in self._keys

    def get(self, key: str, digest: bytes) -> GeneratedReply | None:
        """The reply with `key` that answered the conversation whose rendering has
        `digest`."""
        with self._lock:
            reply = self._replies.get((key, digest))
            if reply is not None:
                self._replies.move_to_end((key, digest))
            return reply
