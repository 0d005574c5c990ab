"""Tool calls end to end: the scripted model writes Hermes calls (Qwen2.5 template) through
the real tokenizer, engine and HTTP layer; both SDKs read them back, streamed and not."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, scripted_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

ARGS_1 = {"city": "São Paulo 🌧️", "opts": {"days": [1, 2], "units": {"temp": "C"}}}
ARGS_2 = {"tz": "America/Sao_Paulo"}
TWO_CALLS = (
    "Let me check.\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGS_1, ensure_ascii=False)}}}'
    f'\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {json.dumps(ARGS_2)}}}\n'
    "</tool_call>"
)
UNKNOWN_CALL = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
# A special token in the middle of the reply: the engine must drop it.
SPECIAL = "Plain<|im_start|> answer."
REPLIES = [
    ("rockets", UNKNOWN_CALL),
    ("special", SPECIAL),
    ("", TWO_CALLS),
]
ASK = [{"role": "user", "content": "What's the weather in São Paulo?"}]
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    # A small per-token delay so a test can look at the server while generation runs.
    with scripted_server(
        embedded_model, "Qwen-Qwen2.5-7B-Instruct.jinja", REPLIES, step_delay_s=0.02
    ) as running:
        yield running


# One client per module: each builds an httpx client and an SSL context (~40 ms of CPU).
@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def reply_tokens(server: RunningServer, text: str) -> int:
    """Tokens the scripted model generates for `text`, plus the end-of-turn token."""
    return len(server.state.engine.model.tokenizer.encode(text)) + 1  # type: ignore[attr-defined]


# ---------------------------------------------------------------- OpenAI


def test_openai_tool_calls(oai: openai.OpenAI, server: RunningServer) -> None:
    reply = oai.chat.completions.create(
        model="m",
        messages=ASK,
        tools=WEATHER_TOOLS,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert [json.loads(c.function.arguments) for c in calls] == [ARGS_1, ARGS_2]  # type: ignore[union-attr]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert reply.usage is not None
    assert reply.usage.completion_tokens == reply_tokens(server, TWO_CALLS)


def test_openai_stream_rebuilt_by_the_sdk(oai: openai.OpenAI) -> None:
    state = ChatCompletionStreamState()
    tool_deltas: list[Any] = []
    chunks = oai.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    for chunk in chunks:
        state.handle_chunk(chunk)
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            tool_deltas += chunk.choices[0].delta.tool_calls
            assert not chunk.choices[0].delta.content
    final = state.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    calls = message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [ARGS_1, ARGS_2]  # type: ignore[union-attr]
    # Name and id first, once per call; arguments in several fragments after it.
    firsts = [d for d in tool_deltas if d.id is not None]
    assert [(d.index, d.function.name) for d in firsts] == [(0, "get_weather"), (1, "get_time")]
    assert [d.id for d in firsts] == [c.id for c in calls]
    fragments = [d for d in tool_deltas if d.id is None]
    assert all(d.function.name is None for d in fragments)
    assert len([d for d in fragments if d.index == 0]) > 3
    assert final.usage is not None and final.usage.completion_tokens > 0


def test_openai_calls_stream_before_generation_ends(server: RunningServer) -> None:
    """The first call's name arrives while the model is still generating its arguments."""
    body = {"model": "m", "messages": ASK, "tools": WEATHER_TOOLS, "stream": True, **GREEDY}
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("tool_calls"):
                status = http.get("/v1/status").json()
                [running] = status["requests"]
                assert running["phase"] == "decode"
                assert running["generated_tokens"] < reply_tokens(server, TWO_CALLS) - 20
                break
        else:
            pytest.fail("no tool call in the stream")


def test_openai_parallel_tool_calls_false_stops_after_one(
    oai: openai.OpenAI, server: RunningServer
) -> None:
    for stream in (False, True):
        state = ChatCompletionStreamState()
        if stream:
            for chunk in oai.chat.completions.create(
                model="m",
                messages=ASK,  # type: ignore[arg-type]
                tools=WEATHER_TOOLS,  # type: ignore[arg-type]
                parallel_tool_calls=False,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=GREEDY,
            ):
                state.handle_chunk(chunk)
            reply = state.get_final_completion()
        else:
            reply = oai.chat.completions.create(  # type: ignore[assignment]
                model="m",
                messages=ASK,  # type: ignore[arg-type]
                tools=WEATHER_TOOLS,  # type: ignore[arg-type]
                parallel_tool_calls=False,
                extra_body=GREEDY,
            )
        calls = reply.choices[0].message.tool_calls or []
        assert [json.loads(c.function.arguments) for c in calls] == [ARGS_1]  # type: ignore[union-attr]
        assert reply.choices[0].finish_reason == "tool_calls"
        # Generation stopped soon after the first call instead of writing the second.
        assert reply.usage is not None
        assert reply.usage.completion_tokens < reply_tokens(server, TWO_CALLS) - 10


def test_openai_tool_choice_none_and_unknown_tools_cannot_be_called(oai: openai.OpenAI) -> None:
    """The scripted model tries to write calls; the grammar lets no call marker through
    with `tool_choice: none`, and no call to an undefined tool in `auto`."""
    none = oai.chat.completions.create(
        model="m",
        messages=ASK,
        tools=WEATHER_TOOLS,
        tool_choice="none",
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert none.choices[0].message.tool_calls is None
    content = none.choices[0].message.content or ""
    assert content.startswith("Let me check.")
    assert "<tool_call>" not in content
    unknown = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "rockets"}],
        tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        max_tokens=48,  # off its script the model may fill an open object for long
        extra_body=GREEDY,
    )
    message = unknown.choices[0].message
    assert "launch_rockets" not in (message.content or "")
    defined = {tool["function"]["name"] for tool in WEATHER_TOOLS}
    assert all(call.function.name in defined for call in message.tool_calls or [])


def test_no_special_token_text_in_either_api(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    ask = [{"role": "user", "content": "special"}]
    openai_text = oai.chat.completions.create(model="m", messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
    assert openai_text.choices[0].message.content == "Plain answer."
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(
            model="m",
            messages=ask,
            stream=True,
            extra_body=GREEDY,  # type: ignore[arg-type]
        )
        if c.choices
    )
    assert streamed == "Plain answer."
    with claude.messages.stream(
        model="m",
        max_tokens=64,
        messages=ask,
        extra_body=GREEDY,  # type: ignore[arg-type]
    ) as stream:
        message = stream.get_final_message()
    assert [b.text for b in message.content if b.type == "text"] == ["Plain answer."]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ],
)
def test_openai_bad_tools_are_400(server: RunningServer, body: dict[str, Any], param: str) -> None:
    payload = {"model": "m", "messages": ASK, "tools": WEATHER_TOOLS, **body}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)


# ---------------------------------------------------------------- Anthropic


def test_anthropic_tool_use(claude: anthropic.Anthropic, server: RunningServer) -> None:
    message = claude.messages.create(
        model="claude-x",
        max_tokens=512,
        messages=ASK,  # type: ignore[arg-type]
        tools=anthropic_tools(WEATHER_TOOLS),  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me check."  # type: ignore[union-attr]
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", ARGS_1), ("get_time", ARGS_2)]
    assert all(u.id.startswith("toolu_") for u in uses)
    assert message.usage.output_tokens == reply_tokens(server, TWO_CALLS)


def test_anthropic_stream_rebuilt_by_the_sdk(claude: anthropic.Anthropic) -> None:
    kinds: list[tuple[str, str]] = []
    with claude.messages.stream(
        model="claude-x",
        max_tokens=512,
        messages=ASK,  # type: ignore[arg-type]
        tools=anthropic_tools(WEATHER_TOOLS),  # type: ignore[arg-type]
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "content_block_start":
                kinds.append(("start", event.content_block.type))
                if event.content_block.type == "tool_use":
                    assert event.content_block.input == {}
            elif event.type == "content_block_delta":
                kinds.append(("delta", event.delta.type))
        message = stream.get_final_message()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", ARGS_1), ("get_time", ARGS_2)]
    assert message.stop_reason == "tool_use"
    assert [k for k in kinds if k[0] == "start"] == [
        ("start", "text"),
        ("start", "tool_use"),
        ("start", "tool_use"),
    ]
    assert kinds.count(("delta", "input_json_delta")) > 6
    assert message.usage.output_tokens > 0
    assert (
        message.usage.output_tokens
        == claude.messages.create(
            model="claude-x",
            max_tokens=512,
            messages=ASK,  # type: ignore[arg-type]
            tools=anthropic_tools(WEATHER_TOOLS),  # type: ignore[arg-type]
            extra_body=GREEDY,
        ).usage.output_tokens
    )


def test_stop_sequence_across_tokens_is_never_partly_sent(server: RunningServer) -> None:
    """`me ch` spans token boundaries of "Let me check."; no piece of it may be sent."""
    openai_body = {"model": "m", "messages": ASK, "tools": WEATHER_TOOLS, "stop": ["me ch"]}
    anthropic_body = {
        "model": "m",
        "max_tokens": 256,
        "messages": ASK,
        "tools": anthropic_tools(WEATHER_TOOLS),
        "stop_sequences": ["me ch"],
    }
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for path, body in (
            ("/v1/chat/completions", openai_body),
            ("/v1/messages", anthropic_body),
        ):
            whole = http.post(path, json={**body, **GREEDY}).json()
            with http.stream("POST", path, json={**body, **GREEDY, "stream": True}) as response:
                events = [
                    json.loads(line[6:])
                    for line in response.iter_lines()
                    if line.startswith("data: {")
                ]
            texts = [
                e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
            ] + [
                e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta"
            ]
            assert "".join(texts) == "Let "
            if path == "/v1/messages":
                assert whole["content"] == [{"type": "text", "text": "Let "}]
                assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "me ch")
            else:
                assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Let "}
                assert whole["choices"][0]["finish_reason"] == "stop"


def test_anthropic_tool_block_closes_before_generation_ends(server: RunningServer) -> None:
    body = {
        "model": "m",
        "max_tokens": 512,
        "messages": ASK,
        "tools": anthropic_tools(WEATHER_TOOLS),
        "stream": True,
        **GREEDY,
    }
    seen_tool = False
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/messages", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_start":
                seen_tool = event["content_block"]["type"] == "tool_use"
            if event["type"] == "content_block_stop" and seen_tool:
                # The first call is complete; the model is still writing the second.
                [running] = http.get("/v1/status").json()["requests"]
                assert running["generated_tokens"] < reply_tokens(server, TWO_CALLS) - 10
                break
        else:
            pytest.fail("no tool_use block in the stream")


def test_anthropic_disable_parallel_tool_use(
    claude: anthropic.Anthropic, server: RunningServer
) -> None:
    with claude.messages.stream(
        model="m",
        max_tokens=512,
        messages=ASK,  # type: ignore[arg-type]
        tools=anthropic_tools(WEATHER_TOOLS),  # type: ignore[arg-type]
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        message = stream.get_final_message()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", ARGS_1)]
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens < reply_tokens(server, TWO_CALLS) - 10


def test_anthropic_tool_choice_none_is_text(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="m",
        max_tokens=512,
        messages=ASK,  # type: ignore[arg-type]
        tools=anthropic_tools(WEATHER_TOOLS),  # type: ignore[arg-type]
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"name": "x", "description": "no schema"}]},
        {"tool_choice": {"type": "sometimes"}},
        {"tool_choice": {"type": "tool", "name": "nope"}},
    ],
)
def test_anthropic_bad_tools_are_400(server: RunningServer, body: dict[str, Any]) -> None:
    payload = {
        "model": "m",
        "max_tokens": 16,
        "messages": ASK,
        "tools": anthropic_tools(WEATHER_TOOLS),
        **body,
    }
    response = httpx.post(f"{server.base_url}/v1/messages", json=payload, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
