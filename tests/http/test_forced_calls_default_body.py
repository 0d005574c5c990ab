"""Forced calls with the bodies clients send by default (#25 item 1), through every API.

No `disable_parallel_tool_use`, no `parallel_tool_calls: false`, `max_tokens` 1,024, no
temperature. The scripted model (Qwen2.5's template, Hermes calls) keeps writing the same
call, the realistic failure: a named tool still makes exactly one call, and `any` /
`required` end at the repeat with one call, streamed or whole. The same requests on the
embedded model (the JSON envelope) end with valid calls.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

from tests.extended import EXTENDED
from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, scripted_server
from tests.http.test_constrained_http import OPENAI_TOOLS

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

PARIS = {"city": "Paris"}
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_call>'
KEEPS_CALLING = "\n".join([CALL] * 4)
ASK = "What is the weather in Paris?"
SHAPES = (
    "anthropic tool",
    "anthropic any",
    "chat function",
    "chat required",
    "responses function",
    "responses required",
)

# The embedded model writes one shape per API in CI, a named tool and `any` / `required`
# both among them (every shape's path is checked above on the scripted model); the
# extended run (tests/extended.py) takes all six. The rows cost a decode step each, and the
# `any` rows, which write one call per tool, take the longest.
REAL_MODEL_SHAPES = SHAPES if EXTENDED else ("anthropic any", "chat function", "responses required")


def default_body(
    shape: str, tools: list[dict[str, Any]] = WEATHER_TOOLS
) -> tuple[str, dict[str, Any]]:
    """The path and body a client sends for a forced call of `get_weather` (named) or
    any tool, with nothing but the forcing set."""
    named = shape.endswith(("tool", "function"))
    if shape.startswith("anthropic"):
        body: dict[str, Any] = {
            "model": "m",
            "max_tokens": 1024,
            "messages": [{"role": "user", "content": ASK}],
            "tools": anthropic_tools(tools),
            "tool_choice": {"type": "tool", "name": "get_weather"} if named else {"type": "any"},
        }
        return "/v1/messages", body
    if shape.startswith("chat"):
        choice: Any = (
            {"type": "function", "function": {"name": "get_weather"}} if named else "required"
        )
        body = {"model": "m", "messages": [{"role": "user", "content": ASK}], "tools": tools}
        return "/v1/chat/completions", {**body, "tool_choice": choice}
    flat = [{"type": "function", **t["function"]} for t in tools]
    choice = {"type": "function", "name": "get_weather"} if named else "required"
    body = {"model": "m", "input": ASK, "tools": flat, "tool_choice": choice}
    return "/v1/responses", {**body, "max_output_tokens": 1024}


def ended_calls(shape: str, reply: dict[str, Any]) -> tuple[bool, list[tuple[str, Any]]]:
    """Whether the reply ended in tool calls, and its calls as (name, arguments)."""
    if shape.startswith("anthropic"):
        uses = [(b["name"], b["input"]) for b in reply["content"] if b["type"] == "tool_use"]
        return reply["stop_reason"] == "tool_use", uses
    if shape.startswith("chat"):
        choice = reply["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        made = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        return choice["finish_reason"] == "tool_calls", made
    items = [i for i in reply["output"] if i["type"] == "function_call"]
    return reply["status"] == "completed", [(i["name"], json.loads(i["arguments"])) for i in items]


@pytest.fixture(scope="module")
def keeps_calling(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    replies = [("", KEEPS_CALLING)]
    with scripted_server(embedded_model, "Qwen-Qwen2.5-7B-Instruct.jinja", replies) as server:
        yield server


@pytest.mark.parametrize("shape", SHAPES)
def test_a_model_that_keeps_calling_makes_one_call(
    keeps_calling: RunningServer, shape: str
) -> None:
    path, body = default_body(shape)
    reply = httpx.post(keeps_calling.base_url + path, json=body, timeout=120).json()
    ended, calls = ended_calls(shape, reply)
    assert ended, reply
    assert calls == [("get_weather", PARIS)], reply


def _streamed_anthropic(server: RunningServer, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """The stop reason and the tool_use inputs (rebuilt from their deltas) of a stream."""
    stop, inputs, current = "", [], None
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if (
                event["type"] == "content_block_start"
                and event["content_block"]["type"] == "tool_use"
            ):
                current = ""
            elif event["type"] == "content_block_delta" and current is not None:
                current += event["delta"].get("partial_json", "")
            elif event["type"] == "content_block_stop" and current is not None:
                inputs.append(json.loads(current))
                current = None
            elif event["type"] == "message_delta":
                stop = event["delta"]["stop_reason"]
    return stop, inputs


def test_a_streamed_any_call_ends_at_the_repeat(keeps_calling: RunningServer) -> None:
    _, body = default_body("anthropic any")
    assert _streamed_anthropic(keeps_calling, body) == ("tool_use", [PARIS])


def test_the_embedded_model_ends_every_default_forced_call(server: RunningServer) -> None:
    """The real model (the envelope), each shape of REAL_MODEL_SHAPES once, concurrently:
    ends in calls, one for a named tool, none repeated, each valid against its tool's
    schema (strings bounded so that the 135M model's arguments stay short)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in OPENAI_TOOLS}
    replies = asyncio.run(_post_all(server, REAL_MODEL_SHAPES))
    for shape, reply in zip(REAL_MODEL_SHAPES, replies, strict=True):
        ended, calls = ended_calls(shape, reply)
        assert ended and calls, (shape, reply)
        if shape.endswith(("tool", "function")):
            assert [name for name, _ in calls] == ["get_weather"], (shape, reply)
        assert all(calls[i] not in calls[:i] for i in range(len(calls))), (shape, reply)
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])


async def _post_all(server: RunningServer, shapes: tuple[str, ...]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:

        async def post(shape: str) -> dict[str, Any]:
            path, body = default_body(shape, OPENAI_TOOLS)
            reply: dict[str, Any] = (await client.post(path, json=body)).json()
            return reply

        return list(await asyncio.gather(*(post(shape) for shape in shapes)))
