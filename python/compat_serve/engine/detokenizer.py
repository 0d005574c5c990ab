"""Incremental detokenization that never splits a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding them
alone yields U+FFFD. We decode a small window of recent tokens and emit only the new
suffix once it no longer ends in a replacement character (the approach vLLM and TGI use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    # How many already-emitted tokens to re-decode as left context. Some decoders
    # (SentencePiece's leading-space rule) need context to render the next token.
    _CONTEXT_TOKENS = 4

    def __init__(
        self,
        decoder: Decoder,
        special_ids: frozenset[int] = frozenset(),
        visible_special_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`special_ids` are never shown, except those also in `visible_special_ids`,
        which are emitted as their literal text (markup an output parser reads)."""
        self._decoder = decoder
        self._special = special_ids
        self._visible = visible_special_ids
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens up to here have been emitted

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        if token_id in self._special:
            # It ends any pending partial character context; shown only if visible.
            held = self.flush()
            self._ids.append(token_id)
            self._prefix_offset = self._read_offset = len(self._ids)
            if token_id in self._visible:
                return held + self._decoder.decode([token_id], skip_special_tokens=False)
            return held
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(window)
        if full.endswith(_REPLACEMENT):
            return ""  # wait for the rest of the character
        if not full.startswith(emitted):
            # Context changed how earlier tokens render; emit nothing new from them.
            emitted = ""
        delta = full[len(emitted) :]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - self._CONTEXT_TOKENS)
        return delta

    def flush(self) -> str:
        """Decode whatever is held back (an incomplete character at the very end)."""
        if self._read_offset >= len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(emitted) :] if full.startswith(emitted) else ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=True)
