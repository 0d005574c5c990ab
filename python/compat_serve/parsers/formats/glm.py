"""GLM-4.5 / 4.6 calls: the name, then `<arg_key>`/`<arg_value>` pairs.

<tool_call>NAME
<arg_key>K</arg_key>
<arg_value>V</arg_value>
</tool_call>
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, TagStyle, one_of_tools, tagged_arguments
from compat_serve.parsers.arguments import ArgumentsWriter
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NL = "\n"


class GlmToolCallRegion(Region):
    def body(self) -> Generator[None, None, Outcome]:
        name = yield from self.read_name(("\n", KEY_OPEN, CLOSE))
        if name is None:
            return Outcome.REJECT
        self.sink.open_call(name)
        writer = ArgumentsWriter(self)
        while True:
            yield from self.skip_ws()
            if not (yield from self.accept(KEY_OPEN)):
                break
            key, delim = yield from self.read_until((KEY_CLOSE,))
            if delim is None:
                break
            self.pos += len(KEY_CLOSE)
            yield from self.skip_ws()
            if not (yield from self.accept(VALUE_OPEN)):
                break
            writer.key(key.strip())
            ends = (VALUE_CLOSE, KEY_OPEN, CLOSE)
            yield from writer.value(key.strip(), ends, VALUE_CLOSE, trim_newlines=False)
        yield from self.accept(CLOSE)
        writer.close()
        self.sink.close_call()
        return Outcome.DONE


def _arg_key(g: GrammarBuilder, key: str) -> str:
    return f"{g.lit(KEY_OPEN)} {key} {g.lit(KEY_CLOSE, NL, VALUE_OPEN)}"


# Values sit inline between the tags, untrimmed.
GLM_ARGS = TagStyle(_arg_key, VALUE_CLOSE, (VALUE_CLOSE, KEY_OPEN, CLOSE))


def glm45_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<tool_call>NAME`, then `<arg_key>K</arg_key>` `<arg_value>V</arg_value>` pairs, one
    per line, then `</tool_call>`."""

    def call(name: str, schema: Schema) -> str:
        args = tagged_arguments(g, f"args_{name}", schema, GLM_ARGS)
        return f"{g.lit(name, NL)} {args} {g.lit(CLOSE)}"

    one = one_of_tools(g, tools, call)
    # The template renders `\n<tool_call>` after the (empty) `<think></think>` it keeps.
    return CallSyntax(OPEN, one, one, g.lit(NL), lead=NL)
