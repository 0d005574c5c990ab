"""Small text-scanning helpers shared by the streaming parsers."""

from __future__ import annotations

from collections.abc import Iterable

WHITESPACE = " \t\r\n"


def partial_marker_length(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of some marker.

    That much text must be held back: the next piece may complete the marker.
    """
    best = 0
    for marker in markers:
        limit = min(len(buf), len(marker) - 1)
        for length in range(limit, best, -1):
            if marker.startswith(buf[len(buf) - length :]):
                best = length
                break
    return best


def find_first(buf: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest (position, marker) in `buf`; the longest marker wins a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = buf.find(marker, start)
        if at != -1 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best


class JsonValueScanner:
    """Finds where one JSON value ends, a character at a time, without parsing it.

    Tracks strings (with escapes) and bracket depth only: enough to know when an object,
    array, string or scalar is complete. `feed` returns how many characters of `text`
    belong to the value (all of them while it is still open).
    """

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started = False
        self._scalar = False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done:
                return i
            if not self._started:
                if ch in WHITESPACE:
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._scalar = True
                continue
            if self._scalar:
                if ch in WHITESPACE or ch in ",}]":
                    self.done = True
                    return i
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return i + 1
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return i + 1
        return len(text)

    def end_of_input(self) -> None:
        """A scalar ends with the input."""
        if self._scalar:
            self.done = True
