"""Tools told in the system prompt for templates that ignore `tools`: deterministic text,
history in envelope form, and the next turn's prompt extending the generated text."""

from __future__ import annotations

import copy
import functools
import itertools
import json
from typing import Any

import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.chat.tool_injection import (
    PARAMETER_DESCRIPTION_CHARS,
    TOOL_DESCRIPTION_CHARS,
    envelope_text,
    inject_tools,
    tools_prompt,
)
from compat_serve.chat.types import Message
from compat_serve.engine.types import Grammar
from compat_serve.models.types import LoadedModel
from compat_serve.parsers.events import assemble
from compat_serve.parsers.formats.envelope import EnvelopeParser, envelope_grammar
from compat_serve.parsers.setup import RequestTools
from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from tests.python.grammar_walk import embedded_vocab, random_walk
from tests.shared_data import shared_dir

CAPTURE = shared_dir() / "claude_code" / "sys_terse_bash.jsonl"


def tool(name: str, description: str = "", **properties: Any) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


TOOLS = [
    tool("Bash", "Run a shell command.\n\nLong details here.", command={"type": "string"}),
    tool("Read", "Read a file.", path={"type": "string", "description": "Absolute path"}),
]


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION: list[Message] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "list files"},
    {"role": "assistant", "content": "", "tool_calls": [call("c1", "Bash", command="ls")]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
    {"role": "assistant", "content": "Two files: a.txt, b.txt"},
    {"role": "user", "content": "read a"},
]


@pytest.fixture(scope="module")
def builder(embedded_model: LoadedModel) -> PromptBuilder:
    return PromptBuilder(embedded_model.chat_template, embedded_model.tokenizer)


def test_the_embedded_template_ignores_tools(builder: PromptBuilder) -> None:
    assert builder.traits.renders_tools is False


def test_deterministic() -> None:
    first = inject_tools(copy.deepcopy(CONVERSATION), TOOLS)
    again = inject_tools(copy.deepcopy(CONVERSATION), copy.deepcopy(TOOLS))
    assert first == again
    assert json.dumps(first) == json.dumps(again)
    assert tools_prompt(TOOLS) == tools_prompt(copy.deepcopy(TOOLS))
    # The input is not modified.
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}


def test_system_text_merges_after_the_clients() -> None:
    out = inject_tools(CONVERSATION, TOOLS)
    assert out[0]["role"] == "system"
    assert out[0]["content"] == "You are terse.\n\n" + tools_prompt(TOOLS)
    bare = inject_tools(CONVERSATION[1:], TOOLS)
    assert bare[0] == {"role": "system", "content": tools_prompt(TOOLS)}
    assert len(bare) == len(CONVERSATION)


def test_tools_prompt_lists_each_tool_briefly() -> None:
    text = tools_prompt(TOOLS)
    lines = [json.loads(line) for line in text.splitlines() if line.startswith('{"name"')]
    assert lines == [
        {
            "name": "Bash",
            "description": "Run a shell command.",
            "parameters": TOOLS[0]["function"]["parameters"],
        },
        {
            "name": "Read",
            "description": "Read a file.",
            "parameters": TOOLS[1]["function"]["parameters"],
        },
    ]
    assert '{"tool_calls": [' in text and '"response"' in text
    # No example of a response for a small model to copy as its answer (#25).
    assert '{"response": "' not in text and "your answer" not in text
    long = tool("X", "word " * 500, q={"type": "string", "description": "y " * 500})
    line = next(x for x in tools_prompt([long]).splitlines() if x.startswith('{"name"'))
    entry = json.loads(line)
    assert len(entry["description"]) <= TOOL_DESCRIPTION_CHARS + 1
    assert entry["description"].endswith("…")
    q = entry["parameters"]["properties"]["q"]
    assert len(q["description"]) <= PARAMETER_DESCRIPTION_CHARS + 1


def test_history_becomes_envelopes() -> None:
    out = inject_tools(CONVERSATION, TOOLS)
    assert out[2] == {
        "role": "assistant",
        "content": '{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}',
    }
    assert out[3] == CONVERSATION[3]  # the template renders `tool` messages
    assert out[4] == {"role": "assistant", "content": '{"response": "Two files: a.txt, b.txt"}'}
    assert out[5] == CONVERSATION[5]
    as_user = inject_tools(CONVERSATION, TOOLS, tool_role=False)
    assert as_user[3] == {"role": "user", "content": "Tool result (Bash): a.txt\nb.txt"}


def test_envelope_text_details() -> None:
    assert envelope_text('é "q"\n', None) == '{"response": "é \\"q\\"\\n"}'
    string_args = [{"function": {"name": "Bash", "arguments": '{"command": "pwd"}'}}]
    assert envelope_text("", string_args) == (
        '{"tool_calls": [{"name": "Bash", "arguments": {"command": "pwd"}}]}'
    )
    both = envelope_text("Let me look.", string_args)
    assert both.startswith("Let me look.\n{")


def test_prefill_is_left_alone() -> None:
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": "Sure"}]
    out = inject_tools(messages, TOOLS, continue_final_message=True)
    assert out[-1] == {"role": "assistant", "content": "Sure"}


def test_next_turn_extends_the_generated_text(
    builder: PromptBuilder, embedded_model: LoadedModel
) -> None:
    """Turn 2's prompt starts with turn 1's prompt plus exactly what the model wrote."""
    vocab = embedded_vocab(embedded_model)
    tools = RequestTools.from_chat_tools(TOOLS)
    grammar = Grammar("lark", envelope_grammar(tools, "auto"))
    history: list[Message] = [{"role": "user", "content": "list files"}]
    ids = (f"c{i}" for i in itertools.count())
    exact = 0
    for seed in range(6):
        prompt = builder.render(builder.normalize(inject_tools(history, TOOLS)))
        walk = random_walk(vocab, grammar, seed)
        assert walk.complete
        parser = EnvelopeParser.for_request(tools, functools.partial(next, ids))
        turn = assemble([e for piece in walk.pieces for e in parser.feed(piece)] + parser.finish())
        reply: Message = {"role": "assistant", "content": turn.text}
        if turn.tool_calls:
            reply["tool_calls"] = [
                call(c.id, c.name, **c.parsed_arguments()) for c in turn.tool_calls
            ]
        history = [*history, reply]
        for c in turn.tool_calls:
            history.append({"role": "tool", "tool_call_id": c.id, "content": f"out {seed}"})
        history.append({"role": "user", "content": f"next {seed}"})
        following = builder.render(builder.normalize(inject_tools(history, TOOLS)))
        echo = envelope_text(turn.text, reply.get("tool_calls"))
        assert json.loads(echo) == json.loads(walk.text)
        assert following.startswith(prompt + echo), following[len(prompt) :]
        exact += echo == walk.text
    assert exact >= 4  # argument strings may use escapes json.dumps writes differently


def test_claude_code_bash_fits_a_small_context(builder: PromptBuilder) -> None:
    body = json.loads(CAPTURE.read_text().splitlines()[0])["body"]
    body["tools"] = [t for t in body["tools"] if t["name"] == "Bash"]
    chat = to_chat_request(MessagesRequest.model_validate(body), default_max_tokens=256)
    assert chat.tools is not None
    injected = inject_tools(chat.messages, chat.tools)
    tools_tokens = len(builder.encode(tools_prompt(chat.tools)))
    prompt_tokens = len(builder.encode(builder.render(builder.normalize(injected))))
    assert tools_tokens < 450
    assert prompt_tokens < 4096
    # The same request next turn: byte-identical system message.
    again = inject_tools(
        to_chat_request(MessagesRequest.model_validate(body), default_max_tokens=256).messages,
        chat.tools,
    )
    assert again[0] == injected[0]
