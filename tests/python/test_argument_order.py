"""A tool's arguments in any order (#25 item 6): the grammar of a forced call accepts the
declared properties in whatever order the model writes them, each at most once, the
required ones present before the object closes; the format's parser reads them back.

A schema listing `content` first, a model writing `filePath` first: before, the grammar
forced `content` and the call came out garbled. Compiled against the embedded model's
vocabulary; the texts are written token by token as a model would.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.constraints import Grammars
from compat_serve.parsers.events import assemble
from compat_serve.parsers.formats.envelope import envelope_grammar
from compat_serve.parsers.property_order import ANY_ORDER_LIMIT
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.setup import OutputParsing
from compat_serve.parsers.tool_grammar import tool_call_grammar

if TYPE_CHECKING:
    from compat_serve.engine.constraints import GrammarMatcher
    from compat_serve.models.tokenizer import Tokenizer

WRITE = {
    "type": "object",
    "properties": {
        "content": {"type": "string"},
        "filePath": {"type": "string"},
        "append": {"type": "boolean"},
    },
    "required": ["content", "filePath"],
    "additionalProperties": False,
}
TOOLS = RequestTools({"write": WRITE}, max_calls=1)
ARGS = {"filePath": "hello.txt", "append": False, "content": "hi"}  # not the schema's order


def _json(args: dict[str, Any]) -> str:
    return json.dumps(args)


def _xml(args: dict[str, Any], close: str = "\n") -> str:
    return "".join(
        f"<parameter={k}>{close}{_text(v)}{close}</parameter>\n" for k, v in args.items()
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _python(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


# One forced call to `write` with `args`, as each format writes it.
CALLS = {
    "hermes": lambda a: f'<tool_call>\n{{"name": "write", "arguments": {_json(a)}}}\n</tool_call>',
    "llama3": lambda a: f'{{"name": "write", "parameters": {_json(a)}}}',
    "mistral_args": lambda a: f"[TOOL_CALLS]write[ARGS]{_json(a)}",
    "kimi_k2": lambda a: (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.write:0"
        f"<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|><|tool_calls_section_end|>"
    ),
    "harmony": lambda a: (
        f" to=functions.write<|channel|>commentary json<|message|>{_json(a)}<|call|>"
    ),
    "qwen3_coder": lambda a: f"<tool_call>\n<function=write>\n{_xml(a)}</function>\n</tool_call>",
    "glm45": lambda a: (
        "\n<tool_call>write\n"
        + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n" for k, v in a.items()
        )
        + "</tool_call>"
    ),
    "minimax_m2": lambda a: (
        '<minimax:tool_call>\n<invoke name="write">\n'
        + "".join(f'<parameter name="{k}">{_text(v)}</parameter>\n' for k, v in a.items())
        + "</invoke>\n</minimax:tool_call>"
    ),
    "lfm2": lambda a: (
        "<|tool_call_start|>[write("
        + ", ".join(f"{k}={_python(v)}" for k, v in a.items())
        + ")]<|tool_call_end|>"
    ),
    "gemma4": lambda a: (
        "<|tool_call>call:write{"
        + ",".join(
            f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{json.dumps(v)}"
            for k, v in a.items()
        )
        + "}<tool_call|>"
    ),
}


@pytest.fixture(scope="module")
def grammars(gguf_tokenizer: Tokenizer) -> Grammars:
    return Grammars(gguf_tokenizer, gguf_tokenizer.backend.get_vocab_size())


def _writes(tokenizer: Tokenizer, matcher: GrammarMatcher, text: str) -> bool:
    """Whether the grammar takes all of `text` and may end after it."""
    ids = tokenizer.encode(text)
    if matcher.validate(ids) != len(ids):
        return False
    for token in ids:
        matcher.consume(token)
    return bool(matcher.is_accepting())


def _forced(grammars: Grammars, name: str, tools: RequestTools = TOOLS) -> GrammarMatcher:
    source = tool_call_grammar(TOOL_FORMATS[name], tools, mode="required")
    assert source is not None
    return grammars.table.compile("lark", source)


def _parsed(tokenizer: Tokenizer, name: str, text: str) -> list[dict[str, Any]]:
    parser = (
        OutputParsing(TOOL_FORMATS[name], None, tokenizer)
        .for_request(TOOLS, "", call_id_prefix="call_", tool_choice="required")
        .parser
    )
    turn = assemble(parser.feed(text) + parser.finish())
    return [json.loads(c.arguments) for c in turn.tool_calls]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_arguments_in_any_order_parse_back(
    gguf_tokenizer: Tokenizer, grammars: Grammars, name: str
) -> None:
    call = CALLS[name]
    for args in (ARGS, {"content": "hi", "filePath": "hello.txt"}, dict(reversed(ARGS.items()))):
        text = call(args)
        assert _writes(gguf_tokenizer, _forced(grammars, name), text), text
        assert _parsed(gguf_tokenizer, name, text) == [args]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_key_once_and_the_required_ones_before_the_end(
    gguf_tokenizer: Tokenizer, grammars: Grammars, name: str
) -> None:
    call = CALLS[name]
    missing = call({"filePath": "hello.txt", "append": True})  # no `content`
    assert not _writes(gguf_tokenizer, _forced(grammars, name), missing), missing
    optional_left_out = call({"filePath": "a", "content": "b"})
    assert _writes(gguf_tokenizer, _forced(grammars, name), optional_left_out)
    # The same key again (written by hand: a dict cannot hold it twice).
    again = {"filePath": "a", "content": "b", "append": False}
    text = call(again)
    dup = _with_key_twice(name, text)
    assert not _writes(gguf_tokenizer, _forced(grammars, name), dup), dup


def _with_key_twice(name: str, text: str) -> str:
    """`text` with its `append` argument written twice."""
    if name in ("qwen3_coder",):
        pair = "<parameter=append>\nfalse\n</parameter>\n"
    elif name == "glm45":
        pair = "<arg_key>append</arg_key>\n<arg_value>false</arg_value>\n"
    elif name == "minimax_m2":
        pair = '<parameter name="append">false</parameter>\n'
    elif name == "lfm2":
        pair = "append=False"
        return text.replace(pair, f"{pair}, {pair}")
    elif name == "gemma4":
        pair = "append:false"
        return text.replace(pair, f"{pair},{pair}")
    else:
        pair = '"append": false'
        return text.replace(pair, f"{pair}, {pair}")
    return text.replace(pair, pair + pair)


def test_the_envelope_takes_arguments_in_any_order(
    gguf_tokenizer: Tokenizer, grammars: Grammars
) -> None:
    matcher = grammars.table.compile("lark", envelope_grammar(TOOLS, "required"))
    text = f'{{"tool_calls": [{{"name": "write", "arguments": {_json(ARGS)}}}]}}'
    assert _writes(gguf_tokenizer, matcher, text)
    matcher = grammars.table.compile("lark", envelope_grammar(TOOLS, "required"))
    assert not _writes(gguf_tokenizer, matcher, text.replace('"content": "hi"', '"x": 1'))


def test_above_the_bound_properties_keep_the_schema_order(
    gguf_tokenizer: Tokenizer, grammars: Grammars
) -> None:
    """2**n rules for n properties: above ANY_ORDER_LIMIT the schema's order stands
    (README, Constrained decoding)."""
    keys = [f"k{i}" for i in range(ANY_ORDER_LIMIT + 1)]
    wide = {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in keys},
        "required": [keys[0]],
        "additionalProperties": False,
    }
    tools = RequestTools({"wide": wide}, max_calls=1)

    def text(args: dict[str, int]) -> str:
        return f'<tool_call>\n{{"name": "wide", "arguments": {_json(args)}}}\n</tool_call>'

    in_order = {k: i for i, k in enumerate(keys)}
    assert _writes(gguf_tokenizer, _forced(grammars, "hermes", tools), text(in_order))
    backwards = dict(reversed(in_order.items()))
    assert not _writes(gguf_tokenizer, _forced(grammars, "hermes", tools), text(backwards))
    # At the bound, any order.
    narrow = {**wide, "properties": {k: {"type": "integer"} for k in keys[:-1]}}
    tools = RequestTools({"wide": narrow}, max_calls=1)
    backwards = dict(reversed(list(in_order.items())[:-1]))
    assert _writes(gguf_tokenizer, _forced(grammars, "hermes", tools), text(backwards))


def test_undeclared_keys_only_where_the_schema_allows_them(
    gguf_tokenizer: Tokenizer, grammars: Grammars
) -> None:
    """Left out, `additionalProperties` writes only the declared keys; allowed, the
    grammar engine's own JSON (schema order, then any other key) takes over."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

    def writes(schema: dict[str, Any], args: dict[str, int]) -> bool:
        tools = RequestTools({"t": schema}, max_calls=1)
        text = f'<tool_call>\n{{"name": "t", "arguments": {_json(args)}}}\n</tool_call>'
        return _writes(gguf_tokenizer, _forced(grammars, "hermes", tools), text)

    assert writes(base, {"b": 2, "a": 1})
    assert not writes(base, {"a": 1, "c": 3})
    open_schema = {**base, "additionalProperties": True}
    assert writes(open_schema, {"a": 1, "b": 2, "c": 3})
    assert not writes(open_schema, {"b": 2, "a": 1})


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "lfm2", "gemma4"])
def test_keys_of_any_spelling_make_valid_rule_names(
    gguf_tokenizer: Tokenizer, grammars: Grammars, name: str
) -> None:
    """Rule names come from tool and key names; Lark's must be ASCII."""
    schema = {
        "type": "object",
        "properties": {"città": {"type": "string"}, "日本": {"type": "integer"}, "1-a b": {}},
        "required": ["città"],
    }
    tools = RequestTools({"tool_é": schema}, max_calls=1)
    _forced(grammars, name, tools)  # compiles
    if name == "hermes":
        args = {"日本": 3, "città": "Roma"}
        arguments = json.dumps(args, ensure_ascii=False)
        text = f'<tool_call>\n{{"name": "tool_é", "arguments": {arguments}}}\n</tool_call>'
        assert _writes(gguf_tokenizer, _forced(grammars, name, tools), text)
