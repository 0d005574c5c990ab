"""Calls written as a JSON array of call objects after a start marker, optionally closed by
an end marker: the shape Nemotron (`<TOOLCALL>`), Granite and Phi-4-mini (`<|tool_call|>`)
and Command R (`<|START_ACTION|>`, `Action: ```json`) share. Each format file names its
markers, its object keys and how its template lays the array out.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from dataclasses import dataclass

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region


class JsonArrayRegion(Region):
    """`[{call}, {call}, ...]` then `close` (optional: a model may stop without it)."""

    close = ""
    name_keys: tuple[str, ...] = ("name",)
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if not (yield from self.accept("[")):
            return Outcome.REJECT
        first = True
        while True:
            yield from self.skip_ws()
            if (yield from self.accept("]")):  # an empty list, or a trailing comma
                break
            start = self.pos
            outcome = yield from self.json_call(self.args_keys, self.name_keys)
            if outcome is Outcome.REJECT:
                if first:
                    return Outcome.REJECT
                self.pos = start  # an unknown tool among known ones stays text
                raw = yield from self.read_json_value()
                self.sink.text(raw if raw is not None else self.rest)
            first = False
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("]")
                break
        if self.close:
            yield from self.skip_ws()
            yield from self.accept(self.close)
        return Outcome.DONE


@dataclass(frozen=True)
class ArrayLayout:
    """How a template writes the array: `open` + call (+ `between` + call)* + `end`, each
    call `{` + `head(index)` + `"NAME_KEY": "NAME", "ARGS_KEY": ` + arguments + `}`."""

    name_key: str = "name"
    args_key: str = "arguments"
    # Literal pieces (a piece that is a special token is written as that token).
    open: tuple[str, ...] = ("[",)
    between: tuple[str, ...] = (", ",)
    end: tuple[str, ...] = ("]",)
    # A Lark expression for the keys before the name (Command R's `"tool_call_id": "0", `).
    head: str = ""


def array_grammar(
    g: GrammarBuilder, tools: Mapping[str, Schema], trigger: str, layout: ArrayLayout
) -> CallSyntax:
    """One block of calls after `trigger`, laid out as `layout` says."""

    def call(name: str, schema: Schema) -> str:
        name_part = f'"{layout.name_key}": {json.dumps(name, ensure_ascii=False)}, '
        keys = f'{name_part}"{layout.args_key}": '
        head = f"{g.lit('{')} {layout.head} {g.lit(keys)}"
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{head} {arguments} {g.lit('}')}"

    one_call = one_of_tools(g, tools, call)
    opening, between, end = g.lit(*layout.open), g.lit(*layout.between), g.lit(*layout.end)
    one = f"{opening} {one_call} {end}"
    many = f"{opening} {one_call} ({between} {one_call})* {end}"
    return CallSyntax(trigger, one, many, None)
