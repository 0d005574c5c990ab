"""Choosing and building output parsers: detection from real chat templates, special-token
markers, call limits, prompt streaming, and thinking settings reaching the template."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.parsers import (
    OutputParsing,
    RequestTools,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.reasoning import prompt_opens_reasoning
from compat_serve.parsers.registry import (
    TOOL_FORMATS,
    check_parser_choices,
    detect_tool_format,
    resolve_reasoning,
)
from compat_serve.parsers.tool_calls import ToolCallParser
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from tests.python.parser_checks import parse_chunks
from tests.python.parser_corpus import TOOLS
from tests.shared_data import templates_dir

DETECTED = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "Qwen-Qwen3-Coder.jinja": "qwen3_coder",
    "stepfun-ai-Step-3.5-Flash.jinja": "qwen3_coder",
    "ByteDance-Seed-OSS.jinja": "seed_oss",
    "zai-org-GLM-4.6.jinja": "glm45",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    # Small 3.2 renders [CALL_ID] + the call id; Devstral NAME[ARGS]{...} with no ids.
    "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral_call_id",
    "unsloth-Devstral-Small-2507.jinja": "mistral_args",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_v3",
    "moonshotai-Kimi-K2-Instruct.jinja": "kimi_k2",
    "moonshotai-Kimi-K2.jinja": "kimi_k2",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "google-gemma-2-2b-it.jinja": "generic",
}


def read_template(name: str) -> str:
    return (templates_dir() / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(("name", "fmt"), sorted(DETECTED.items()))
def test_tool_format_detected_from_template(name: str, fmt: str) -> None:
    assert detect_tool_format(read_template(name)).name == fmt


def test_reasoning_detected_from_template() -> None:
    assert resolve_reasoning("auto", read_template("Qwen-Qwen3-0.6B.jinja"))
    assert resolve_reasoning("auto", read_template("zai-org-GLM-4.6.jinja"))
    assert not resolve_reasoning("auto", read_template("Qwen-Qwen2.5-7B-Instruct.jinja"))
    assert resolve_reasoning("think", None) and not resolve_reasoning("none", "</think>")


def test_unknown_parser_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="--tool-parser"):
        check_parser_choices("hermès", "auto")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        check_parser_choices("auto", "deepthink")


class _Tokens:
    """A vocabulary where some markup strings are single special tokens."""

    def __init__(self, special: dict[str, int]) -> None:
        self._ids = special
        self.special_token_ids = frozenset(special.values())

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)


def test_special_markers_are_visible_only_when_parsed_and_never_leak() -> None:
    vocab = _Tokens({"[TOOL_CALLS]": 5, "[ARGS]": 6, "<think>": 7, "</think>": 8})
    parsing = OutputParsing(TOOL_FORMATS["mistral"], True, vocab)
    tools = RequestTools.from_chat_tools([{"function": {"name": "Bash", "parameters": {}}}])
    with_tools = parsing.for_request(tools, "prompt", call_id_prefix="toolu_")
    assert with_tools.visible_special_ids == {5, 6, 7, 8}
    without = parsing.for_request(RequestTools(), "prompt", call_id_prefix="toolu_")
    assert without.visible_special_ids == {7, 8}
    # A call to a tool the request did not define stays text, minus the control tokens.
    text = 'Hi [TOOL_CALLS]rm[ARGS]{"path": "/"}'
    events = parse_chunks(with_tools.parser, [text])
    assert assemble(events).text == 'Hi rm{"path": "/"}'
    for cut in range(1, len(text)):
        parsing_again = parsing.for_request(tools, "prompt", call_id_prefix="toolu_")
        assert assemble(parse_chunks(parsing_again.parser, [text[:cut], text[cut:]])).text == (
            'Hi rm{"path": "/"}'
        )


def test_call_ids_use_the_api_prefix() -> None:
    parsing = OutputParsing(TOOL_FORMATS["hermes"], False, _Tokens({}))
    tools = RequestTools.from_chat_tools([{"function": {"name": "Bash"}}])
    parser = parsing.for_request(tools, "", call_id_prefix="toolu_").parser
    events = parse_chunks(parser, ['<tool_call>{"name": "Bash", "arguments": {}}</tool_call>'])
    [start] = [e for e in events if isinstance(e, ToolCallStart)]
    assert start.id.startswith("toolu_") and len(start.id) > 12


def test_max_calls_stops_at_the_first_call() -> None:
    ids = itertools.count()
    parser = ToolCallParser(
        TOOL_FORMATS["hermes"], TOOLS, new_id=lambda: str(next(ids)), max_calls=1
    )
    events = parser.feed(
        'a <tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call> b '
        '<tool_call>{"name": "Bash", "arguments": {}}</tool_call>'
    )
    assert parser.satisfied
    events += parser.feed("more text") + parser.finish()
    turn = assemble(events)
    assert turn.text == "a" and [c.arguments for c in turn.tool_calls] == ['{"command": "ls"}']


def test_text_and_arguments_stream_before_the_call_completes() -> None:
    parser = ToolCallParser(TOOL_FORMATS["qwen3_coder"], TOOLS, new_id=lambda: "x")
    assert parser.feed("Writing it now") == [TextDelta("Writing it now")]
    # A possible marker start is held back, and only that.
    assert parser.feed(". <tool_") == [TextDelta(".")]
    events = parser.feed("call>\n<function=Write>\n<parameter=content>\nline 1\nline")
    assert isinstance(events[0], ToolCallStart)
    assert all(isinstance(e, ToolCallArgsDelta) for e in events[1:])
    assert "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta)) == (
        '{"content": "line 1\\nline'
    )
    events = parser.feed(" 2\n</parameter>\n</function>\n</tool_call>")
    assert isinstance(events[-1], ToolCallEnd)

    hermes = ToolCallParser(TOOL_FORMATS["hermes"], TOOLS, new_id=lambda: "y")
    events = hermes.feed('<tool_call>{"name": "Bash", "arguments": {"command": "echo')
    assert isinstance(events[0], ToolCallStart)
    assert events[1] == ToolCallArgsDelta(0, '{"command": "echo')


def test_prompt_that_opens_reasoning() -> None:
    r1 = PromptBuilder(
        read_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"), _FakeEncoder()
    )
    assert prompt_opens_reasoning(r1.render([{"role": "user", "content": "hi"}]))
    qwen3 = PromptBuilder(read_template("Qwen-Qwen3-0.6B.jinja"), _FakeEncoder())
    hi = [{"role": "user", "content": "hi"}]
    assert not prompt_opens_reasoning(qwen3.render(hi))
    assert not prompt_opens_reasoning(qwen3.render(hi, enable_thinking=False))


class _FakeEncoder:
    bos_token: str | None = "<s>"
    eos_token: str | None = "</s>"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_anthropic_thinking_settings_and_history_reach_the_template() -> None:
    builder = PromptBuilder(read_template("Qwen-Qwen3-0.6B.jinja"), _FakeEncoder())
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use ls.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}],
        },
    ]
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]

    def prompt(thinking: dict[str, Any] | None) -> str:
        body = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 2048, "messages": history, "tools": tools}
            | ({"thinking": thinking} if thinking else {})
        )
        return builder.build(to_chat_request(body, default_max_tokens=100)).text

    disabled = prompt({"type": "disabled"})
    assert disabled.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    enabled = prompt({"type": "enabled", "budget_tokens": 1024})
    assert enabled.endswith("<|im_start|>assistant\n")
    # The thinking of the turn in progress (after the last user query) is rendered back.
    assert "<think>\nUse ls.\n</think>\n\n<tool_call>" in enabled
    assert '{"name": "Bash", "arguments": {"command": "ls"}}' in enabled
