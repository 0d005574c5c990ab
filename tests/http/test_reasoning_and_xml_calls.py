"""Reasoning (Qwen3 template: <think>) and Qwen3-Coder XML calls end to end, through the
scripted model, the real engine and HTTP layer, read back by both SDKs."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, scripted_server
from tests.http.sdk_clients import claude, claude_streamed_and_whole, oai

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

GREEDY: dict[str, Any] = {"temperature": 0}
THOUGHT = "The user asks about weather in Paris.\nI should call get_weather."
THINK_AND_CALL = (
    f"<think>\n{THOUGHT}\n</think>\n\nChecking the weather.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]

WRITE_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "Write",
            "description": "Write a file",
            "parameters": {
                "type": "object",
                "properties": {
                    "file_path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "object"},
                },
            },
        },
    }
]
CONTENT = 'def main():\n    print("<b>héllo</b> 👋")\n\n\nif __name__ == "__main__":\n    main()'
XML_CALL = (
    "I'll create it.\n<tool_call>\n<function=Write>\n<parameter=file_path>\n/tmp/app.py\n"
    f"</parameter>\n<parameter=content>\n{CONTENT}\n</parameter>\n<parameter=mode>\n"
    '{"append": false, "perm": [6, 4, 4]}\n</parameter>\n</function>\n</tool_call>'
)
XML_INPUT = {
    "file_path": "/tmp/app.py",
    "content": CONTENT,
    "mode": {"append": False, "perm": [6, 4, 4]},
}


@pytest.fixture(scope="module")
def qwen3(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(embedded_model, "Qwen-Qwen3-0.6B.jinja", [("", THINK_AND_CALL)]) as s:
        yield s


@pytest.fixture(scope="module")
def coder(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(embedded_model, "Qwen-Qwen3-Coder.jinja", [("", XML_CALL)]) as s:
        yield s


def test_anthropic_thinking_then_text_then_tool_use(qwen3: RunningServer) -> None:
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 2048,
        "messages": ASK,
        "tools": anthropic_tools(WEATHER_TOOLS),
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    events, streamed, whole = claude_streamed_and_whole(qwen3, request)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    for message in (streamed, whole):
        assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
        thinking, text, use = message.content
        assert thinking.thinking == THOUGHT  # type: ignore[union-attr]
        assert thinking.signature  # type: ignore[union-attr]
        assert text.text == "Checking the weather."  # type: ignore[union-attr]
        assert (use.name, use.input) == ("get_weather", {"city": "Paris"})  # type: ignore[union-attr]
        assert message.stop_reason == "tool_use"
    assert streamed.content[0].signature == whole.content[0].signature  # type: ignore[union-attr]
    # thinking deltas, then exactly one signature before the text starts
    first_text = deltas.index("text_delta")
    assert deltas[:first_text].count("signature_delta") == 1
    assert deltas[first_text - 1] == "signature_delta"
    assert set(deltas[: first_text - 1]) == {"thinking_delta"}


def test_openai_reasoning_content(qwen3: RunningServer) -> None:
    client = oai(qwen3)
    whole = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=WEATHER_TOOLS,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    state = ChatCompletionStreamState()
    reasoning: list[str] = []
    for chunk in client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=WEATHER_TOOLS,
        stream=True,
        extra_body=GREEDY,  # type: ignore[arg-type]
    ):
        state.handle_chunk(chunk)
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            assert "<think>" not in (delta.get("content") or "")
    streamed = state.get_final_completion()
    assert "".join(reasoning) == THOUGHT
    for reply in (whole, streamed):
        message = reply.choices[0].message
        assert message.model_dump().get("reasoning_content") == THOUGHT
        assert message.content == "Checking the weather."
        calls = message.tool_calls or []
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]  # type: ignore[union-attr]
        assert reply.choices[0].finish_reason == "tool_calls"


def test_xml_call_streams_into_anthropic_tool_use(coder: RunningServer) -> None:
    fragments: list[str] = []
    with claude(coder).messages.stream(
        model="m",
        max_tokens=2048,
        messages=[{"role": "user", "content": "Write app.py"}],
        tools=anthropic_tools(WRITE_TOOL),  # type: ignore[arg-type]
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "I'll create it."  # type: ignore[union-attr]
    assert message.content[1].input == XML_INPUT  # type: ignore[union-attr]
    assert json.loads("".join(fragments)) == XML_INPUT
    # The string value streamed as it was written, not in one piece at the end.
    assert len(fragments) > 10
    assert message.stop_reason == "tool_use"


def test_xml_call_in_openai(coder: RunningServer) -> None:
    reply = oai(coder).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write app.py"}],
        tools=WRITE_TOOL,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    message = reply.choices[0].message
    assert message.content == "I'll create it."
    [call] = message.tool_calls or []
    assert call.function.name == "Write"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == XML_INPUT  # type: ignore[union-attr]
    assert "<" not in (message.content or "")
