"""LFM2 / LFM2.5 calls: a Python list of calls between `<|tool_call_start|>` and
`<|tool_call_end|>`.

    <|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>

(Liquid AI's LFM2 model card; vLLM reads the same list with its `pythonic` parser.)
Keyword values are Python literals (`'x'`, `"x"`, `1.5`, `True`, `None`, lists, dicts);
JSON literals (`true`, `null`) are read too. Each value is sent to the client as JSON as
soon as it is complete. Several calls share one list: `[f(a=1), g(b="x")]`.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Generator, Mapping
from typing import Any

from compat_serve.parsers.argument_grammar import Schema, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder, arguments_schema
from compat_serve.parsers.region import Outcome, Region

CALL_START = "<|tool_call_start|>"
CALL_END = "<|tool_call_end|>"
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicRegion(Region):
    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if not (yield from self.accept("[")):
            return Outcome.REJECT
        first = True
        while True:
            yield from self.skip_ws()
            name = yield from self.read_name(("(",))
            if name is None:
                if first:
                    return Outcome.REJECT
                break
            first = False
            self.pos += 1  # "("
            self.sink.open_call(name)
            yield from self._keywords()
            self.sink.close_call()
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                break
        yield from self.skip_ws()
        yield from self.accept("]")
        yield from self.skip_ws()
        yield from self.accept(CALL_END)
        return Outcome.DONE

    def _keywords(self) -> Generator[None, None, None]:
        count = 0
        while True:
            yield from self.skip_ws()
            if (yield from self.accept(")")):
                break
            key, delim = yield from self.read_until(("=", ")"), _is_identifier_prefix)
            if delim != "=":
                break
            self.pos += 1
            raw = yield from self._value()
            value = python_value_to_json(raw)
            prefix = "{" if count == 0 else ", "
            self.sink.args(f"{prefix}{json.dumps(key.strip(), ensure_ascii=False)}: {value}")
            count += 1
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.skip_ws()
                yield from self.accept(")")
                break
        self.sink.args("}" if count else "{}")

    def _value(self) -> Generator[None, None, str]:
        """The raw text of one Python literal, up to the `,` or `)` after it."""
        yield from self.skip_ws()
        start = self.pos
        scanner = PythonValueScanner()
        while True:
            self.pos += scanner.feed(self.buf[self.pos :])
            if scanner.done or self.final:
                return self.buf[start : self.pos].strip()
            yield


def _is_identifier_prefix(text: str) -> bool:
    stripped = text.strip()
    return stripped == "" or stripped.isidentifier()


class PythonValueScanner:
    """Finds where a Python literal ends: at a `,` or `)` outside strings and brackets."""

    def __init__(self) -> None:
        self.done = False
        self._stack: list[str] = []
        self._quote = ""
        self._escaped = False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch in _CLOSERS:
                self._stack.append(_CLOSERS[ch])
            elif self._stack and ch == self._stack[-1]:
                self._stack.pop()
            elif not self._stack and ch in ",)":
                self.done = True
                return i
        return len(text)


def python_value_to_json(raw: str) -> str:
    """A Python (or JSON) literal as JSON text; anything else becomes a JSON string."""
    value: Any
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # sets, bytes, complex: not JSON
        return json.dumps(raw, ensure_ascii=False)


# ---- grammar -------------------------------------------------------------------------


def _python_value(g: GrammarBuilder, hint: str, schema: Any) -> str:
    """A keyword value: JSON for strings, numbers, objects and arrays (valid Python for
    what the schema allows, and read back by the parser either way); Python spellings of
    booleans and null."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    sub = schema if isinstance(schema, Mapping | bool) else {}
    return g.json(sub)


def separated_properties(
    g: GrammarBuilder,
    hint: str,
    schema: Schema,
    item: Callable[[str, Any], str],
    *,
    separator: str = ", ",
    sort: bool = False,
) -> str:
    """The declared properties of `schema` as `item(key, property schema)` expressions
    joined by `separator`, in schema order (or sorted), optional ones skippable."""
    schema = arguments_schema(schema)
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = {r for r in schema.get("required") or () if isinstance(r, str)}
    keys = list(properties) + [r for r in sorted(required) if r not in properties]
    if sort:
        keys.sort()
    if not keys:
        return '""'
    items = [g.rule(f"{hint}_{key}", item(key, properties.get(key, {}))) for key in keys]
    needed = [key in required for key in keys]
    sep = g.lit(separator)

    def tail(after: int) -> str:
        rest = range(after + 1, len(items))
        return " ".join(f"({sep} {items[i]})" + ("" if needed[i] else "?") for i in rest)

    starts = []
    for i, first in enumerate(items):
        starts.append(f"{first} {tail(i)}".strip())
        if needed[i]:
            break
    else:
        starts.append('""')
    return g.choice(f"{hint}_props", (f"({s})" for s in starts))


def _keywords(g: GrammarBuilder, hint: str, schema: Schema) -> str:
    """`k=v, ...` (Python keyword arguments)."""
    return separated_properties(
        g, hint, schema, lambda key, sub: f"{g.lit(key + '=')} {_python_value(g, hint, sub)}"
    )


def lfm2_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<|tool_call_start|>[NAME(k=v, ...)]<|tool_call_end|>`; several calls share the
    list, separated by `, `."""

    def call(name: str, schema: Schema) -> str:
        return f"{g.lit(name + '(')} {_keywords(g, f'kw_{name}', schema)} {g.lit(')')}"

    one_call = one_of_tools(g, tools, call)
    one = f'"[" {one_call} "]" {g.lit(CALL_END)}'
    many = f'"[" {one_call} (", " {one_call})* "]" {g.lit(CALL_END)}'
    return CallSyntax(CALL_START, one, many, None)
