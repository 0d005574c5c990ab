"""The base of every tool-call format: a region of output that starts at a marker.

A region is written as a generator over its own buffer: helpers `yield` when they need
more text and return once they can decide, so each format reads top to bottom like its
grammar. Decisions depend only on the text seen, never on how it was chunked, which is
what makes streaming and whole-text parsing agree.

A region may `REJECT` only before it opened a call: the driver then shows the marker as
text and scans what followed it again.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Generator, Mapping
from typing import Any, Protocol

from compat_serve.parsers.events import (
    OutputEvent,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from compat_serve.parsers.scan import (
    WHITESPACE,
    JsonValueScanner,
    find_first,
    partial_marker_length,
)

Wait = Generator[None, None, Any]


class Outcome(enum.Enum):
    MORE = "more"  # needs more text
    DONE = "done"  # the region ended; the rest of the buffer is ordinary output again
    REJECT = "reject"  # not a tool call after all
    # Markup that holds no call (Functionary's `>>>all`, Command R's `<|START_RESPONSE|>`):
    # dropped, and what follows is ordinary output again.
    MARKUP = "markup"


class CallSink(Protocol):
    """What a region reports to; implemented by the driver."""

    def known(self, name: str) -> bool: ...
    def could_be_name(self, prefix: str) -> bool: ...
    def param_is_string(self, param: str) -> bool: ...
    # `call_id`: the id the model wrote for the call, where its format has one ("" if not).
    def open_call(self, name: str, call_id: str = "") -> None: ...
    def args(self, fragment: str) -> None: ...
    def close_call(self) -> None: ...
    def text(self, text: str) -> None: ...


class CallEventSink:
    """A CallSink that records what its regions report as events, for the parsers of a
    whole output whose calls carry no ids and have JSON arguments (harmony, the JSON
    envelope): each call gets `new_id()`, and once `max_calls` calls are closed the sink
    is `satisfied` and takes nothing more."""

    def __init__(
        self,
        tools: Mapping[str, Mapping[str, Any]],
        new_id: Callable[[], str],
        max_calls: int | None,
    ) -> None:
        """`tools`: name → JSON schema of its parameters, for the tools calls may use."""
        self._tools = tools
        self._new_id = new_id
        self._max_calls = max_calls
        self._events: list[OutputEvent] = []
        self._calls = 0
        self._open: int | None = None  # the index of the open call
        self.satisfied = False  # max_calls reached: everything after is dropped

    @property
    def calls(self) -> int:
        return self._calls

    def _take(self) -> list[OutputEvent]:
        """The events recorded since the last call."""
        out, self._events = self._events, []
        return out

    def known(self, name: str) -> bool:
        return name in self._tools

    def could_be_name(self, prefix: str) -> bool:
        return any(name.startswith(prefix.lstrip(WHITESPACE)) for name in self._tools)

    def param_is_string(self, param: str) -> bool:
        return False  # arguments are JSON, never tagged values

    def open_call(self, name: str, call_id: str = "") -> None:  # no ids in these formats
        if self.satisfied:
            return
        self._open = self._calls
        self._calls += 1
        self._events.append(ToolCallStart(self._open, self._new_id(), name))

    def args(self, fragment: str) -> None:
        if fragment and self._open is not None and not self.satisfied:
            self._events.append(ToolCallArgsDelta(self._open, fragment))

    def close_call(self) -> None:
        if self._open is None or self.satisfied:
            return
        self._events.append(ToolCallEnd(self._open))
        self._open = None
        if self._max_calls is not None and self._calls >= self._max_calls:
            self.satisfied = True

    def text(self, text: str) -> None:
        if text and not self.satisfied:
            self._events.append(TextDelta(text))


class Region:
    """Parses output from a start marker on. Subclasses implement `body`."""

    # Whether the marker is part of what `body` parses (e.g. the `{"name"` of bare JSON).
    keeps_marker = False

    def __init__(self, marker: str, sink: CallSink) -> None:
        self.marker = marker
        self.sink = sink
        self.buf = marker
        self.pos = 0 if self.keeps_marker else len(marker)
        self.final = False
        # The output ended because max_tokens (or the context) cut it: what is still
        # undecided at the end is a cut call's markup, never text.
        self.cut = False
        self._body = self.body()
        self._outcome: Outcome | None = None

    def body(self) -> Generator[None, None, Outcome]:
        raise NotImplementedError

    @property
    def rest(self) -> str:
        return self.buf[self.pos :]

    def feed(self, text: str) -> Outcome:
        self.buf += text
        return self._advance()

    def finish(self, *, cut: bool = False) -> Outcome:
        self.final = True
        self.cut = cut
        return self._advance()

    def _advance(self) -> Outcome:
        if self._outcome is not None:
            return self._outcome
        try:
            next(self._body)
        except StopIteration as stop:
            self._outcome = stop.value
            return stop.value  # type: ignore[no-any-return]
        if self.final:  # helpers never wait once the input is final
            raise AssertionError("region waited for text after the end of output")
        return Outcome.MORE

    # ---- helpers (generators: `x = yield from self.helper()`) -----------------------

    def _wait(self) -> Wait:
        if not self.final:
            yield

    def skip_ws(self) -> Wait:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf) or self.final:
                return None
            yield

    def peek_char(self) -> Generator[None, None, str | None]:
        while self.pos >= len(self.buf):
            if self.final:
                return None
            yield
        return self.buf[self.pos]

    def accept(self, literal: str) -> Generator[None, None, bool]:
        """Consume `literal` if the text here is it (waits while it could still be)."""
        while True:
            tail = self.buf[self.pos : self.pos + len(literal)]
            if tail == literal:
                self.pos += len(literal)
                return True
            if not literal.startswith(tail) or self.final:
                return False
            yield

    def read_until(
        self, delims: tuple[str, ...], check: Callable[[str], bool] | None = None
    ) -> Generator[None, None, tuple[str, str | None]]:
        """Text up to the first delimiter, which is left in place.

        Returns `(text, delimiter)`, or `(text, None)` at the end of output or as soon as
        `check(text so far)` fails.
        """
        while True:
            hit = find_first(self.buf, delims, self.pos)
            upto = hit[0] if hit else len(self.buf)
            text = self.buf[self.pos : upto]
            # A partial delimiter at the end is not part of the text being checked.
            checked = text if hit else text[: len(text) - partial_marker_length(text, delims)]
            if check is not None and not check(checked):
                return text, None
            if hit is not None:
                self.pos = upto
                return text, hit[1]
            if self.final:
                self.pos = len(self.buf)
                return text, None
            yield

    def read_name(self, delims: tuple[str, ...]) -> Generator[None, None, str | None]:
        """A tool name up to a delimiter (left in place); None unless it is a known one."""
        text, delim = yield from self.read_until(delims, self.sink.could_be_name)
        name = text.strip()
        if delim is None or not self.sink.known(name):
            return None
        return name

    def read_json_value(self) -> Generator[None, None, str | None]:
        """The raw text of one JSON value (whitespace before it skipped); None if cut off."""
        yield from self.skip_ws()
        scanner = JsonValueScanner()
        start = self.pos
        while True:
            self.pos += scanner.feed(self.buf[self.pos :])
            if not scanner.done and self.final:
                scanner.end_of_input()
            if scanner.done:
                return self.buf[start : self.pos]
            if self.final:
                return None
            yield

    def stream_json_value(self) -> Wait:
        """Send one JSON value to the open call's arguments as it arrives."""
        yield from self.skip_ws()
        first = yield from self.peek_char()
        if first == '"':  # arguments double-encoded as a JSON string: decode once
            raw = yield from self.read_json_value()
            self.sink.args(_decode_encoded_arguments(raw))
            return None
        scanner = JsonValueScanner()
        while True:
            start = self.pos
            self.pos += scanner.feed(self.buf[self.pos :])
            if not scanner.done and self.final:
                scanner.end_of_input()
            self.sink.args(self.buf[start : self.pos])
            if scanner.done or self.final:
                return None
            yield

    # ---- JSON call objects: {"name": ..., "arguments": {...}} ----------------------

    def json_call(
        self,
        args_keys: tuple[str, ...] = ("arguments", "parameters"),
        name_keys: tuple[str, ...] = ("name",),
    ) -> Generator[None, None, Outcome]:
        """One call written as a JSON object. REJECT (nothing consumed for good) if the
        object has no known `name` before anything was sent; the call is closed otherwise."""
        yield from self.skip_ws()
        if not (yield from self.accept("{")):
            return Outcome.REJECT
        opened = False
        held_args: str | None = None
        sent_args = False
        while True:
            yield from self.skip_ws()
            if (yield from self.accept("}")):
                break
            key = json_string((yield from self.read_json_value()))
            yield from self.skip_ws()
            if key is None or not (yield from self.accept(":")):
                break
            if key in name_keys and not opened:
                name = json_string((yield from self.read_json_value()))
                if name is None or not self.sink.known(name):
                    return Outcome.REJECT
                self.sink.open_call(name)
                opened = True
                if held_args is not None:
                    self.sink.args(held_args)
                    sent_args = True
            elif key in args_keys and not sent_args:
                if opened:
                    yield from self.stream_json_value()
                    sent_args = True
                else:
                    raw = yield from self.read_json_value()
                    held_args = _normalize_arguments(raw)
            else:
                yield from self.read_json_value()
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("}")
                break
        if not opened:
            return Outcome.REJECT
        if not sent_args:
            self.sink.args("{}")
        self.sink.close_call()
        return Outcome.DONE


def json_string(raw: str | None) -> str | None:
    """The string a raw JSON value stands for, or None when it is not a JSON string."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _decode_encoded_arguments(raw: str | None) -> str:
    """`"{\\"a\\": 1}"` → `{"a": 1}`; anything that is not an encoded object → `{}`."""
    inner = json_string(raw)
    if inner is None:
        return "{}"
    try:
        value = json.loads(inner)
    except json.JSONDecodeError:
        return "{}"
    return inner.strip() if isinstance(value, dict) else "{}"


def _normalize_arguments(raw: str | None) -> str:
    if raw is None:
        return "{}"
    if raw.startswith('"'):
        return _decode_encoded_arguments(raw)
    return raw
