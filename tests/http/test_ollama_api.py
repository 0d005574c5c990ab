"""Ollama's `/api/chat` and `/api/generate` end to end: the scripted model (Qwen3 template:
<think> reasoning, Hermes calls) writes exact replies through the real tokenizer, engine
and HTTP layer, read back as curl-like clients do (NDJSON, streamed by default) and by
the official `ollama` Python client (which sends `stream: false` unless told). A JSON
schema `format` runs on the real embedded model. Model lifetimes (keep_alive) on a
server of several models are in test_multi_model.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import ollama
import pytest

from tests.http.scripted_servers import WEATHER_TOOLS, scripted_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

MODEL = "scripted"
HELLO = "Hello there, friend."
THOUGHT = "The user asks about Paris."
ARGS = {"city": "Paris", "opts": {"days": [1, 2]}}
THINK_AND_CALL = (
    f"<think>\n{THOUGHT}\n</think>\n\nChecking.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>'
)
CITY_JSON = '{"city": "Paris", "country": "France"}'
REPLIES = [("weather", THINK_AND_CALL), ("json", CITY_JSON), ("", HELLO)]
HI = [{"role": "user", "content": "Hi!"}]
FINAL_COUNTS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


@pytest.fixture(scope="module")
def scripted(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(
        embedded_model, "Qwen-Qwen3-0.6B.jinja", REPLIES, strict_model_names=True
    ) as running:
        yield running


@pytest.fixture
def client(scripted: RunningServer) -> ollama.Client:
    return ollama.Client(host=scripted.base_url)


def reply_tokens(server: RunningServer, text: str) -> int:
    """Tokens the scripted model generates for `text`, plus the end-of-turn token."""
    return len(server.state.engine.model.tokenizer.encode(text)) + 1  # type: ignore[attr-defined]


def ndjson(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def check_final(final: dict[str, Any], eval_count: int) -> None:
    assert final["done"] is True and final["done_reason"] == "stop", final
    assert final["eval_count"] == eval_count
    assert final["prompt_eval_count"] > 5
    for key in FINAL_COUNTS:
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]


def test_chat_streams_by_default(scripted: RunningServer) -> None:
    """What curl and Ollama's CLI send: no `stream` field."""
    lines = ndjson(scripted.base_url, "/api/chat", {"model": MODEL, "messages": HI})
    *chunks, final = lines
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk["model"] == MODEL and chunk["done"] is False
        assert chunk["message"]["role"] == "assistant"
        assert chunk["created_at"].endswith("Z")
    assert "".join(c["message"]["content"] for c in chunks) == HELLO
    assert final["message"] == {"role": "assistant", "content": ""}
    check_final(final, reply_tokens(scripted, HELLO))


def test_chat_through_the_ollama_client(client: ollama.Client, scripted: RunningServer) -> None:
    reply = client.chat(model=MODEL, messages=HI)  # the client's default: stream false
    assert reply.message.content == HELLO
    assert reply.done and reply.done_reason == "stop"
    assert reply.eval_count == reply_tokens(scripted, HELLO)
    streamed = list(client.chat(model=f"{MODEL}:latest", messages=HI, stream=True))
    assert "".join(part.message.content or "" for part in streamed) == HELLO
    assert streamed[-1].done and not any(part.done for part in streamed[:-1])


def test_chat_thinking_and_a_tool_call(client: ollama.Client, scripted: RunningServer) -> None:
    ask = [{"role": "user", "content": "weather in Paris?"}]
    reply = client.chat(model=MODEL, messages=ask, tools=WEATHER_TOOLS)
    message = reply.message
    assert message.thinking == THOUGHT
    assert message.content == "Checking."
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0].function
    assert call.name == "get_weather" and call.arguments == ARGS
    assert reply.done_reason == "stop"

    # Streamed: the call comes whole, in one object, arguments as an object.
    lines = ndjson(
        scripted.base_url, "/api/chat", {"model": MODEL, "messages": ask, "tools": WEATHER_TOOLS}
    )
    with_calls = [line for line in lines if line["message"].get("tool_calls")]
    assert len(with_calls) == 1
    (streamed_call,) = with_calls[0]["message"]["tool_calls"]
    assert streamed_call["function"]["name"] == "get_weather"
    assert streamed_call["function"]["arguments"] == ARGS
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
    check_final(lines[-1], reply_tokens(scripted, THINK_AND_CALL))

    # The call and its result sent back, as the client does for the next turn.
    history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"function": call.model_dump()}]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    ]
    follow_up = client.chat(model=MODEL, messages=history, tools=WEATHER_TOOLS, think=False)
    assert follow_up.message.content is not None and follow_up.done


def test_generate_streams_by_default_and_not_when_asked(
    client: ollama.Client, scripted: RunningServer
) -> None:
    lines = ndjson(scripted.base_url, "/api/generate", {"model": MODEL, "prompt": "Hi!"})
    *chunks, final = lines
    assert "".join(c["response"] for c in chunks) == HELLO
    assert final["response"] == ""
    check_final(final, reply_tokens(scripted, HELLO))

    whole = client.generate(model=MODEL, prompt="Hi!", system="Be brief.")
    assert whole.response == HELLO and whole.done_reason == "stop"

    # raw: the prompt as written, no template (the scripted model stops at once
    # without its reply marker): one final object, no text.
    raw = httpx.post(
        f"{scripted.base_url}/api/generate",
        json={"model": MODEL, "prompt": "Hi!", "raw": True, "stream": False},
    ).json()
    assert raw["done"] and raw["prompt_eval_count"] == 2 and raw["response"] == ""


def test_format_json_and_num_predict(client: ollama.Client, scripted: RunningServer) -> None:
    ask = [{"role": "user", "content": "json please"}]
    reply = client.chat(model=MODEL, messages=ask, format="json")
    assert json.loads(reply.message.content or "") == json.loads(CITY_JSON)
    cut = client.chat(model=MODEL, messages=HI, options={"num_predict": 2})
    assert cut.done_reason == "length" and cut.eval_count == 2


def test_a_json_schema_format_constrains_the_real_model(server: RunningServer) -> None:
    """The session's embedded-model server (tests/conftest.py): the schema is the output's
    grammar; a short string keeps the reply to a few tokens."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    reply = httpx.post(
        f"{server.base_url}/api/chat",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "The capital of France, as JSON."}],
            "format": schema,
            "stream": False,
        },
        timeout=120,
    ).json()
    assert reply["done_reason"] == "stop", reply
    assert set(json.loads(reply["message"]["content"])) == {"capital"}
