"""Arguments written as tagged key/value pairs (Qwen3-Coder XML, GLM), streamed as JSON.

The JSON object is built as the values complete: `{"key": value, ...}`. A value is JSON
when the tool's schema does not say it is a string and it parses as JSON; otherwise it is
a string, and a string that cannot be JSON streams as it is generated.
"""

from __future__ import annotations

import json
from collections.abc import Generator

from compat_serve.parsers.region import Region
from compat_serve.parsers.scan import WHITESPACE, find_first, partial_marker_length

# First characters a JSON value can start with; any other value streams as a string.
_JSON_STARTS = frozenset('{["-0123456789tfn')


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class ArgumentsWriter:
    """Emits one call's arguments object piece by piece."""

    def __init__(self, region: Region) -> None:
        self._region = region
        self._count = 0

    def key(self, name: str) -> None:
        self._region.sink.args(("{" if self._count == 0 else ", ") + _dump(name) + ": ")
        self._count += 1

    def close(self) -> None:
        self._region.sink.args("}" if self._count else "{}")

    def value(
        self, param: str, ends: tuple[str, ...], consumed_end: str, *, trim_newlines: bool
    ) -> Generator[None, None, None]:
        """Read a value up to one of `ends` (only `consumed_end` is consumed) and emit it.

        With `trim_newlines`, one newline right after the opening tag and one right before
        the closing tag are layout, not value.
        """
        region = self._region
        if trim_newlines:
            yield from region.accept("\n")
        as_string = region.sink.param_is_string(param)
        if not as_string:
            first = yield from _peek_non_ws(region)
            as_string = first is not None and first not in _JSON_STARTS
        if as_string:
            region.sink.args('"')
            yield from _stream_string(region, ends, trim_newlines)
            region.sink.args('"')
        else:
            raw, _ = yield from region.read_until(ends)
            if trim_newlines and raw.endswith("\n"):
                raw = raw[:-1]
            region.sink.args(_typed(raw))
        yield from region.accept(consumed_end)


def _typed(raw: str) -> str:
    try:
        return _dump(json.loads(raw))
    except json.JSONDecodeError:
        return _dump(raw)


def _peek_non_ws(region: Region) -> Generator[None, None, str | None]:
    """The first non-whitespace character ahead, without consuming anything."""
    at = region.pos
    while True:
        while at < len(region.buf) and region.buf[at] in WHITESPACE:
            at += 1
        if at < len(region.buf):
            return region.buf[at]
        if region.final:
            return None
        yield


def _stream_string(region: Region, ends: tuple[str, ...], trim_newline: bool) -> Generator[None]:
    """Emit string content (JSON-escaped, without quotes) until an end marker."""
    while True:
        hit = find_first(region.buf, ends, region.pos)
        if hit is not None:
            text = region.buf[region.pos : hit[0]]
            region.pos = hit[0]
            if trim_newline and text.endswith("\n"):
                text = text[:-1]
            region.sink.args(_dump(text)[1:-1])
            return None
        if region.final:
            text = region.buf[region.pos :]
            region.pos = len(region.buf)
            region.sink.args(_dump(text)[1:-1])
            return None
        avail = region.buf[region.pos :]
        hold = partial_marker_length(avail, ends)
        if trim_newline and len(avail) > hold and avail[len(avail) - hold - 1] == "\n":
            hold += 1  # may be the layout newline before the closing tag
        text = avail[: len(avail) - hold]
        region.pos += len(text)
        if text:
            region.sink.args(_dump(text)[1:-1])
        yield
