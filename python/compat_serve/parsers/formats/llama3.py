"""Llama 3.x JSON calls: `{"name": NAME, "parameters": {...}}`, optionally after
`<|python_tag|>`; several calls may be separated by `;`."""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
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


def llama3_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`{"name": NAME, "parameters": {...}}` as Llama 3.1-3.3 templates render a call (no
    `<|python_tag|>`: that is for built-in tools); several calls are separated by `; `."""

    def call(name: str, schema: Schema) -> str:
        head = ": " + json.dumps(name, ensure_ascii=False) + ', "parameters": '
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(head)} {arguments} {g.lit('}')}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(BARE_JSON, one, one, g.lit("; "))
