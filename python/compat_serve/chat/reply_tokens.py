"""The token ids of recent replies, so a reply the client echoes back is tokenized as it
was generated.

A model rarely writes the tokenizer's canonical split of its own text (under a grammar
it writes `"B` `ash` where the tokenizer has `"Bash`), and the text before a reply may
merge with the reply's first characters when both are tokenized together. Either way the
next turn's prompt would differ from the tokens the prefix cache holds from the right
after the generation prompt on. Splicing the remembered ids in where the rendered prompt
repeats a reply's text, and tokenizing the text around it on its own, keeps the next turn
token-identical to the previous prompt plus the reply, wherever the template renders the
reply as the model wrote it (#14 item 3).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

# Shorter replies are not worth a split of the surrounding text.
MIN_CHARS = 16


class ReplyTokens:
    """The last `capacity` replies, by text. Thread-safe (prompts are built off the loop)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        # text -> (ids, the text length after each id, -1 inside a character)
        self._replies: OrderedDict[str, tuple[tuple[int, ...], tuple[int, ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, token_ids: Sequence[int], pieces: Sequence[str]) -> None:
        """A reply: its ids and the text each one adds (special tokens as text; "" for a
        token that ends inside a character, whose text comes with a later one)."""
        text = "".join(pieces)
        if len(text) < MIN_CHARS or not token_ids or len(pieces) != len(token_ids):
            return
        ends, length = [], 0
        for piece in pieces:
            length += len(piece)
            ends.append(length if piece else -1)
        with self._lock:
            self._replies[text] = (tuple(token_ids), tuple(ends))
            self._replies.move_to_end(text)
            while len(self._replies) > self.capacity:
                self._replies.popitem(last=False)

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`text` tokenized by `encode`, except where it repeats a remembered reply: there
        the reply's ids, as far as the text repeats the reply (whole tokens; a template
        may render the end of a call differently), and the text around it on its own."""
        with self._lock:
            replies = list(self._replies.items())
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        for reply, (ids, ends) in replies:
            head = reply[:MIN_CHARS]
            at = text.find(head)
            while at != -1:
                span = _repeated(text, at, reply, ids, ends)
                if span is not None:
                    spans.append(span)
                at = text.find(head, at + 1)
        if not spans:
            return encode(text)
        spans.sort(key=lambda s: (s[0], -s[1]))
        out: list[int] = []
        pos = 0
        for start, end, ids in spans:
            if start < pos:
                continue  # overlaps a reply already spliced
            if start > pos:
                out += encode(text[pos:start])
            out += ids
            pos = end
        if pos < len(text):
            out += encode(text[pos:])
        return out


def _repeated(
    text: str, at: int, reply: str, ids: tuple[int, ...], ends: tuple[int, ...]
) -> tuple[int, int, tuple[int, ...]] | None:
    """(start, end, ids) of the longest run of `reply`'s tokens that `text` repeats at
    `at`, or None when that is less than half the reply (or MIN_CHARS)."""
    same = 0
    limit = min(len(reply), len(text) - at)
    while same < limit and text[at + same] == reply[same]:
        same += 1
    if same == len(reply):
        return at, at + same, ids
    # Only whole tokens: the longest prefix of ids whose text fits in `same` characters
    # and ends where a character does.
    best = 0
    for count, end in enumerate(ends, 1):
        if end > same:
            break
        if end >= 0:
            best = count
    # Half the reply at least: a system prompt's example call shares the first few
    # characters of a real call, and splitting it would change turn 1's tokens.
    if best == 0 or ends[best - 1] < max(MIN_CHARS, len(reply) // 2):
        return None
    return at, at + ends[best - 1], ids[:best]
