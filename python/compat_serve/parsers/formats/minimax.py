"""MiniMax-M2 calls: `<invoke>` elements with `<parameter>` values in one block.

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="location">San Francisco</parameter>
    <parameter name="unit">celsius</parameter>
    </invoke>
    </minimax:tool_call>

As MiniMaxAI-MiniMax-M2.jinja renders an assistant turn's `tool_calls` (string values
raw, others `tojson`) and as vLLM's `minimax_m2` tool parser reads them. Reasoning is a
`<think>` block the generation prompt opens.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, TagStyle, one_of_tools, tagged_arguments
from compat_serve.parsers.arguments import ArgumentsWriter
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

BLOCK_OPEN = "<minimax:tool_call>"
BLOCK_CLOSE = "</minimax:tool_call>"
INVOKE_OPEN = '<invoke name="'
INVOKE_CLOSE = "</invoke>"
PARAM_OPEN = '<parameter name="'
PARAM_CLOSE = "</parameter>"
NAME_END = '">'
MARKUP = (BLOCK_OPEN, BLOCK_CLOSE, INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE)
NL = "\n"


class MiniMaxRegion(Region):
    """A block of `<invoke>` calls; the first one decides whether it is a call at all."""

    def body(self) -> Generator[None, None, Outcome]:
        first = True
        while True:
            yield from self.skip_ws()
            if not (yield from self.accept(INVOKE_OPEN)):
                if first:
                    return Outcome.REJECT
                yield from self.accept(BLOCK_CLOSE)
                return Outcome.DONE
            start = self.pos - len(INVOKE_OPEN)
            name = yield from self.read_name(('"',))
            if name is None or not (yield from self.accept(NAME_END)):
                if first:
                    return Outcome.REJECT
                # An unknown tool after known ones: its raw text stays text.
                yield from self.read_until((INVOKE_CLOSE,))
                yield from self.accept(INVOKE_CLOSE)
                self.sink.text(self.buf[start : self.pos])
                continue
            first = False
            self.sink.open_call(name)
            yield from self._parameters()
            self.sink.close_call()

    def _parameters(self) -> Generator[None, None, None]:
        writer = ArgumentsWriter(self)
        while True:
            yield from self.skip_ws()
            if not (yield from self.accept(PARAM_OPEN)):
                yield from self.accept(INVOKE_CLOSE)
                break
            param, delim = yield from self.read_until(('"',))
            if delim is None or not (yield from self.accept(NAME_END)):
                break
            writer.key(param.strip())
            ends = (PARAM_CLOSE, PARAM_OPEN, INVOKE_CLOSE)
            # Values are inline and raw (the template writes them so): nothing trimmed.
            yield from writer.value(param.strip(), ends, PARAM_CLOSE, trim_newlines=False)
        writer.close()


def _param_key(g: GrammarBuilder, key: str) -> str:
    return f"{g.lit(PARAM_OPEN)} {key} {g.lit(NAME_END)}"


# Values inline and raw between the tags.
MINIMAX_ARGS = TagStyle(_param_key, PARAM_CLOSE, (PARAM_CLOSE, PARAM_OPEN, INVOKE_CLOSE))


def minimax_m2_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    """`<minimax:tool_call>` then one `<invoke name="NAME">` per call, parameters one per
    line, laid out as the template renders them."""

    def call(name: str, schema: Schema) -> str:
        args = tagged_arguments(g, f"args_{name}", schema, MINIMAX_ARGS)
        return f"{g.lit(INVOKE_OPEN, name, NAME_END, NL)} {args} {g.lit(INVOKE_CLOSE, NL)}"

    one_call = one_of_tools(g, tools, call)
    one = f"{g.lit(NL)} {one_call} {g.lit(BLOCK_CLOSE)}"
    many = f"{g.lit(NL)} {one_call}+ {g.lit(BLOCK_CLOSE)}"
    return CallSyntax(BLOCK_OPEN, one, many, None)
