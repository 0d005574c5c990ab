"""gpt-oss (harmony), Gemma 4, MiniMax-M2 and LFM2 replies end to end: the scripted model
writes each format through its real chat template, the server detects the format and
reasoning from the template, and both SDKs rebuild reasoning, text and calls (streamed
and whole) with no markup left."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.conftest import start_server
from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, template
from tests.http.sdk_clients import claude_streamed_and_whole, oai
from tests.scripted_model import scripted_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

GREEDY: dict[str, Any] = {"temperature": 0}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user asks about Paris. I should call get_weather."
PARIS = {"city": "Paris", "opts": {"units": "metric", "days": [1, 2]}}

# The second message's `<|start|>assistant` is left out: the scripted model finds where its
# reply starts by the prompt's last `start|>assistant`, and would restart at one of its own.
# (The parser tests cover the full form.)
HARMONY_CALL = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    f"{json.dumps(PARIS)}<|call|>"
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>A greeting.<|end|>"
    "<|channel|>final<|message|>Hello! How can I help?<|return|>"
)
GEMMA4_CALL = (
    f"<|channel>thought\n{THOUGHT}<channel|>Checking.<|tool_call>call:get_weather"
    '{city:<|"|>Paris<|"|>,opts:{days:[1,2],units:<|"|>metric<|"|>}}<tool_call|>'
    "<|tool_response>"
)
MINIMAX_CALL = (
    f'{THOUGHT}\n</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n'
    f'<parameter name="opts">{json.dumps(PARIS["opts"])}</parameter>\n'
    "</invoke>\n</minimax:tool_call>"
)
# A single-quoted string (Python) and a JSON-spelled dict: the grammar of a started call
# takes both for a free string, JSON for the rest.
LFM2_CALL = (
    "Checking.<|tool_call_start|>[get_weather(city='Paris', "
    'opts={"units": "metric", "days": [1, 2]})]<|tool_call_end|>'
)


@contextmanager
def _server(
    embedded: LoadedModel, file: str, reply_start: str, replies: list[tuple[str, str]]
) -> Iterator[RunningServer]:
    loaded = scripted_model(embedded, template(file), replies, reply_start=reply_start)
    running = start_server(loaded)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def gpt_oss(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    replies = [("Hello", HARMONY_ANSWER), ("", HARMONY_CALL)]
    with _server(embedded_model, "openai-gpt-oss-120b.jinja", "start|>assistant", replies) as s:
        yield s


@pytest.fixture(scope="module")
def gemma(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    start = "<|turn>model\n<|channel>thought\n<channel|>"
    with _server(embedded_model, "google-gemma-4-31B-it.jinja", start, [("", GEMMA4_CALL)]) as s:
        yield s


def _openai_both(server: RunningServer, messages: list[dict[str, Any]]) -> list[Any]:
    """The reply whole and rebuilt from the stream by the SDK's own accumulator; every
    streamed delta is checked for markup."""
    client = oai(server)
    kw: dict[str, Any] = {"model": "m", "messages": messages, "tools": WEATHER_TOOLS}
    whole = client.chat.completions.create(**kw, extra_body=GREEDY)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body=GREEDY):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for field in ("content", "reasoning_content"):
                assert "<|" not in (delta.get(field) or ""), delta
                assert "|>" not in (delta.get(field) or ""), delta
    return [whole, state.get_final_completion()]


def _check_call(reply: Any, text: str | None, args: dict[str, Any]) -> None:
    message = reply.choices[0].message
    assert message.model_dump().get("reasoning_content") == THOUGHT
    assert (message.content or None) == text
    [call] = message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == args
    assert reply.choices[0].finish_reason == "tool_calls"


def test_gpt_oss_analysis_and_call_in_openai(gpt_oss: RunningServer) -> None:
    for reply in _openai_both(gpt_oss, ASK):
        _check_call(reply, None, PARIS)


def test_gpt_oss_final_answer_in_openai(gpt_oss: RunningServer) -> None:
    for reply in _openai_both(gpt_oss, [{"role": "user", "content": "Hello"}]):
        message = reply.choices[0].message
        assert message.model_dump().get("reasoning_content") == "A greeting."
        assert message.content == "Hello! How can I help?"
        assert not message.tool_calls
        assert reply.choices[0].finish_reason == "stop"


def test_gpt_oss_in_anthropic(gpt_oss: RunningServer) -> None:
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 2048,
        "messages": ASK,
        "tools": anthropic_tools(WEATHER_TOOLS),
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    events, streamed, whole = claude_streamed_and_whole(gpt_oss, request)
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    for message in (streamed, whole):
        assert [b.type for b in message.content] == ["thinking", "tool_use"]
        thinking, use = message.content
        assert thinking.thinking == THOUGHT  # type: ignore[union-attr]
        assert (use.name, use.input) == ("get_weather", PARIS)  # type: ignore[union-attr]
        assert message.stop_reason == "tool_use"
    assert json.loads("".join(fragments)) == PARIS
    assert len(fragments) > 1  # the arguments streamed as generated


def test_v1_models_shows_the_detected_parsing(gpt_oss: RunningServer, gemma: RunningServer) -> None:
    for server, expected in ((gpt_oss, "harmony"), (gemma, "gemma4")):
        card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
        assert card["output_parsing"] == {"tool_calls": expected, "reasoning": expected}


def test_gemma4_thought_text_and_call(gemma: RunningServer) -> None:
    for reply in _openai_both(gemma, ASK):
        _check_call(reply, "Checking.", PARIS)


@pytest.mark.parametrize(
    ("file", "reply_start", "reply"),
    [
        ("MiniMaxAI-MiniMax-M2.jinja", "]~b]ai\n<think>\n", MINIMAX_CALL),
        ("LiquidAI-LFM2.5-Instruct.jinja", "<|im_start|>assistant\n", LFM2_CALL),
    ],
    ids=["minimax_m2", "lfm2"],
)
def test_minimax_and_lfm2_calls(
    embedded_model: LoadedModel, file: str, reply_start: str, reply: str
) -> None:
    with _server(embedded_model, file, reply_start, [("", reply)]) as server:
        for whole in _openai_both(server, ASK):
            message = whole.choices[0].message
            assert message.content == "Checking."
            thought = THOUGHT if "MiniMax" in file else None
            assert message.model_dump().get("reasoning_content") == thought
            [call] = message.tool_calls or []
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "get_weather",
                PARIS,
            )
