"""The generic JSON envelope, for chat templates that do not render tools.

The model answers with exactly one JSON object (llama-server calls this "generic"):

    {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}, ...]}
    {"response": "plain text answer"}

`envelope_grammar` constrains the output to it (names limited to the request's tools,
arguments following each tool's schema, compact JSON layout: the same bytes
`chat.tool_injection` echoes back in later turns). `EnvelopeParser` streams it back as
events: the `response` string as text (unescaped as it arrives, never split inside an
escape), each call as ToolCallStart / ArgsDelta (the arguments' JSON as generated) / End.
Output that is not an envelope (an unconstrained model ignoring the instructions) is
passed through as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping
from typing import Any

from compat_serve.parsers.argument_grammar import json_arguments
from compat_serve.parsers.events import OutputEvent
from compat_serve.parsers.lark import GrammarBuilder, quote
from compat_serve.parsers.region import CallEventSink, Outcome, Region, json_string
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.scan import WHITESPACE
from compat_serve.parsers.tool_calls import ToolFormat

CALLS_KEY = "tool_calls"
RESPONSE_KEY = "response"
CALLS_OPEN = '{"tool_calls": ['
RESPONSE_OPEN = '{"response": '
MODES = ("auto", "required", "none")

# One JSON string written the way json.dumps(ensure_ascii=False) writes it (short escapes,
# `\u00xx` only for the other control characters, everything else raw), so the text a
# later turn echoes back is byte for byte what was generated.
_STRING = r'/"(\\["\\bfnrt]|\\u00(0[0-7]|0b|0e|0f|1[0-9a-f])|[^"\\\x00-\x1F])*"/'


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string syntax; see `lark.quote`)."""
    return quote(text)


def call_head(name: str) -> str:
    """The text of a call up to its arguments."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def arguments_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as the grammar uses it: an object (the grammar writes
    it compact, its declared properties in any order: `argument_grammar.json_arguments`).

    Lenient: a keyword the grammar engine does not support is ignored instead of failing
    the whole request (agents send dozens of tools with schemas from everywhere).
    """
    out = {k: v for k, v in schema.items() if k not in ("$schema", "x-guidance")}
    out.setdefault("type", "object")
    return out


def envelope_grammar(tools: RequestTools, mode: str) -> str:
    """An llguidance Lark grammar for the envelope.

    `mode`: "auto" (calls or a response), "required" (only calls: 1..max_calls, exactly
    one when `tools.max_calls == 1`) or "none" (only a response).
    """
    g = GrammarBuilder()
    return g.source(envelope_rules(g, tools, mode))


def envelope_rules(g: GrammarBuilder, tools: RequestTools, mode: str) -> str:
    """The envelope's rules in `g`; returns the expression of one envelope (its
    alternatives: parenthesize it to put something before it)."""
    if mode not in MODES:
        raise ValueError(f"envelope mode must be one of {', '.join(MODES)}, not {mode!r}")
    names = list(tools.schemas)
    if mode == "required" and not names:
        raise ValueError("a required tool call needs at least one tool")
    shapes = []
    if mode != "none" and names:
        shapes.append(_calls_rule(g, tools, names))
    if mode != "required":
        string = g.terminal("string", _STRING)
        shapes.append(g.rule("response", f'{_literal(RESPONSE_OPEN)} {string} "}}"'))
    return " | ".join(shapes)


def _calls_rule(g: GrammarBuilder, tools: RequestTools, names: list[str]) -> str:
    limit = tools.max_calls
    calls = []
    for i, name in enumerate(names):
        arguments = json_arguments(g, f"args_{i}", arguments_schema(tools.schemas[name]))
        calls.append(g.rule(f"call_{i}", f'{_literal(call_head(name))} {arguments} "}}"'))
    call = g.choice("call", calls)
    if limit == 1:
        more = ""
    elif limit is None:
        more = f' (", " {call})*'
    else:
        more = f' (", " {call}){{0,{limit - 1}}}'
    return g.rule("calls", f'{_literal(CALLS_OPEN)} {call}{more} "]}}"')


class EnvelopeRegion(Region):
    """The whole output as one envelope object; REJECT when it is not one."""

    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if not (yield from self.accept("{")):
            return Outcome.REJECT
        yield from self.skip_ws()
        key = json_string((yield from self.read_json_value()))
        yield from self.skip_ws()
        if key not in (CALLS_KEY, RESPONSE_KEY) or not (yield from self.accept(":")):
            return Outcome.REJECT
        yield from self.skip_ws()
        if key == RESPONSE_KEY:
            if (yield from self.peek_char()) != '"':
                return Outcome.REJECT
            self.pos += 1
            yield from stream_string(self)
        else:
            if not (yield from self.accept("[")):
                return Outcome.REJECT
            outcome = yield from self._calls()
            if outcome is Outcome.REJECT:
                return outcome
        yield from self._rest_of_object()
        return Outcome.DONE

    def _calls(self) -> Generator[None, None, Outcome]:
        first = True
        while True:
            yield from self.skip_ws()
            if (yield from self.accept("]")):
                return Outcome.DONE
            start = self.pos
            outcome = yield from self.json_call(("arguments",))
            if outcome is Outcome.REJECT:
                if first:
                    return Outcome.REJECT
                self.pos = start  # an unknown tool after known ones: its JSON stays text
                raw = yield from self.read_json_value()
                if raw is None and self.cut:
                    return Outcome.DONE  # a further call, cut before its name was whole
                self.sink.text(self.buf[start : self.pos])
            first = False
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("]")
                return Outcome.DONE

    def _rest_of_object(self) -> Generator[None, None, None]:
        """Skip any further members up to the envelope's closing brace."""
        while True:
            yield from self.skip_ws()
            if (yield from self.accept("}")) or not (yield from self.accept(",")):
                return None
            for _ in range(2):  # key, then value
                yield from self.read_json_value()
                yield from self.skip_ws()
                yield from self.accept(":")


def stream_string(region: Region) -> Generator[None, None, None]:
    """After an opening quote: send the string's text to `sink.text` as it arrives,
    unescaped, up to and including the closing quote (or the end of output)."""
    while True:
        buf, pos = region.buf, region.pos
        end = pos
        while end < len(buf) and buf[end] not in '"\\':
            end += 1
        if end > pos:
            region.sink.text(buf[pos:end])
            region.pos = end
        if end < len(buf) and buf[end] == '"':
            region.pos = end + 1
            return None
        if end < len(buf):  # a backslash: one whole escape, or wait for it
            # Cut inside an escape (max_tokens): its first characters are not text.
            escape = _escape_at(buf, end, final=region.final and not region.cut)
            if escape is None and region.final:
                region.pos = len(buf)
                return None
            if escape is not None:
                text, length = escape
                region.sink.text(text)
                region.pos = end + length
                continue
        if region.final:
            region.pos = len(buf)
            return None
        yield


def _escape_at(buf: str, at: int, *, final: bool) -> tuple[str, int] | None:
    """The text of the escape at `buf[at]` and its length; None while it may be partial.

    A high surrogate waits for its low half so a character is never split. What is not
    a valid escape stays as written.
    """
    if at + 1 >= len(buf):
        return ("\\", 1) if final else None
    kind = buf[at + 1]
    if kind != "u":
        simple = _SIMPLE_ESCAPES.get(kind)
        return (simple, 2) if simple is not None else (buf[at : at + 2], 2)
    digits = buf[at + 2 : at + 6]
    if any(c not in _HEX for c in digits) or (len(digits) < 4 and final):
        return buf[at : at + 2], 2
    code = _hex(digits)
    if code is None:
        return None  # more digits to come
    if 0xD800 <= code < 0xDC00:
        tail = buf[at + 6 : at + 12]
        if len(tail) < 6 and not final and _could_be_escape(tail):
            return None
        low = _hex(tail[2:]) if tail.startswith("\\u") else None
        if low is not None and 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return "\ufffd", 6
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", 6
    return chr(code), 6


_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


def _could_be_escape(text: str) -> bool:
    """Whether `text` may still grow into a `\\uXXXX` escape."""
    return "\\u".startswith(text[:2]) and all(c in _HEX for c in text[2:])


_HEX = frozenset("0123456789abcdefABCDEF")


def _hex(text: str) -> int | None:
    if len(text) != 4 or any(c not in _HEX for c in text):
        return None
    return int(text, 16)


class EnvelopeParser(CallEventSink):
    """feed(text) → events; finish() → the rest. One per generation.

    The same interface as ToolCallParser (`feed`, `finish`, `satisfied`, `calls`), for
    output that is one envelope object; anything else is passed through as text.
    """

    def __init__(
        self,
        tools: Mapping[str, Mapping[str, Any]],
        *,
        new_id: Callable[[], str],
        max_calls: int | None = None,
    ) -> None:
        """`tools`: name → JSON schema of its parameters, for the tools calls may use."""
        super().__init__(tools, new_id, max_calls)
        self._region: Region | None = EnvelopeRegion("", self)
        self._passthrough = False  # not an envelope: everything is text
        self._after = ""  # text after the envelope, held until it is more than layout

    @classmethod
    def for_request(cls, tools: RequestTools, new_id: Callable[[], str]) -> EnvelopeParser:
        return cls(tools.schemas, new_id=new_id, max_calls=tools.max_calls)

    def feed(self, text: str) -> list[OutputEvent]:
        if self._region is not None:
            self._settle(self._region.feed(text))
        else:
            self._trailing(text)
        return self._take()

    def finish(self, *, cut: bool = False) -> list[OutputEvent]:
        """The rest of the events. `cut`: max_tokens (or the context) ended the output:
        an envelope cut before its first call opened is dropped instead of shown as text,
        a call cut in its arguments closes with them as far as they were written."""
        if self._region is not None:
            self._settle(self._region.finish(cut=cut))
        if self._after.strip(WHITESPACE) and not self.satisfied:
            self.text(self._after.strip(WHITESPACE))
        self._after = ""
        return self._take()

    def _settle(self, outcome: Outcome) -> None:
        region = self._region
        if region is None or outcome is Outcome.MORE:
            return
        self._region = None
        if outcome is Outcome.REJECT and region.cut:
            return  # an envelope's start, cut: markup, not text
        if outcome is Outcome.REJECT:
            self._passthrough = True
            self.text(region.buf)
        else:
            self._trailing(region.rest)

    def _trailing(self, text: str) -> None:
        if self._passthrough:
            self.text(text)
        else:
            self._after += text


class EnvelopeCallsRegion(EnvelopeRegion):
    """The envelope from its `{"tool_calls"` marker, for ToolCallParser."""

    keeps_marker = True


# For registries that list formats: what ToolCallParser alone can read of the envelope
# (its calls; a `response` object would stay raw JSON text). EnvelopeParser reads both.
ENVELOPE_FORMAT = ToolFormat("envelope", {'{"' + CALLS_KEY + '"': EnvelopeCallsRegion}, ())
