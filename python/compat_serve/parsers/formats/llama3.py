"""Llama 3.x JSON calls: `{"name": NAME, "parameters": {...}}`, optionally after
`<|python_tag|>`; several calls may be separated by `;`."""

from __future__ import annotations

from collections.abc import Generator

from compat_serve.parsers.region import Outcome, Region

PYTHON_TAG = "<|python_tag|>"
BARE_JSON = '{"name"'


class JsonCallRegion(Region):
    """A bare JSON call object; the marker is its own beginning."""

    keeps_marker = True

    def body(self) -> Generator[None, None, Outcome]:
        outcome = yield from self.json_call(("parameters", "arguments"))
        if outcome is Outcome.DONE:
            yield from _separator(self)
        return outcome


class PythonTagRegion(Region):
    def body(self) -> Generator[None, None, Outcome]:
        outcome = yield from self.json_call(("parameters", "arguments"))
        if outcome is Outcome.DONE:
            yield from _separator(self)
        return outcome


def _separator(region: Region) -> Generator[None, None, None]:
    start = region.pos
    yield from region.skip_ws()
    if not (yield from region.accept(";")):
        region.pos = start
