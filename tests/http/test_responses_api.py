"""The Responses API (`POST /v1/responses`) through the openai SDK's Responses client and
raw SSE, on the real embedded model (the session's shared server); the raw events' framing,
which does not depend on what the model says, on the tiny llama (the embedded tokenizer
and template)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest

from tests.conftest import start_server
from tests.http.responses_helpers import (
    APPLY_PATCH_TOOL,
    client,
    final_response,
    stream_events,
)

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

pytestmark = pytest.mark.model

QUESTION = "What is the capital of France?"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}

TOOLS: Any = [WEATHER]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model)
    yield running
    running.stop()


def test_stream_helper_final_response_equals_non_streamed(server: RunningServer) -> None:
    args: dict[str, Any] = {
        "model": "gpt-5",
        "input": QUESTION,
        "instructions": "Answer in one sentence.",
        "temperature": 0,
        "max_output_tokens": 24,
    }
    whole = client(server.base_url).responses.create(**args)
    with client(server.base_url).responses.stream(**args) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert whole.status == streamed.status == "completed"
    assert "Paris" in whole.output_text
    assert streamed.output_text == whole.output_text
    # (the stream helper's items carry a `parsed: None` of its own)
    assert [item.model_dump(exclude={"id"}, exclude_none=True) for item in streamed.output] == [
        item.model_dump(exclude={"id"}, exclude_none=True) for item in whole.output
    ]
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.model == "gpt-5" and whole.instructions == "Answer in one sentence."
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_raw_events_validate_and_deltas_add_up(tiny_server: RunningServer) -> None:
    events = stream_events(
        tiny_server.base_url,
        {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": 16},
    )
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert len(done) == 1 and done[0]["text"] == deltas
    final = final_response(events)
    assert final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] > 0


def test_continued_conversation_reads_the_previous_prompt_from_cache(
    server: RunningServer,
) -> None:
    oai = client(server.base_url)
    first = oai.responses.create(
        model="m",
        input=[
            {"role": "developer", "content": "You are terse."},
            {"role": "user", "content": QUESTION},
        ],
        temperature=0,
        max_output_tokens=16,
    )
    assert first.usage is not None
    second = oai.responses.create(
        model="m",
        previous_response_id=first.id,
        input="And of Italy?",
        temperature=0,
        max_output_tokens=8,
    )
    assert second.usage is not None and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.8 * first.usage.input_tokens
    # The same history resent by the client (as Codex does) is the same prompt.
    history: Any = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And of Italy?"},
    ]
    resent = oai.responses.create(
        model="m",
        input=history,
        temperature=0,
        max_output_tokens=8,
    )
    assert resent.usage is not None
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens >= 0.8 * second.usage.input_tokens
    assert resent.output_text == second.output_text


def test_forced_function_call_is_valid_five_times_at_temperature_0_8(
    server: RunningServer,
) -> None:
    async def one(oai: openai.AsyncOpenAI, city: str) -> Any:
        return await oai.responses.create(
            model="m",
            input=f"What's the weather in {city}?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            temperature=0.8,
            # Room for the longest call the schema allows (16 characters of city can be
            # 16+ tokens at this temperature): a call cut by the budget is `incomplete`.
            max_output_tokens=128,
        )

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0
        ) as oai:
            cities = ("Paris", "Rome", "Oslo", "Lima", "Kyiv")
            return await asyncio.gather(*(one(oai, city) for city in cities))

    for reply in asyncio.run(run()):
        assert reply.status == "completed", reply.output
        assert [item.type for item in reply.output] == ["function_call"]
        call = reply.output[0]
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_max_output_tokens_gives_incomplete(server: RunningServer) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "input": "Write a long story about a dragon.",
        "max_output_tokens": 3,
    }
    whole = client(server.base_url).responses.create(**body)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 3
    events = stream_events(server.base_url, body)
    assert events[-1]["type"] == "response.incomplete"
    assert final_response(events)["output"][0]["status"] == "incomplete"


def test_namespace_tool_call_comes_back_with_namespace_and_name(server: RunningServer) -> None:
    namespace = {
        "type": "namespace",
        "name": "mcp__files",
        "description": "A file server",
        "tools": [
            {
                "type": "function",
                "name": "read",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "maxLength": 16}},
                    "required": ["path"],
                },
            }
        ],
    }
    oai = client(server.base_url)
    tools: Any = [namespace, {"type": "web_search"}]
    choice: Any = {"type": "function", "name": "read", "namespace": "mcp__files"}
    first = oai.responses.create(
        model="m",
        input="Read notes.txt",
        tools=tools,
        tool_choice=choice,
        temperature=0,
        max_output_tokens=32,
    )
    (call,) = first.output
    assert call.type == "function_call"
    assert (call.namespace, call.name) == ("mcp__files", "read")
    assert "path" in json.loads(call.arguments)
    history: Any = [
        {"role": "user", "content": "Read notes.txt"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "buy milk"},
    ]
    second = oai.responses.create(
        model="m", input=history, tools=tools, temperature=0, max_output_tokens=1
    )
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None
    # The call and its output were rendered: the prompt grew past the first one.
    assert first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens


def test_forced_apply_patch_is_constrained_by_codexs_lark_grammar(server: RunningServer) -> None:
    events = stream_events(
        server.base_url,
        {
            "model": "m",
            "input": "Create hello.txt containing the line hi.",
            "tools": [APPLY_PATCH_TOOL],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "temperature": 0,
            "max_output_tokens": 24,
        },
    )
    final = final_response(events)
    (item,) = final["output"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch"
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"
    )
    (done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert done["input"] == deltas == item["input"]
    # The tiny model left alone writes prose; under the grammar every line is patch syntax.
    text = item["input"]
    assert text.startswith("*** Begin Patch\n*** ")
    for line in text.split("\n")[1:-1]:
        assert line.startswith(("*** ", "+", "-", " ", "@@")), line
