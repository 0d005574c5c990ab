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
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Any

from compat_serve.parsers.argument_grammar import Schema, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder, arguments_schema
from compat_serve.parsers.property_order import any_order, declared_properties
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
            prefix = "{" if count == 0 else ", "
            self.sink.args(f"{prefix}{json.dumps(key.strip(), ensure_ascii=False)}: ")
            count += 1
            yield from self.skip_ws()
            quote = yield from self._string_quote()
            if quote:
                yield from self._stream_string(quote)
            else:
                self.sink.args(python_value_to_json((yield from self._value())))
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.skip_ws()
                yield from self.accept(")")
                break
        self.sink.args("}" if count else "{}")

    def _string_quote(self) -> Generator[None, None, str]:
        """The quote of a (single-line) string literal starting here, else ""."""
        while len(self.buf) - self.pos < 3 and not self.final:
            yield
        head = self.buf[self.pos : self.pos + 3]
        if not head or head[0] not in "'\"" or head == head[0] * 3:
            return ""  # not a string, or a triple-quoted one (read whole)
        return head[0]

    def _stream_string(self, quote: str) -> Generator[None, None, None]:
        """A string literal sent as a JSON string as it is generated (escapes decoded)."""
        self.pos += 1
        self.sink.args('"')
        while True:
            decoded: list[str] = []
            at = self.pos
            closed = False
            while at < len(self.buf):
                ch = self.buf[at]
                if ch == quote:
                    closed = True
                    at += 1
                    break
                if ch != "\\":
                    decoded.append(ch)
                    at += 1
                    continue
                size = _escape_size(self.buf, at, final=self.final)
                if size is None:
                    break  # an escape still being written
                decoded.append(_decode_escape(self.buf[at : at + size]))
                at += size
            self.pos = at
            if decoded:
                self.sink.args(json.dumps("".join(decoded), ensure_ascii=False)[1:-1])
            if closed or self.final:
                self.sink.args('"')
                return None
            yield

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


def _escape_size(buf: str, at: int, *, final: bool) -> int | None:
    """Length of the escape sequence at `buf[at]` (a backslash); None while incomplete."""
    if at + 1 >= len(buf):
        return None if not final else len(buf) - at
    kind = buf[at + 1]
    fixed = {"x": 4, "u": 6, "U": 10}.get(kind)
    if fixed is not None:
        return fixed if at + fixed <= len(buf) or final else None
    if kind == "N":
        end = buf.find("}", at)
        return end - at + 1 if end != -1 else (len(buf) - at if final else None)
    if kind in "01234567":
        size = 2
        while size < 4 and at + size < len(buf) and buf[at + size] in "01234567":
            size += 1
        return size if size == 4 or at + size < len(buf) or final else None
    return 2


def _decode_escape(sequence: str) -> str:
    try:
        value = _literal_eval(f'"{sequence}"')
    except (ValueError, SyntaxError):
        return sequence
    return value if isinstance(value, str) else sequence


def _literal_eval(text: str) -> Any:
    """ast.literal_eval without the warning an unknown escape (`\\q`) raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(text)


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
        value = _literal_eval(raw)
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
    if kind == "string" and isinstance(sub, Mapping) and set(sub) <= _FREE_STRING_KEYS:
        # A free string may also be a 'single-quoted' Python literal, as models write it.
        single = g.terminal(f"{hint}_single", r"/'([^'\\\n]|\\.)*'/")
        return f"({g.json(sub)} | {single})"
    return g.json(sub)


# Keywords that leave a string free (any single-quoted literal satisfies them).
_FREE_STRING_KEYS = frozenset({"type", "description", "title", "default", "examples"})


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
    joined by `separator`, in any order (`property_order.any_order`; above its bound, in
    schema order, or sorted), each at most once, optional ones skippable."""
    properties, required = declared_properties(arguments_schema(schema))
    keys = sorted(properties) if sort else list(properties)
    return any_order(
        g, hint, keys, required, lambda key: item(key, properties[key]), separator=g.lit(separator)
    )


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
