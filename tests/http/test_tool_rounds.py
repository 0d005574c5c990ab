"""`--max-tool-rounds` (server/tool_rounds.py): after N rounds of tool calls since the
user's last message, the model answers without tools, so an agent's turn ends.

The scripted model (Qwen2.5 template, Hermes calls) calls a tool on every request, the way
a small model loops on its call; the same request with and without the limit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.bootstrap import ServeOptions, build_state
from tests.http.scripted_servers import WEATHER_TOOLS, scripted_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# One client for the module: `httpx.post` builds a client, and its TLS context from the
# CA bundle (~50 ms of CPU), per request.
HTTP = httpx.Client()

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"


def _history(rounds: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    for k in range(rounds):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": "sunny"})
    return messages


@pytest.fixture(scope="module")
def servers(embedded_model: LoadedModel) -> Iterator[tuple[RunningServer, RunningServer]]:
    with (
        scripted_server(embedded_model, TEMPLATE, [("", CALL)]) as plain,
        scripted_server(embedded_model, TEMPLATE, [("", CALL)], max_tool_rounds=2) as limited,
    ):
        yield plain, limited


def _chat(server: RunningServer, rounds: int) -> dict[str, Any]:
    body = {"model": "m", "messages": _history(rounds), "tools": WEATHER_TOOLS}
    reply = HTTP.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def test_calls_until_the_limit_then_text(servers: tuple[RunningServer, RunningServer]) -> None:
    plain, limited = servers
    for rounds in (0, 1):  # under the limit: tools offered, the call parsed
        choice = _chat(limited, rounds)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
    at_limit = _chat(limited, 2)
    choice = at_limit["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert not choice["message"].get("tool_calls")
    # Served without tools: the tool definitions are not in the prompt any more.
    unlimited = _chat(plain, 2)
    assert unlimited["choices"][0]["finish_reason"] == "tool_calls"
    assert at_limit["usage"]["prompt_tokens"] < unlimited["usage"]["prompt_tokens"]


def test_a_new_user_message_resets_the_count(servers: tuple[RunningServer, RunningServer]) -> None:
    _, limited = servers
    messages = [*_history(2), {"role": "assistant", "content": "Sunny."}]
    messages.append({"role": "user", "content": "And tomorrow?"})
    body = {"model": "m", "messages": messages, "tools": WEATHER_TOOLS}
    reply = HTTP.post(f"{limited.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


def test_the_limit_must_be_positive(embedded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--max-tool-rounds must be at least 1"):
        build_state(ServeOptions(max_tool_rounds=0), loaded=embedded_model)
