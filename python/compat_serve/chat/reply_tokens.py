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
        self._replies: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, text: str, token_ids: Sequence[int]) -> None:
        """`text` must be what `token_ids` decode to (special tokens as text)."""
        if len(text) < MIN_CHARS or not token_ids:
            return
        with self._lock:
            self._replies[text] = tuple(token_ids)
            self._replies.move_to_end(text)
            while len(self._replies) > self.capacity:
                self._replies.popitem(last=False)

    def encode(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`text` tokenized by `encode`, except that each remembered reply it holds is its
        remembered ids (earliest first; the longer of two replies found at one place)."""
        with self._lock:
            replies = list(self._replies.items())
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        for reply, ids in replies:
            at = text.find(reply)
            while at != -1:
                spans.append((at, at + len(reply), ids))
                at = text.find(reply, at + len(reply))
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
