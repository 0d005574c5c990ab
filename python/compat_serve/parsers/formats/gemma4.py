"""Gemma 4 calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`.

Keys are bare, strings are quoted with the `<|"|>` token, other values are written as in
JSON (objects with bare keys): google-gemma-4-31B-it.jinja renders an assistant turn's
`tool_calls` that way (`format_argument(value, escape_keys=False)`, keys in sorted
order), e.g. `<|tool_call>call:Bash{command:<|"|>ls /tmp<|"|>,timeout:5}<tool_call|>`.
Several calls follow each other. Reasoning is `<|channel>thought\\n...<channel|>`
(reasoning.GEMMA4).

Top-level string values stream as they are generated; other values are sent as JSON
once complete.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from typing import Any

from compat_serve.parsers.argument_grammar import Schema, one_of_tools
from compat_serve.parsers.formats.pythonic import separated_properties
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region
from compat_serve.parsers.scan import WHITESPACE, partial_marker_length

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
QUOTE = '<|"|>'
CALL_PREFIX = "call:"
TOOL_RESPONSE = "<|tool_response>"
MARKUP = (CALL_OPEN, CALL_CLOSE, QUOTE, TOOL_RESPONSE)


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class Gemma4Region(Region):
    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if not (yield from self.accept(CALL_PREFIX)):
            return Outcome.REJECT
        name = yield from self.read_name(("{",))
        if name is None:
            return Outcome.REJECT
        self.pos += 1  # "{"
        self.sink.open_call(name)
        count = 0
        while True:
            yield from self.skip_ws()
            if (yield from self.accept("}")):
                break
            key, delim = yield from self.read_until((":", "}", CALL_CLOSE))
            if delim != ":":
                break
            self.pos += 1
            self.sink.args(("{" if count == 0 else ", ") + _dump(_unquote(key.strip())) + ": ")
            count += 1
            yield from self.skip_ws()
            if (yield from self.accept(QUOTE)):
                yield from self._stream_string()
            else:
                raw = yield from self._raw_value()
                self.sink.args(gemma_to_json(raw))
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("}")
                break
        self.sink.args("}" if count else "{}")
        yield from self.skip_ws()
        yield from self.accept(CALL_CLOSE)
        # The template follows a call with `<|tool_response>` (where the tool's answer
        # goes): a model ends its call turn with it; it is markup, not text.
        yield from self.accept(TOOL_RESPONSE)
        self.sink.close_call()
        return Outcome.DONE

    def _stream_string(self) -> Generator[None, None, None]:
        """After an opening `<|"|>`: the content as a JSON string, up to the closing one."""
        self.sink.args('"')
        while True:
            at = self.buf.find(QUOTE, self.pos)
            if at != -1:
                self.sink.args(_dump(self.buf[self.pos : at])[1:-1])
                self.pos = at + len(QUOTE)
                break
            avail = self.buf[self.pos :]
            hold = 0 if self.final else partial_marker_length(avail, (QUOTE,))
            text = avail[: len(avail) - hold]
            self.pos += len(text)
            if text:
                self.sink.args(_dump(text)[1:-1])
            if self.final:
                break
            yield
        self.sink.args('"')

    def _raw_value(self) -> Generator[None, None, str]:
        """The text of one non-string value, up to the `,` or `}` after it."""
        start = self.pos
        depth = 0
        quoted = False
        while True:
            while self.pos < len(self.buf):
                if self.buf.startswith(QUOTE, self.pos):
                    quoted = not quoted
                    self.pos += len(QUOTE)
                    continue
                if not quoted and QUOTE.startswith(self.buf[self.pos :]) and not self.final:
                    break  # maybe a quote being written
                ch = self.buf[self.pos]
                if not quoted:
                    if ch in "{[":
                        depth += 1
                    elif ch in "}]" and depth > 0:
                        depth -= 1
                    elif depth == 0 and (ch in ",}" or self.buf.startswith(CALL_CLOSE, self.pos)):
                        return self.buf[start : self.pos]
                self.pos += 1
            if self.final:
                return self.buf[start : self.pos]
            yield


def _unquote(key: str) -> str:
    if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
        return key[len(QUOTE) : -len(QUOTE)]
    return key


class _ValueReader:
    """A complete Gemma value (`{k:<|"|>s<|"|>,n:[1,true]}`) as a Python value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1

    def value(self) -> Any:
        self.ws()
        if self.text.startswith(QUOTE, self.pos):
            end = self.text.find(QUOTE, self.pos + len(QUOTE))
            end = len(self.text) if end == -1 else end
            out = self.text[self.pos + len(QUOTE) : end]
            self.pos = min(len(self.text), end + len(QUOTE))
            return out
        if self.text.startswith("{", self.pos):
            self.pos += 1
            obj: dict[str, Any] = {}
            while True:
                self.ws()
                if self.pos >= len(self.text) or self.text[self.pos] == "}":
                    self.pos += 1
                    return obj
                colon = self.text.find(":", self.pos)
                if colon == -1:
                    raise ValueError("a key without a value")
                key = _unquote(self.text[self.pos : colon].strip())
                self.pos = colon + 1
                obj[key] = self.value()
                self.ws()
                if self.text.startswith(",", self.pos):
                    self.pos += 1
        if self.text.startswith("[", self.pos):
            self.pos += 1
            items: list[Any] = []
            while True:
                self.ws()
                if self.pos >= len(self.text) or self.text[self.pos] == "]":
                    self.pos += 1
                    return items
                items.append(self.value())
                self.ws()
                if self.text.startswith(",", self.pos):
                    self.pos += 1
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}]":
            self.pos += 1
        scalar = self.text[start : self.pos].strip()
        try:
            return json.loads(scalar)
        except json.JSONDecodeError:
            return scalar


def gemma_to_json(raw: str) -> str:
    """A Gemma argument value as JSON text (unreadable text: a JSON string of it)."""
    try:
        return _dump(_ValueReader(raw).value())
    except (ValueError, RecursionError):
        return _dump(raw.strip())


# ---- grammar -------------------------------------------------------------------------


def _any_value(g: GrammarBuilder) -> str:
    """A Gemma value of any shape (what the schema does not pin down)."""
    string = f"{g.lit(QUOTE)} {g.text_until('gemma_str', QUOTE)}"
    scalar = g.terminal("gemma_scalar", r"/-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?|true|false|null/")
    key = g.terminal("gemma_key", "/[A-Za-z_][A-Za-z0-9_]{0,63}/")
    value = "gemma_value"
    pair = f'{key} ":" {value}'
    obj = f'"{{" ({pair} ("," {pair})*)? "}}"'
    arr = f'"[" ({value} ("," {value})*)? "]"'
    return g.rule(value, f"{string} | {scalar} | {obj} | {arr}")


def _literal(g: GrammarBuilder, value: Any) -> str:
    """One value as the template's `format_argument` writes it: strings between `<|"|>`
    quotes (the quote may be a special token, so it is its own piece), other values as
    in JSON, objects with bare keys in sorted order."""
    if isinstance(value, str):
        return f"{g.lit(QUOTE)} {g.lit(value) if value else ''} {g.lit(QUOTE)}"
    comma = ' "," '
    if isinstance(value, Mapping):
        pairs = [f"{g.lit(f'{k}:')} {_literal(g, value[k])}" for k in sorted(value)]
        return f'"{{" {comma.join(pairs)} "}}"'
    if isinstance(value, list):
        return f'"[" {comma.join(_literal(g, v) for v in value)} "]"'
    return g.lit(json.dumps(value))


def _literals(schema: Mapping[str, Any]) -> list[Any] | None:
    """The values `const` or `enum` allow (whatever `type` says, or without one)."""
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) and enum else None


def _value(g: GrammarBuilder, hint: str, schema: Any, any_value: list[str]) -> str:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    literals = _literals(schema) if isinstance(schema, Mapping) else None
    if literals is not None:
        # `enum` / `const` pin the value, typed or not (`unit: {"enum": ["c", "f"]}`
        # has no type: it used to fall through to any value, #34).
        return g.rule(f"{hint}_enum", " | ".join(f"({_literal(g, v)})" for v in literals))
    if kind == "string":
        # The text and its closing quote as one lazy lexeme (a greedy text lexeme could
        # not end before a quote it might still be part of).
        return f"{g.lit(QUOTE)} {g.text_until(f'{hint}_text', QUOTE, length=_length(schema))}"
    if kind in ("integer", "number", "boolean", "null"):
        return g.json(schema)
    if kind not in (None, "object", "array"):
        return g.json(schema)  # a type the grammar engine refuses (or JSON spells alike)
    if kind == "object" and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        props = separated_properties(
            g,
            hint,
            schema,
            lambda key, sub: f"{g.lit(key + ':')} {_value(g, f'{hint}_{key}', sub, any_value)}",
            separator=",",
            sort=True,
        )
        return f'"{{" {props} "}}"'
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        item = g.rule(f"{hint}_item", _value(g, f"{hint}_item", schema["items"], any_value))
        low, high = schema.get("minItems"), schema.get("maxItems")
        low = low if isinstance(low, int) else 0
        more = f"{{{max(low - 1, 0)},{high - 1 if isinstance(high, int) else ''}}}"
        items = f'{item} ("," {item}){more}'
        if isinstance(high, int) and high < 1:
            return '"[" "]"'
        return f'"[" {items if low >= 1 else f"({items})?"} "]"'
    if not any_value:
        any_value.append(_any_value(g))
    return any_value[0]


def _length(schema: Mapping[str, Any]) -> tuple[int, int | None] | None:
    low, high = schema.get("minLength"), schema.get("maxLength")
    if not isinstance(low, int) and not isinstance(high, int):
        return None
    return (low if isinstance(low, int) else 0, high if isinstance(high, int) else None)


def gemma4_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<|tool_call>call:NAME{k:v,...}<tool_call|>` per call, keys sorted as the
    template's `dictsort` renders them; the `<|tool_response>` the template writes after
    a call may follow."""
    any_value: list[str] = []

    def call(name: str, schema: Schema) -> str:
        props = separated_properties(
            g,
            f"kw_{name}",
            schema,
            lambda key, sub: f"{g.lit(key + ':')} {_value(g, f'v_{name}_{key}', sub, any_value)}",
            separator=",",
            sort=True,
        )
        end = f"{g.lit('}', CALL_CLOSE)} {g.lit(TOOL_RESPONSE)}?"
        return f"{g.lit(CALL_PREFIX + name + '{')} {props} {end}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(CALL_OPEN, one, one, '""')
