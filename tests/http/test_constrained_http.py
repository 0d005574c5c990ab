"""Structured outputs and forced tool calls on the real embedded model, through both SDKs.

The embedded SmolLM2 template ignores `tools`, so its calls go through the JSON envelope
(tools told in the system prompt, output constrained to a list of calls or a response).
Requests run concurrently, so each group costs about one batched generation.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

if TYPE_CHECKING:
    from tests.conftest import RunningServer

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "kind": {"enum": ["capital", "town", "village"]},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "maxItems": 3,
        },
        "location": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 24}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "population", "kind", "landmarks", "location"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": "", "input_schema": t["function"]["parameters"]}
    for t in OPENAI_TOOLS
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HOT: dict[str, Any] = {"temperature": 0.8}


def async_oai(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def async_claude(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key="x", max_retries=0)


def test_openai_json_schema_outputs_validate(server: RunningServer) -> None:
    async def one(client: openai.AsyncOpenAI, seed: int) -> Any:
        return await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY, "strict": True},
            },
            max_tokens=160,
            seed=seed,
            **HOT,
        )

    async def run() -> list[Any]:
        async with async_oai(server) as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(10)))

    for completion in asyncio.run(run()):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)


def _compact(text: str) -> bool:
    """Whether the only whitespace outside strings is one space after `,` and `:`
    (json.dumps' layout): the grammar gives the model no free whitespace to loop on."""
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char.isspace() and (char != " " or i == 0 or text[i - 1] not in ",:"):
            return False
    return True


def test_openai_json_object_ends_when_the_object_does(server: RunningServer) -> None:
    """Default bodies (max_tokens 1,024, no temperature): the model closes the object and
    the reply ends there, in the compact layout (benches/json_object_ends.py: 10 prompts)."""
    asks = [
        "Return JSON with the keys city and country for the capital of France.",
        "Give the weather in Paris as JSON (temperature and sky).",
    ]

    async def one(client: openai.AsyncOpenAI, ask: str) -> Any:
        return await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": ask}],
            response_format={"type": "json_object"},
            max_tokens=1024,
        )

    async def run() -> list[Any]:
        async with async_oai(server) as client:
            return await asyncio.gather(*(one(client, ask) for ask in asks))

    for completion in asyncio.run(run()):
        choice = completion.choices[0]
        content = choice.message.content or ""
        assert choice.finish_reason == "stop", content
        assert isinstance(json.loads(content), dict) and _compact(content), content
        assert completion.usage.completion_tokens < 100, content


def test_text_completions_follow_the_output_format(server: RunningServer) -> None:
    """/v1/completions takes the chat fields: the whole completion matches, streamed too."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    base = {"model": "m", "prompt": "The capital of France as JSON:", "max_tokens": 40}
    formats: list[dict[str, Any]] = [
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"structured_outputs": {"json": schema}},
        {"guided_json": schema},
    ]

    async def wholes() -> list[Any]:  # the three spellings at once: one batched generation
        async with async_oai(server) as client:
            jobs = [client.completions.create(**base, extra_body=fmt) for fmt in formats]  # type: ignore[call-overload]
            return await asyncio.gather(*jobs)

    for whole in asyncio.run(wholes()):
        assert whole.choices[0].finish_reason == "stop", whole.choices[0].text
        jsonschema.validate(json.loads(whole.choices[0].text), schema)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    streamed = client.completions.create(**base, stream=True, extra_body=formats[0])  # type: ignore[call-overload]
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    choice = client.completions.create(
        model="m",
        prompt="Is Paris in France? Answer:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")
    obj = client.completions.create(
        model="m",
        prompt="A JSON object:",
        max_tokens=60,
        extra_body={"response_format": {"type": "json_object"}},
    )
    # json_object bounds no length (a sampled key may run past max_tokens: seen in CI), so
    # an object when it stopped, else the start of one cut at the limit.
    text, finish = obj.choices[0].text, obj.choices[0].finish_reason
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and text.startswith("{"), (finish, text)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_anthropic_forced_calls_are_one_valid_tool_use(server: RunningServer) -> None:
    async def one(client: anthropic.AsyncAnthropic, seed: int) -> anthropic.types.Message:
        return await client.messages.create(
            model="m",
            max_tokens=200,
            messages=ASK,  # type: ignore[arg-type]
            tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"seed": seed, "temperature": 0.8},
        )

    async def run() -> list[anthropic.types.Message]:
        async with async_claude(server) as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(10)))

    for message in asyncio.run(run()):
        assert message.stop_reason == "tool_use", message.content
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) == 1 and message.content[0].type == "tool_use", message.content
        use = uses[0]
        assert use.name in ("get_weather", "get_time")
        if use.name == "get_weather":
            jsonschema.validate(use.input, WEATHER)


@pytest.fixture(scope="module")
def forced_openai_calls(server: RunningServer) -> dict[str, list[Any]]:
    """OpenAI's `required` and named calls, five seeds each, sent together: one batched
    generation for both cases."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices: dict[str, Any] = {"required": "required", "named": named}

    async def one(client: openai.AsyncOpenAI, tool_choice: Any, seed: int) -> Any:
        return await client.chat.completions.create(
            model="m",
            messages=ASK,  # type: ignore[arg-type]
            tools=OPENAI_TOOLS,  # type: ignore[arg-type]
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
            **HOT,
        )

    async def run() -> list[Any]:
        async with async_oai(server) as client:
            jobs = [one(client, c, seed) for c in choices.values() for seed in range(5)]
            return await asyncio.gather(*jobs)

    done = asyncio.run(run())
    return {name: done[5 * i : 5 * i + 5] for i, name in enumerate(choices)}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_required_and_named_calls(
    forced_openai_calls: dict[str, list[Any]], choice: str
) -> None:
    completions = forced_openai_calls[choice]
    assert len(completions) == 5
    for completion in completions:
        choice_ = completion.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message
        calls = choice_.message.tool_calls or []
        assert len(calls) == 1
        for call in calls:
            if choice == "named":
                assert call.function.name == "get_weather"
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_streamed_forced_calls_rebuild_through_both_sdks(server: RunningServer) -> None:
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    request: dict[str, Any] = {
        "model": "m",
        "messages": ASK,
        "tools": OPENAI_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = oai.chat.completions.create(**request)
    state = ChatCompletionStreamState()
    for chunk in oai.chat.completions.create(**request, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion()
    for completion in (whole, streamed):
        (call,) = completion.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert (
        streamed.choices[0].message.tool_calls[0].function.arguments  # type: ignore[index]
        == whole.choices[0].message.tool_calls[0].function.arguments  # type: ignore[index]
    )

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 200,
        "messages": ASK,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "extra_body": {"temperature": 0},
    }
    whole_message = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        streamed_message = stream.get_final_message()
    for message in (whole_message, streamed_message):
        assert message.stop_reason == "tool_use"
        (use,) = message.content
        assert use.type == "tool_use" and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER)
    assert streamed_message.content[0].input == whole_message.content[0].input  # type: ignore[union-attr]


def test_anthropic_output_format_validates(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={
            "model": "m",
            "max_tokens": 160,
            "messages": [{"role": "user", "content": "Describe Rome as JSON."}],
            "output_config": {"format": {"type": "json_schema", "schema": CITY}},
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(body["content"][0]["text"]), CITY)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        (
            "/v1/completions",
            {
                "prompt": "Paris is",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}},
                },
            },
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"prompt": "Paris is", "guided_regex": "(unclosed"}, "guided_regex"),
        (
            "/v1/completions",
            {"prompt": "Paris is", "structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
        ),
        (
            "/v1/messages",
            {
                "output_config": {
                    "format": {"type": "json_schema", "schema": {"type": "nosuchtype"}}
                }
            },
            "output_config.format.schema",
        ),
    ],
)
def test_unsatisfiable_constraints_are_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{server.base_url}{path}",
        json={"model": "m", "max_tokens": 16, "messages": ASK, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in error["message"], error
    if path.startswith("/v1/c"):  # chat and text completions: OpenAI's error shape
        assert error["param"] == param
    else:
        assert error["type"] == "invalid_request_error"
    # The server keeps serving.
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
