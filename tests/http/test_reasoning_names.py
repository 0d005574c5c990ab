"""Reasoning under both names chat clients use (#20 item 4): `reasoning_content`
(vLLM, DeepSeek) and `reasoning` (OpenRouter, llama.cpp, LM Studio), out and back in.

The scripted model on the Qwen3 template thinks, then calls a tool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.http.scripted_servers import WEATHER_TOOLS, scripted_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

THOUGHT = "The user asks about weather in Paris.\nI should call get_weather."
REPLY = (
    f"<think>\n{THOUGHT}\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen3(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(embedded_model, "Qwen-Qwen3-0.6B.jinja", [("", REPLY)]) as s:
        yield s


def _chat(server: RunningServer, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": messages, "tools": WEATHER_TOOLS, "temperature": 0, **extra}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def test_reasoning_out_under_both_names(qwen3: RunningServer) -> None:
    message = _chat(qwen3, ASK).json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    both: dict[str, str] = {"reasoning_content": "", "reasoning": ""}
    with httpx.stream(
        "POST",
        f"{qwen3.base_url}/v1/chat/completions",
        json={"model": "m", "messages": ASK, "tools": WEATHER_TOOLS, "stream": True},
        timeout=120,
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for name in both:
                        both[name] += choice["delta"].get(name) or ""
    assert both == {"reasoning_content": THOUGHT, "reasoning": THOUGHT}


def test_reasoning_accepted_back_under_both_names(qwen3: RunningServer) -> None:
    """Qwen3's template renders the thinking of an assistant turn after the last user
    message: either name must reach it, identically."""

    def history(**reasoning: str) -> list[dict[str, Any]]:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        return [
            *ASK,
            {"role": "assistant", "content": "Checking.", "tool_calls": [call], **reasoning},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        reply = _chat(qwen3, messages, max_tokens=1)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    without = prompt_tokens(history())
    as_content = prompt_tokens(history(reasoning_content=THOUGHT))
    as_reasoning = prompt_tokens(history(reasoning=THOUGHT))
    assert as_content == as_reasoning > without
