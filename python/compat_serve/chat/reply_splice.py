"""Where a conversation echoes a reply this server generated, the prompt as the model saw
it: the reply's earlier prompt and its own tokens, then the template's rendering of
what followed it (see chat/reply_history.py for why and when).

The splice is taken only when it is sure:
- the conversation before the reply renders exactly as it did when the reply was
  generated (replies are kept by their key and the digest of that rendering);
- the reply's end is found: its rendering as the last message holds N end markers (the
  stop token the model wrote, or the model's end-of-turn tokens, and the template's own
  end of an assistant turn), and it ends at the N-th marker after the shared history in
  the whole conversation's rendering; a reply rendered without any marker must render
  identically wherever it stands and end as the model's text ends;
- what follows is the rest of the conversation: either the reply renders the same
  whether or not it is the last message, or every later message's text is in it.
Otherwise the template's rendering stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compat_serve.chat.reply_history import (
    GeneratedReply,
    ReplyHistory,
    content_text,
    echoes_reasoning_of,
    message_key,
    text_digest,
)

Message = dict[str, Any]
# (messages, add_generation_prompt) -> the template's text; raises on a template error.
Render = Callable[[list[Message], bool], str]


@dataclass(frozen=True)
class Splice:
    text: str  # the whole prompt
    head_ids: tuple[int, ...]  # the earlier prompt's ids, then the reply's
    tail: str  # the template's rendering from the reply's end marker on (to tokenize)


def latest_echoed_reply(
    messages: Sequence[Message], history: ReplyHistory, mode: str, render: Render
) -> tuple[int, GeneratedReply, str] | None:
    """The last assistant message that echoes a remembered reply to the conversation
    before it, with its index and that conversation's rendering (with the generation
    prompt); in `loop` mode only after the last user message. Raises as `render` does."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if mode == "loop" and message.get("role") == "user":
            return None
        key = message_key(message)
        if key is None or not history.knows(key):
            continue
        before = render(list(messages[:index]), True)
        reply = history.get(key, text_digest(before))
        if reply is not None and echoes_reasoning_of(message, reply):
            return index, reply, before
    return None


def splice_echoed_reply(
    messages: list[Message],
    rendered: str,
    render: Render,
    history: ReplyHistory,
    mode: str,
    errors: type[Exception],
) -> Splice | None:
    """The spliced prompt for `messages` (whose template rendering is `rendered`), or
    None where no echoed reply can be spliced in safely."""
    try:
        found = latest_echoed_reply(messages, history, mode, render)
        if found is None:
            return None
        index, reply, before = found
        alone = render(messages[: index + 1], False)
    except errors:
        return None
    markers = reply.end_markers
    # The reply's rendering as the last message, and where it starts in the whole one.
    own_at = _back_off(alone, _common_prefix(before, alone), markers)
    start = _back_off(rendered, _common_prefix(before, rendered), markers)
    own = alone[own_at:]
    own_ends = _marker_spans(own, markers)
    if own_ends:
        # The reply ends where its last end marker starts (a template may write it as
        # more than one message, each ended).
        ends = _marker_spans(rendered[start:], markers)
        if len(ends) < len(own_ends):
            return None
        end = start + ends[len(own_ends) - 1][0]
        body = own[: own_ends[-1][0]]
    elif rendered.startswith(alone) and own and reply.reply_text.endswith(own[-8:]):
        # No end marker: the reply renders alike wherever it stands, and ends as the
        # model's text ends (Gemma 4 ends a call with `<|tool_response>`).
        end = len(alone)
        body = own
    elif reply.reply_text and rendered.startswith(reply.reply_text, start):
        # The template writes the model's text as it is, then its own end (Functionary
        # v3.1 ends a call with `<|eom_id|>`, a token the model did not write): the reply
        # is that text, and the template's end begins the tail.
        body = reply.reply_text
        end = start + len(body)
    else:
        return None
    tail = rendered[end:]
    if rendered[start:end] != body and not _renders_all(messages[index + 1 :], tail):
        return None
    return Splice(
        reply.prompt_text + reply.reply_text + tail,
        (*reply.prompt_ids, *reply.reply_ids),
        tail,
    )


def _marker_spans(text: str, markers: Sequence[str]) -> list[tuple[int, int]]:
    """Where end markers stand in `text`, overlapping ones merged, in order."""
    spans = sorted((at, at + len(m)) for m in markers for at in _occurrences(text, m))
    merged: list[tuple[int, int]] = []
    for begin, finish in spans:
        if merged and begin < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], finish))
        else:
            merged.append((begin, finish))
    return merged


def _occurrences(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at != -1:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def _back_off(text: str, at: int, markers: Sequence[str]) -> int:
    """`at`, moved back to the start of an end marker that it cuts through (texts can
    agree on a marker's first characters and differ after them)."""
    for marker in markers:
        for back in range(1, len(marker)):
            if at - back >= 0 and text.startswith(marker, at - back):
                return at - back
    return at


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    lo, hi = 0, limit
    while lo < hi:  # the longest equal prefix, by halving (long prompts)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _renders_all(later: Sequence[Message], tail: str) -> bool:
    """Every later message with text has its first line in `tail`."""
    for message in later:
        content = content_text(message.get("content")).strip()
        if not content:
            continue
        first_line = content.splitlines()[0][:40]
        if first_line not in tail:
            return False
    return True
