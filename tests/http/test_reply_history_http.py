"""Through HTTP, a next turn that echoes the server's reply reads the whole reply from the
prefix cache even where the template re-renders it otherwise (`--reply-history`).

The Qwen3 template drops the thinking of an echoed reply that carries none (OpenAI
clients never send it back), so its own rendering leaves the cache at the reply's first
token. The scripted model writes thinking and a call through the real engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anthropic
import openai
import pytest

from tests.http.scripted_servers import WEATHER_TOOLS, anthropic_tools, scripted_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

THINK_AND_CALL = (
    "<think>\nThe user asks about Paris.\nI should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def spliced(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(embedded_model, "Qwen-Qwen3-0.6B.jinja", [("", THINK_AND_CALL)]) as s:
        yield s


@pytest.fixture(scope="module")
def template_only(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    with scripted_server(
        embedded_model,
        "Qwen-Qwen3-0.6B.jinja",
        [("", THINK_AND_CALL)],
        reply_history="template",
    ) as s:
        yield s


def _openai_turns(server: RunningServer, parallel: bool) -> tuple[int, int, int]:
    """(turn-1 prompt tokens, turn-1 completion tokens, turn-2 cached tokens)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        parallel_tool_calls=parallel,
        extra_body=GREEDY,
    )
    message = first.choices[0].message
    assert message.tool_calls and first.usage is not None
    echo = {  # what an OpenAI client sends back: no reasoning
        "role": "assistant",
        "content": message.content,
        "tool_calls": [call.model_dump() for call in message.tool_calls],
    }
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 21C"}
    second = client.chat.completions.create(
        model="m",
        messages=[*ASK, echo, result],  # type: ignore[list-item]
        tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body=GREEDY,
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    return first.usage.prompt_tokens, first.usage.completion_tokens, cached


@pytest.mark.parametrize("parallel", [True, False], ids=["stop-token", "cut-after-the-call"])
def test_an_openai_echo_reads_the_whole_reply_from_the_cache(
    spliced: RunningServer, parallel: bool
) -> None:
    prompt, completion, cached = _openai_turns(spliced, parallel)
    # Everything but the token that ended the reply (or the first one after it).
    assert cached >= prompt + completion - 1, (prompt, completion, cached)


def test_the_template_alone_reads_none_of_the_reply(template_only: RunningServer) -> None:
    prompt, completion, cached = _openai_turns(template_only, parallel=True)
    assert prompt <= cached < prompt + 2, (prompt, completion, cached)


def test_an_anthropic_echo_with_thinking_reads_the_whole_reply(spliced: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=spliced.base_url, api_key="x", max_retries=0)
    tools = anthropic_tools(WEATHER_TOOLS)
    with client.messages.stream(
        model="m",
        max_tokens=512,
        messages=ASK,
        tools=tools,
        extra_body=GREEDY,  # type: ignore[arg-type]
    ) as stream:
        first = stream.get_final_message()
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.type == "tool_use"
    second = client.messages.create(
        model="m",
        max_tokens=1,
        tools=tools,  # type: ignore[arg-type]
        messages=[
            *ASK,  # type: ignore[list-item]
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
            },
        ],
        extra_body=GREEDY,
    )
    u1 = first.usage
    prompt = (
        u1.input_tokens + (u1.cache_read_input_tokens or 0) + (u1.cache_creation_input_tokens or 0)
    )
    cached = second.usage.cache_read_input_tokens or 0
    assert cached >= prompt + u1.output_tokens - 1, (prompt, u1.output_tokens, cached)


def test_a_responses_continuation_reads_the_whole_reply(spliced: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{spliced.base_url}/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", **t["function"]} for t in WEATHER_TOOLS]
    first = client.responses.create(model="m", input=ASK, tools=tools, temperature=0)  # type: ignore[arg-type]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.usage is not None
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
        tools=tools,
        max_output_tokens=16,
        temperature=0,
    )
    assert second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1, (
        first.usage,
        cached,
    )
