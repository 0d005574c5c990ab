"""Qwen3-Coder / Nemotron / Seed-OSS XML calls, and the `<tool_call>` wrapper (Hermes).

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

`<tool_call>` may also wrap a Hermes JSON object (`{"name": ..., "arguments": {...}}`), and
`<function=NAME>` may carry a JSON object instead of parameters (Functionary): both are
read here, so a model that mixes the styles still gets its calls parsed.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import (
    Schema,
    TagStyle,
    json_call,
    one_of_tools,
    tagged_arguments,
)
from compat_serve.parsers.arguments import ArgumentsWriter
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"


def xml_function(region: Region) -> Generator[None, None, Outcome]:
    """After `<function=`: the name, then parameters (or a JSON object) up to `</function>`."""
    name = yield from region.read_name((">",))
    if name is None:
        return Outcome.REJECT
    region.pos += 1  # ">"
    region.sink.open_call(name)
    yield from region.skip_ws()
    if (yield from region.peek_char()) == "{":
        yield from region.stream_json_value()
        yield from region.skip_ws()
        yield from region.accept(FUNCTION_CLOSE)
        region.sink.close_call()
        return Outcome.DONE
    writer = ArgumentsWriter(region)
    while True:
        yield from region.skip_ws()
        if (yield from region.accept(PARAM_OPEN)):
            param, delim = yield from region.read_until((">",))
            if delim is None:
                break
            region.pos += 1
            writer.key(param.strip())
            # A missing </parameter> ends the value at the next tag.
            ends = (PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE)
            yield from writer.value(param.strip(), ends, PARAM_CLOSE, trim_newlines=True)
        else:
            yield from region.accept(FUNCTION_CLOSE)
            break
    writer.close()
    region.sink.close_call()
    return Outcome.DONE


class ToolCallTagRegion(Region):
    """`<tool_call>` ... `</tool_call>` holding one JSON or XML call."""

    close = "</tool_call>"

    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if (yield from self.accept(FUNCTION_OPEN)):
            outcome = yield from xml_function(self)
        else:
            outcome = yield from self.json_call()
        if outcome is Outcome.DONE:
            yield from self.skip_ws()
            yield from self.accept(self.close)
        return outcome


class SeedToolCallRegion(ToolCallTagRegion):
    close = "</seed:tool_call>"


class FunctionRegion(Region):
    """A bare `<function=NAME>` call (models that drop the `<tool_call>` wrapper)."""

    def body(self) -> Generator[None, None, Outcome]:
        outcome = yield from xml_function(self)
        if outcome is Outcome.DONE:
            yield from self.skip_ws()
            yield from self.accept("</tool_call>")
        return outcome


# ---- grammars: what each of these formats writes, as its templates render a call -----

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
NL = "\n"
_VALUE_STOPS = (PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE)


def _param_key(g: GrammarBuilder, key: str) -> str:
    return f"{g.lit(PARAM_OPEN)} {key} {g.lit('>')}"


# Qwen3-Coder puts each value on its own lines; Seed-OSS writes it inline.
QWEN3_CODER_ARGS = TagStyle(
    _param_key, PARAM_CLOSE, _VALUE_STOPS, value_prefix="\n", end_prefix="\n"
)
SEED_OSS_ARGS = TagStyle(_param_key, PARAM_CLOSE, _VALUE_STOPS, edge_newlines=False)


def hermes_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call."""

    def call(name: str, schema: Schema) -> str:
        return f"{g.lit(NL)} {json_call(g, name, schema)} {g.lit(NL, TOOL_CALL_CLOSE)}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(TOOL_CALL_OPEN, one, one, g.lit("\n"))


def _xml_grammar(
    g: GrammarBuilder, tools: Mapping[str, Schema], opening: str, closing: str, style: TagStyle
) -> CallSyntax:
    def call(name: str, schema: Schema) -> str:
        head = g.lit("\n", FUNCTION_OPEN, f"{name}>", "\n")
        args = tagged_arguments(g, f"args_{name}", schema, style)
        return f"{head} {args} {g.lit(FUNCTION_CLOSE, NL, closing)}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(opening, one, one, g.lit("\n"))


def qwen3_coder_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...`."""
    return _xml_grammar(g, tools, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, QWEN3_CODER_ARGS)


def seed_oss_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<seed:tool_call>\\n<function=NAME>\\n<parameter=P>value</parameter>\\n...`."""
    return _xml_grammar(g, tools, SEED_OPEN, SEED_CLOSE, SEED_OSS_ARGS)
