"""Kimi K2 tool loops (#34 item 2): three turns on both APIs with each Kimi K2 template.

Both templates are served with `--chat-template`. Kimi K2 Instruct queues the id of
every assistant call with `tool_response_queue.ids.append(...)`, which the immutable
sandbox refused: echoing a call back was a 400. Turn 1 asks; turns 2 and 3 echo every
call with a result, as an agent does. Each turn must be a 200 that ends in calls, and its
prompt must start with the whole previous prompt: the OpenAI render endpoint's token ids
are a prefix, and the usage reports the previous prompt read from the prefix cache.

The tiny random llama writes the calls: `tool_choice` names the tool, so the grammar of
the detected `kimi_k2` format shapes its output into one call, and the enum-only
parameter keeps it short. (With `any`/`required` the random model tends to write the
same call twice; the server then ends the turn at the repeat and, by design, does not
remember a reply whose tokens hold a call the client never saw, so the next turn
re-renders the reply instead of re-reading it.) No sampling parameters: the bodies are
the clients' defaults otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

TEMPLATES = ("moonshotai-Kimi-K2-Instruct.jinja", "moonshotai-Kimi-K2.jinja")
TURNS = 3
ASK = "Check the weather in each city I care about, one call per city."
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": CITY_SCHEMA},
    }
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": CITY_SCHEMA}]


@pytest.fixture(scope="module", params=TEMPLATES)
def kimi_server(request: pytest.FixtureRequest, tiny_llama_model: LoadedModel) -> Iterator[Any]:
    path = templates_dir() / request.param
    running = start_server(tiny_llama_model, chat_template=str(path))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module: each `httpx.post` builds a client, and with it an SSL
    context from certifi's bundle (~40 ms of CPU)."""
    with httpx.Client(timeout=120) as client:
        yield client


def _post(
    http: httpx.Client, server: RunningServer, path: str, body: dict[str, Any]
) -> dict[str, Any]:
    reply = http.post(f"{server.base_url}{path}", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def _weather(arguments: dict[str, Any]) -> str:
    return f"{arguments['city']}: 18 °C, clear"


def test_openai_tool_loop(http: httpx.Client, kimi_server: RunningServer) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    previous: list[int] | None = None
    previous_reply = 0
    for turn in range(TURNS):
        body = {"model": "kimi", "messages": messages, "tools": OPENAI_TOOLS}
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
        prompt = _post(http, kimi_server, "/v1/chat/completions/render", body)["token_ids"]
        reply = _post(http, kimi_server, "/v1/chat/completions", body)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (turn, choice)
        calls = choice["message"]["tool_calls"]
        assert calls, (turn, choice)
        assert reply["usage"]["prompt_tokens"] == len(prompt)
        if previous is not None:
            # The whole previous prompt, then the echoed reply and the results; the
            # cache serves the prompt and the reply but its last token (a forced call
            # ends when its grammar completes, so that token was never fed).
            assert prompt[: len(previous)] == previous, turn
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == len(previous) + previous_reply - 1, (turn, reply["usage"])
        previous = prompt
        previous_reply = reply["usage"]["completion_tokens"]
        messages.append(choice["message"])
        for call in calls:
            result = _weather(json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def test_anthropic_tool_loop(http: httpx.Client, kimi_server: RunningServer) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    previous_prompt = previous_reply = 0
    for turn in range(TURNS):
        body = {
            "model": "claude-sonnet-4-5",
            "max_tokens": 4096,
            "messages": messages,
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"},
        }
        reply = _post(http, kimi_server, "/v1/messages", body)
        assert reply["stop_reason"] == "tool_use", (turn, reply)
        uses = [block for block in reply["content"] if block["type"] == "tool_use"]
        assert uses, (turn, reply)
        usage = reply["usage"]
        prompt = (
            usage["input_tokens"]
            + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"]
        )
        if turn:
            # Turn N's prompt is a prefix of turn N+1's: all of it and the reply but its
            # last token come from the cache.
            read = usage["cache_read_input_tokens"]
            assert read == previous_prompt + previous_reply - 1, (turn, usage)
            assert prompt > read
        previous_prompt, previous_reply = prompt, usage["output_tokens"]
        messages.append({"role": "assistant", "content": reply["content"]})
        results = [
            {"type": "tool_result", "tool_use_id": use["id"], "content": _weather(use["input"])}
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
