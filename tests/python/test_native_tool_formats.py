"""gpt-oss (harmony), MiniMax-M2, Gemma 4 and LFM2 outputs: golden outputs (the formats'
documented examples and what each chat template renders for an assistant's calls), any
chunking giving the whole-text result, generated calls round-tripping through the real
templates, detection and the parser overrides.

Parsers are built as the server builds them (OutputParsing.for_request), with a
vocabulary that has none of the markup (plain text, as the embedded model's) or has it
as special tokens (as the real models' vocabularies do).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve.parsers import (
    OutputEvent,
    ParsedTurn,
    RequestTools,
    ToolCallArgsDelta,
    assemble,
)
from compat_serve.parsers.formats import harmony
from compat_serve.parsers.reasoning import GEMMA4, THINK, ReasoningTags
from compat_serve.parsers.registry import (
    TOOL_FORMATS,
    check_parser_choices,
    detect_tool_format,
    resolve_reasoning,
    resolve_tool_format,
)
from compat_serve.parsers.setup import OutputParsing
from compat_serve.templating import ChatTemplate
from tests.python.parser_checks import check_well_formed, drawn_chunks, parse_chunks, parts_of
from tests.shared_data import templates_dir

Part = tuple[Any, ...]

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
    },
    "Bash": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    },
    "search": {"type": "object", "properties": {"filters": {"type": "object"}}},
    "any_tool": {},
}

TEMPLATES = {
    "harmony": "openai-gpt-oss-120b.jinja",
    "minimax_m2": "MiniMaxAI-MiniMax-M2.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja",
    "lfm2": "LiquidAI-LFM2.5-Instruct.jinja",
}
# What each template's generation prompt ends with (the parser's `prompt_text`).
PROMPT_TAILS = {
    "harmony": "<|start|>assistant",
    "minimax_m2": "]~b]ai\n<think>\n",
    "gemma4": "<|turn>model\n",
    "lfm2": "<|im_start|>assistant\n",
}
REASONING: dict[str, ReasoningTags | None] = {
    "harmony": None,
    "minimax_m2": THINK,
    "gemma4": GEMMA4,
    "lfm2": THINK,
}


class Vocab:
    """A vocabulary stub: `special` markup → ids, everything else unknown."""

    def __init__(self, special: tuple[str, ...] = ()) -> None:
        self.ids = {m: 1000 + i for i, m in enumerate(special)}
        self.special_token_ids = frozenset(self.ids.values())

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)


def _special_vocab(fmt: str) -> Vocab:
    tags = REASONING[fmt]
    return Vocab((*TOOL_FORMATS[fmt].markup, *(tags.markup if tags else ())))


def run(
    fmt: str, chunks: list[str], *, special: bool = False, max_calls: int | None = None
) -> list[OutputEvent]:
    vocab = _special_vocab(fmt) if special else Vocab()
    parsing = OutputParsing(TOOL_FORMATS[fmt], REASONING[fmt], vocab)
    request = parsing.for_request(
        RequestTools(TOOLS, max_calls), PROMPT_TAILS[fmt], call_id_prefix="call_"
    )
    return parse_chunks(request.parser, chunks)


# ---- golden outputs ------------------------------------------------------------------------

CASES: list[tuple[str, str, list[Part]]] = [
    # openai-harmony docs, "Function calling": reasoning, then a call with the recipient
    # in the channel header and a <|constrain|> content type.
    (
        "harmony",
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"San Francisco"}<|call|>',
        [
            ("reasoning", "Need to use function get_weather."),
            ("call", "get_weather", {"location": "San Francisco"}),
        ],
    ),
    # openai-gpt-oss-120b.jinja's rendering of a call (recipient before the channel).
    (
        "harmony",
        ' to=functions.Bash<|channel|>commentary json<|message|>{"command": "ls /tmp", '
        '"timeout": 5}<|call|>',
        [("call", "Bash", {"command": "ls /tmp", "timeout": 5})],
    ),
    # harmony docs: reasoning then the final answer; <|return|> ends it.
    (
        "harmony",
        "<|channel|>analysis<|message|>User asks a simple question.<|end|><|start|>assistant"
        "<|channel|>final<|message|>2 + 2 = 4, and naïve 東京 ✓.<|return|>",
        [("reasoning", "User asks a simple question."), ("text", "2 + 2 = 4, and naïve 東京 ✓.")],
    ),
    # A preamble on commentary, two calls (the second without <|call|>: it ends the output).
    (
        "harmony",
        "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.Bash <|constrain|>json<|message|>{"command":"pwd"}'
        "<|call|><|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
        '{"filters": {"tags": ["a", "}"], "ok": true}}',
        [
            ("text", "Checking both."),
            ("call", "Bash", {"command": "pwd"}),
            ("call", "search", {"filters": {"tags": ["a", "}"], "ok": True}}),
        ],
    ),
    # A tool the request did not define, and a built-in: content as text, markup dropped.
    (
        "harmony",
        '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path":"/"}<|call|>',
        [("text", '{"path":"/"}')],
    ),
    (
        "harmony",
        '<|channel|>analysis to=browser.search<|message|>{"query":"x"}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Done<|return|>",
        [("text", '{"query":"x"}Done')],
    ),
    # A model that ignores the format: all text; stray markup never shows (whitespace
    # after an end token is layout between messages).
    ("harmony", "Hello <b>there</b>, 1 < 2.", [("text", "Hello <b>there</b>, 1 < 2.")]),
    ("harmony", "Hi<|end|> there<|constrain|>", [("text", "Hithere")]),
    # A header cut off by the end of output, and nothing at all.
    (
        "harmony",
        "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|chan",
        [("reasoning", "Hmm")],
    ),
    ("harmony", "", []),
    # MiniMax-M2: vLLM's minimax_m2 tool parser docs / the template's tool prompt.
    (
        "minimax_m2",
        "The user wants the weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="location">San Francisco</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n'
        '<parameter name="filters">{"tags": ["a"], "n": null}</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        [
            ("reasoning", "The user wants the weather."),
            ("text", "Let me check."),
            ("call", "get_weather", {"location": "San Francisco", "days": 3}),
            ("call", "search", {"filters": {"tags": ["a"], "n": None}}),
        ],
    ),
    (  # a string value holding markup-like text and newlines; no closing block tag
        "minimax_m2",
        '</think>\n\n<minimax:tool_call>\n<invoke name="Bash">\n<parameter name="command">'
        'echo "<b>" && cat <<EOF\nx\nEOF</parameter>\n</invoke>',
        [("call", "Bash", {"command": 'echo "<b>" && cat <<EOF\nx\nEOF'})],
    ),
    (  # unknown tool: the block is text
        "minimax_m2",
        '</think>\n\nOK <minimax:tool_call>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>',
        [("text", 'OK <minimax:tool_call>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>')],
    ),
    # Gemma 4: the template's rendering (sorted keys, <|"|> strings), after a thought.
    (
        "gemma4",
        "<|channel>thought\nThe user wants files listed.<channel|>Sure.<|tool_call>call:Bash"
        '{command:<|"|>ls -la /tmp<|"|>,timeout:5}<tool_call|><|tool_call>call:search'
        '{filters:{ok:true,range:[1,2.5],tags:[<|"|>a, b<|"|>,<|"|>}<|"|>]}}<tool_call|>',
        [
            ("reasoning", "The user wants files listed."),
            ("text", "Sure."),
            ("call", "Bash", {"command": "ls -la /tmp", "timeout": 5}),
            ("call", "search", {"filters": {"ok": True, "range": [1, 2.5], "tags": ["a, b", "}"]}}),
        ],
    ),
    (  # a string with quotes, braces and newlines; no arguments
        "gemma4",
        '<|tool_call>call:Bash{command:<|"|>printf "{%s}\\n" x\ny<|"|>}<tool_call|>'
        "<|tool_call>call:any_tool{}<tool_call|>",
        [("call", "Bash", {"command": 'printf "{%s}\\n" x\ny'}), ("call", "any_tool", {})],
    ),
    (  # unknown tool and prose mentioning the marker's words
        "gemma4",
        "I can call:Bash. <|tool_call>call:rm{}<tool_call|>",
        [("text", "I can call:Bash. <|tool_call>call:rm{}<tool_call|>")],
    ),
    # LFM2: Liquid AI's model card example, and several calls with Python literals.
    (
        "lfm2",
        '<|tool_call_start|>[get_weather(location="Paris")]<|tool_call_end|>Checking.',
        [("call", "get_weather", {"location": "Paris"}), ("text", "Checking.")],
    ),
    (
        "lfm2",
        "<think>Two calls.</think>\n<|tool_call_start|>[Bash(command='ls -la', timeout=None), "
        'search(filters={"tags": ["a", ")"], "ok": True}), any_tool()]<|tool_call_end|>',
        [
            ("reasoning", "Two calls."),
            ("call", "Bash", {"command": "ls -la", "timeout": None}),
            ("call", "search", {"filters": {"tags": ["a", ")"], "ok": True}}),
            ("call", "any_tool", {}),
        ],
    ),
    (  # Python escapes in a streamed string, an empty one, a triple-quoted one
        "lfm2",
        "<|tool_call_start|>[Bash(command='it\\'s \\\"x\\\"\\n\\x41\\u00e9\\101\\N{BULLET}\\\\', "
        'timeout=1), get_weather(location=""), any_tool(a="""t""")]<|tool_call_end|>',
        [
            ("call", "Bash", {"command": 'it\'s "x"\nAéA\u2022\\', "timeout": 1}),
            ("call", "get_weather", {"location": ""}),
            ("call", "any_tool", {"a": "t"}),
        ],
    ),
    (  # JSON spellings, and an unknown function: the list is text
        "lfm2",
        '<|tool_call_start|>[search(filters={"ok": true, "x": null})]<|tool_call_end|> '
        "<|tool_call_start|>[drop_table(name='t')]<|tool_call_end|>",
        [
            ("call", "search", {"filters": {"ok": True, "x": None}}),
            ("text", "<|tool_call_start|>[drop_table(name='t')]<|tool_call_end|>"),
        ],
    ),
]
CASE_IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


def _merged(parts: list[Part]) -> list[Part]:
    """Adjacent text parts as one (events of two messages may land in one part)."""
    out: list[Part] = []
    for part in parts:
        if part[0] in ("text", "reasoning") and out and out[-1][0] == part[0]:
            out[-1] = (part[0], out[-1][1] + part[1])
        else:
            out.append(part)
    return out


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_golden_output(fmt: str, text: str, expected: list[Part]) -> None:
    events = run(fmt, [text])
    check_well_formed(events)
    assert _merged(parts_of(events)) == _merged(expected)


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_special_token_markup_reads_the_same_and_never_shows(
    fmt: str, text: str, expected: list[Part]
) -> None:
    """With the markup as special tokens (the engine shows their text to the parser), the
    calls are the same and no markup token reaches text or reasoning."""
    events = run(fmt, list(text), special=True)
    check_well_formed(events)
    turn = assemble(events)
    assert [p for p in parts_of(events) if p[0] == "call"] == [
        p for p in expected if p[0] == "call"
    ]
    for mark in _special_vocab(fmt).ids:
        assert mark not in turn.text and mark not in turn.reasoning, (mark, text)


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_every_split_gives_the_whole_text_result(fmt: str, text: str, expected: Any) -> None:
    whole = parts_of(run(fmt, [text]))
    for cut in range(1, len(text)):
        assert parts_of(run(fmt, [text[:cut], text[cut:]])) == whole, cut
    chars = run(fmt, list(text))
    check_well_formed(chars)
    assert parts_of(chars) == whole


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_text_result(
    fmt: str, text: str, expected: list[Part], data: st.DataObject
) -> None:
    events = run(fmt, drawn_chunks(data, text, max_cuts=30))
    check_well_formed(events)
    assert _merged(parts_of(events)) == _merged(expected)


def test_string_arguments_stream_as_generated() -> None:
    """A long string value reaches the client in pieces, before the call is complete."""
    content = "line one\n" * 20
    calls = {
        "lfm2": f"<|tool_call_start|>[Bash(command={json.dumps(content)})]<|tool_call_end|>",
        "gemma4": f'<|tool_call>call:Bash{{command:<|"|>{content}<|"|>}}<tool_call|>',
        "minimax_m2": f'</think>\n<minimax:tool_call>\n<invoke name="Bash">\n'
        f'<parameter name="command">{content}</parameter>\n</invoke>\n</minimax:tool_call>',
        "harmony": f"<|channel|>commentary to=functions.Bash json<|message|>"
        f"{json.dumps({'command': content})}<|call|>",
    }
    for fmt, text in calls.items():
        events = run(fmt, [text[i : i + 8] for i in range(0, len(text), 8)])
        pieces = [e.fragment for e in events if isinstance(e, ToolCallArgsDelta)]
        assert len(pieces) > 10, fmt
        assert json.loads("".join(pieces)) == {"command": content}, fmt


def test_calls_stop_at_max_calls() -> None:
    text = CASES[3][1]
    turn = assemble(run("harmony", [text], max_calls=1))
    assert [c.name for c in turn.tool_calls] == ["Bash"]


# ---- calls rendered by the templates themselves round-trip ----------------------------------

_WORD = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12
)
_SCALAR = st.one_of(st.integers(-1000, 1000), st.booleans(), _WORD)
_ARGS = st.fixed_dictionaries(
    {"command": _WORD.filter(lambda s: s.strip() == s and not s.startswith(("{", "[")))},
    optional={"timeout": st.integers(0, 600)},
)


def _generated(fmt: str, call: dict[str, Any]) -> str:
    """The text a model writes for `call`, as the chat template renders it in the next turn."""
    template = ChatTemplate((templates_dir() / TEMPLATES[fmt]).read_text(encoding="utf-8"))
    ask = [{"role": "user", "content": "go"}]
    turn: list[dict[str, Any]] = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
    ]
    tools = [
        {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
        for n, s in TOOLS.items()
    ]
    rendered = template.render(
        turn, add_generation_prompt=False, tools=tools, bos_token="", eos_token=""
    )
    if fmt == "harmony":
        return rendered[rendered.rindex("<|start|>assistant") + len("<|start|>assistant") :]
    if fmt == "minimax_m2":  # the generation prompt opened <think>; the call follows it
        body = rendered[rendered.rindex("]~b]ai\n") + len("]~b]ai\n") : rendered.rindex("[e~[")]
        return "</think>\n" + body
    assert fmt == "gemma4"
    return rendered[rendered.rindex("<|turn>model\n") + len("<|turn>model\n") :]


@pytest.mark.parametrize("fmt", ["harmony", "minimax_m2", "gemma4"])
@settings(max_examples=30, deadline=None)
@given(args=_ARGS, data=st.data())
def test_template_rendered_calls_parse_back(fmt: str, args: dict[str, Any], data: Any) -> None:
    text = _generated(fmt, {"name": "Bash", "arguments": args})
    for chunks in ([text], drawn_chunks(data, text, max_cuts=20)):
        turn = assemble(run(fmt, chunks))
        assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [("Bash", args)]
        assert turn.text == "", text


def test_lfm2_template_does_not_render_calls() -> None:
    """LFM2.5's template renders an assistant's `content` only: a call echoed as
    `tool_calls` leaves no trace (noted in the echo measurement; a client that keeps the
    call's text in `content` re-renders it)."""
    template = ChatTemplate((templates_dir() / TEMPLATES["lfm2"]).read_text(encoding="utf-8"))
    call = {"name": "Bash", "arguments": {"command": "ls"}}
    with_call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": call}],
    }
    ask = {"role": "user", "content": "go"}
    rendered = template.render([ask, with_call], add_generation_prompt=False)
    bare = template.render([ask, {"role": "assistant", "content": ""}], add_generation_prompt=False)
    assert rendered == bare


# ---- detection, overrides, what /v1/models shows --------------------------------------------


def test_detection_from_the_templates() -> None:
    for fmt, file in TEMPLATES.items():
        source = (templates_dir() / file).read_text(encoding="utf-8")
        assert detect_tool_format(source).name == fmt
        assert resolve_reasoning("auto", source) == REASONING[fmt]
    gemma = OutputParsing(TOOL_FORMATS["gemma4"], GEMMA4, Vocab())
    assert gemma.summary() == {"tool_calls": "gemma4", "reasoning": "gemma4"}
    gpt = OutputParsing(TOOL_FORMATS["harmony"], None, Vocab())
    assert gpt.describe() == "tool calls: harmony, reasoning: harmony"


def test_overrides_and_their_errors() -> None:
    assert resolve_tool_format("lfm2", None) is TOOL_FORMATS["lfm2"]
    assert resolve_reasoning("gemma4", "</think>") is GEMMA4
    assert resolve_reasoning("none", (templates_dir() / TEMPLATES["gemma4"]).read_text()) is None
    with pytest.raises(ValueError, match=r"--tool-parser must be one of .*harmony.*not 'gpt_oss'"):
        check_parser_choices("gpt_oss", "auto")
    with pytest.raises(ValueError, match=r"--reasoning-parser must be one of .*gemma4"):
        check_parser_choices("auto", "harmony")


def test_harmony_tokens_are_made_visible_and_hidden() -> None:
    vocab = _special_vocab("harmony")
    parsing = OutputParsing(TOOL_FORMATS["harmony"], None, vocab)
    request = parsing.for_request(RequestTools(), PROMPT_TAILS["harmony"], call_id_prefix="c")
    assert request.visible_special_ids == frozenset(vocab.ids[m] for m in harmony.MARKUP)
    # Without tools the channels are still split, and no grammar constrains free text.
    assert request.grammar is None
    turn = ParsedTurn()
    for event in request.parser.feed(CASES[2][1]) + request.parser.finish():
        turn.add(event)
    assert (turn.reasoning, turn.text) == (
        "User asks a simple question.",
        "2 + 2 = 4, and naïve 東京 ✓.",
    )
    forced = parsing.for_request(
        RequestTools(TOOLS, 1), PROMPT_TAILS["harmony"], call_id_prefix="c", tool_choice="required"
    )
    assert forced.grammar is not None
    # One call: no further message may start; the markup is written as its tokens.
    assert f"<[{vocab.ids[harmony.START]}]>" not in forced.grammar.source
    assert f"<[{vocab.ids[harmony.CHANNEL]}]>" in forced.grammar.source
