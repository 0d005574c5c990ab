"""A turn ends at a tool call identical to one it already made.

A model that goes on writing calls (a forced `any` / `required` call, or a small model
in a loop) writes the same call again and again until `max_tokens`. Identical calls in
one turn are never wanted: the client would run the same thing twice. So a call to a
tool already called in this turn is held back until it ends; if its name and arguments
(as JSON values: key order and layout aside) are those of an earlier call of the turn,
it is dropped and the turn ends there (`ended`: the caller stops generating); otherwise
its events go out as they were.
"""

from __future__ import annotations

import json

from compat_serve.parsers.events import (
    OutputEvent,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)


class RepeatedCallFilter:
    """apply(events) → the events, less a repeated call and everything after it."""

    def __init__(self) -> None:
        self._made: list[tuple[str, str]] = []  # (name, arguments) of each ended call
        self._open: dict[int, tuple[str, list[str]]] = {}  # index → (name, fragments)
        self._held: list[OutputEvent] | None = None  # the events of a call that may repeat
        self.ended = False  # a repeated call was dropped: nothing more is wanted

    def apply(self, events: list[OutputEvent]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            if self.ended:
                break
            if isinstance(event, ToolCallStart):
                self._open[event.index] = (event.name, [])
                if self._held is None and any(name == event.name for name, _ in self._made):
                    self._held = []
            elif isinstance(event, ToolCallArgsDelta) and event.index in self._open:
                self._open[event.index][1].append(event.fragment)
            elif isinstance(event, ToolCallEnd) and event.index in self._open:
                name, fragments = self._open.pop(event.index)
                call = (name, _value("".join(fragments)))
                if self._held is not None and call in self._made:
                    self._held = None
                    self.ended = True
                    break
                self._made.append(call)
                if self._held is not None:
                    out += self._held
                    self._held = None
                out.append(event)
                continue
            if self._held is not None:
                self._held.append(event)
            else:
                out.append(event)
        return out

    def finish(self) -> list[OutputEvent]:
        """What is still held (a call cut short is no repeat: it goes out as it is)."""
        held, self._held = self._held or [], None
        return [] if self.ended else held


def _value(arguments: str) -> str:
    """The arguments as canonical JSON (the text itself when it is not JSON)."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):
        return arguments
