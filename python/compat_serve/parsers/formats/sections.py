# ruff: noqa: RUF001, RUF002  (DeepSeek markers are written with fullwidth bars)
"""Formats whose calls sit in a section of special tokens: DeepSeek-V3/R1 and Kimi-K2.

DeepSeek (V3/R1; V3.1 drops the `function` type and the code fence):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Kimi-K2:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
FENCE_END = "\n```"

KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"


class SectionRegion(Region):
    """A section of calls; the first call decides whether this is a tool call at all."""

    section_end = ""
    call_begin = ""
    call_end = ""

    def body(self) -> Generator[None, None, Outcome]:
        first = True
        while True:
            yield from self.skip_ws()
            if not (yield from self.accept(self.call_begin)):
                if first:
                    return Outcome.REJECT
                yield from self.accept(self.section_end)
                return Outcome.DONE
            start = self.pos - len(self.call_begin)
            name = yield from self.call_name()
            if name is None:
                if first:
                    return Outcome.REJECT
                # An unknown tool after known ones: its raw text stays text.
                yield from self.read_until((self.call_end,))
                yield from self.accept(self.call_end)
                self.sink.text(self.buf[start : self.pos])
                continue
            first = False
            self.sink.open_call(name)
            yield from self.call_arguments()
            yield from self.skip_ws()
            yield from self.accept(self.call_end)
            self.sink.close_call()

    def call_name(self) -> Generator[None, None, str | None]:
        raise NotImplementedError

    def call_arguments(self) -> Generator[None, None, None]:
        yield from self.stream_json_value()


class DeepSeekRegion(SectionRegion):
    section_end = DS_CALLS_END
    call_begin = DS_CALL_BEGIN
    call_end = DS_CALL_END

    def call_name(self) -> Generator[None, None, str | None]:
        def plausible(text: str) -> bool:
            head = text.strip()
            return "function".startswith(head) or self.sink.could_be_name(head)

        head, delim = yield from self.read_until((DS_SEP,), plausible)
        if delim is None:
            return None
        self.pos += len(DS_SEP)
        if head.strip() != "function":  # V3.1: the name itself
            return head.strip() if self.sink.known(head.strip()) else None
        name = yield from self.read_name(("\n", "```"))
        return name

    def call_arguments(self) -> Generator[None, None, None]:
        yield from self.skip_ws()
        fenced = yield from self.accept("```")
        if fenced:
            yield from self.accept("json")
        yield from self.stream_json_value()
        if fenced:
            yield from self.skip_ws()
            yield from self.accept("```")


class KimiRegion(SectionRegion):
    section_end = KIMI_SECTION_END
    call_begin = KIMI_CALL_BEGIN
    call_end = KIMI_CALL_END

    def call_name(self) -> Generator[None, None, str | None]:
        def plausible(text: str) -> bool:
            return self.sink.could_be_name(_kimi_name(text, partial=True))

        ident, delim = yield from self.read_until((KIMI_ARGS_BEGIN,), plausible)
        if delim is None:
            return None
        self.pos += len(KIMI_ARGS_BEGIN)
        name = _kimi_name(ident, partial=False)
        return name if self.sink.known(name) else None


def _kimi_name(ident: str, *, partial: bool) -> str:
    """`functions.get_weather:0` → `get_weather` (a prefix of it while still partial)."""
    ident = ident.strip()
    prefix = "functions."
    if partial and prefix.startswith(ident):
        return ""
    ident = ident.removeprefix(prefix)
    return ident.rsplit(":", 1)[0] if ":" in ident else ident


def _section(g: GrammarBuilder, call: str, begin: str, end: str, sep: str) -> CallSyntax:
    one = f"{call} {g.lit(end)}"
    many = f"{call} ({g.lit(sep)} {call})* {g.lit(end)}"
    return CallSyntax(begin, one, many, None)


def deepseek_v3_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """The V3/R1 layout (typed, fenced JSON), calls on separate lines, as the R1 template
    renders them."""

    def call(name: str, schema: Schema) -> str:
        head = g.lit(DS_CALL_BEGIN, "function", DS_SEP, f"{name}\n```json\n")
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{head} {arguments} {g.lit(FENCE_END, DS_CALL_END)}"

    return _section(g, one_of_tools(g, tools, call), DS_CALLS_BEGIN, DS_CALLS_END, "\n")


def kimi_k2_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}` calls
    back to back in one section. INDEX is the call's position in the turn (0, 1, ...),
    as the template renders it (`loop.index0`), so the echo re-renders the call as
    generated; past the first `_KIMI_POSITIONS` calls, any index."""
    any_index = g.terminal("call_index", "/0|[1-9][0-9]{0,2}/")
    arguments = {
        name: g.rule(f"args_{name}", json_arguments(g, f"args_{name}", schema))
        for name, schema in tools.items()
    }

    def calls(index: str) -> str:
        def call(name: str, schema: Schema) -> str:
            head = f"{g.lit(KIMI_CALL_BEGIN, f'functions.{name}:')} {index}"
            return f"{head} {g.lit(KIMI_ARGS_BEGIN)} {arguments[name]} {g.lit(KIMI_CALL_END)}"

        return one_of_tools(g, tools, call)

    at = [calls(g.lit(str(i))) for i in range(_KIMI_POSITIONS)]
    many = f"{calls(any_index)}*"
    for position in reversed(at[1:]):
        many = f"({position} {many})?"
    end = g.lit(KIMI_SECTION_END)
    return CallSyntax(KIMI_SECTION_BEGIN, f"{at[0]} {end}", f"{at[0]} {many} {end}", None)


_KIMI_POSITIONS = 8
