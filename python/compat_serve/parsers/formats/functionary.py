"""Functionary v3 calls.

v3.1 (meetkai-functionary-medium-v3.1, Llama 3.1 based): `<function=NAME>{json}</function>`,
  calls back to back; the template renders a past call as `'<function=' + name + '>' +
  arguments + '</function>'`.
v3.2: one message per recipient, `>>>NAME\\n{json}` for a call and `>>>all\\n` before text
  (`>>>all` is markup, dropped). Examples: llama.cpp tests/test-chat.cpp
  (COMMON_CHAT_FORMAT_FUNCTIONARY_V3_2). When the prompt itself ends with `>>>` (v3.2's
  generation prompt), the first recipient arrives without it: that is not parsed here.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

from compat_serve.parsers.argument_grammar import Schema, json_arguments, one_of_tools
from compat_serve.parsers.formats.xml_function import FUNCTION_CLOSE, FUNCTION_OPEN
from compat_serve.parsers.lark import CallSyntax, GrammarBuilder
from compat_serve.parsers.region import Outcome, Region

RECIPIENT = ">>>"
TEXT_RECIPIENT = "all"
# The call example in the v3.1 template's system prompt (a JSON body, not parameters).
FUNCTION_JSON_EXAMPLE = '<function=example_function_name>{"example_name"'


class RecipientRegion(Region):
    """After `>>>`: `all\\n` (text follows) or a tool name, a newline and its JSON."""

    def body(self) -> Generator[None, None, Outcome]:
        def could_be(prefix: str) -> bool:
            return TEXT_RECIPIENT.startswith(prefix) or self.sink.could_be_name(prefix)

        text, delim = yield from self.read_until(("\n",), could_be)
        if delim is None:
            return Outcome.REJECT
        self.pos += 1
        name = text.strip()
        if name == TEXT_RECIPIENT:
            return Outcome.MARKUP
        if not self.sink.known(name):
            return Outcome.REJECT
        self.sink.open_call(name)
        yield from self.stream_json_value()
        self.sink.close_call()
        return Outcome.DONE


def functionary_v3_1_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    def call(name: str, schema: Schema) -> str:
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(name + '>')} {arguments} {g.lit(FUNCTION_CLOSE)}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(FUNCTION_OPEN, one, one, g.lit(""))


def functionary_v3_2_grammar(g: GrammarBuilder, tools: Mapping[str, Schema]) -> CallSyntax:
    def call(name: str, schema: Schema) -> str:
        arguments = json_arguments(g, f"args_{name}", schema)
        return f"{g.lit(name, chr(10))} {arguments}"

    one = one_of_tools(g, tools, call)
    return CallSyntax(RECIPIENT, one, one, g.lit(""))
