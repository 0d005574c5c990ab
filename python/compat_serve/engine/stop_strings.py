"""Stop-string matching over streamed text, with hold-back.

Text that might be the start of a stop string is held back until it is known not to
be, so a stop string that spans token boundaries is never partially emitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """Result of feeding text: what is safe to emit, and the stop that matched (if any)."""

    emit: str
    matched: str | None = None


class StopStringMatcher:
    """Feed decoded text pieces; get back what can be shown and whether a stop matched."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> StopMatch:
        if not self._stops:
            return StopMatch(emit=text)
        buf = self._pending + text
        # The stop that completes first wins (as it would mid-stream, whatever the
        # chunking); on a tie, the one that starts first.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            self._pending = ""
            return StopMatch(emit=buf[: best[1]], matched=best[2])
        hold = self._holdback_length(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return StopMatch(emit=buf[: len(buf) - hold])

    def flush(self) -> str:
        """Text still held back when generation ends without a match."""
        out, self._pending = self._pending, ""
        return out

    def _holdback_length(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop."""
        limit = min(len(buf), self._longest - 1)
        for length in range(limit, 0, -1):
            tail = buf[len(buf) - length :]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
