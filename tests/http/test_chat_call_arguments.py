"""Past tool calls whose `arguments` are not a JSON object are taken as OpenAI takes them.

OpenAI accepts any string as a past call's `arguments` (a model may have written
arguments that are not JSON, and the client echoes its reply back). The server keeps
that string and gives it to the chat template as a string; JSON object text still
becomes an object. Qwen3's template writes a string as it is and an object with
`tojson`, so the rendered prompt shows which one it got.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server
from tests.shared_data import shared_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

TEMPLATE = shared_dir() / "templates" / "Qwen-Qwen3-0.6B.jinja"


@pytest.fixture(scope="module")
def qwen_template_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    assert TEMPLATE.is_file(), f"missing shared template {TEMPLATE}"
    running = start_server(embedded_model, chat_template=str(TEMPLATE), max_output_tokens=4)
    yield running
    running.stop()


def _history(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def _rendered(server: RunningServer, loaded: LoadedModel, arguments: Any) -> str:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions/render",
        json={"model": "m", "messages": _history(arguments)},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return str(loaded.tokenizer.decode(response.json()["token_ids"]))


@pytest.mark.parametrize("arguments", ["{bad", '{"city": ', "[1, 2]", "0", "Paris"])
def test_arguments_that_are_not_a_json_object_render_as_the_string(
    qwen_template_server: RunningServer, embedded_model: LoadedModel, arguments: str
) -> None:
    prompt = _rendered(qwen_template_server, embedded_model, arguments)
    # The template closes its own object after the arguments: `... "arguments": ARGS}`.
    assert f'{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in prompt


def test_json_object_text_still_renders_as_an_object(
    qwen_template_server: RunningServer, embedded_model: LoadedModel
) -> None:
    # Spaced and keyed differently from `tojson`'s output: the template re-serialised it.
    prompt = _rendered(qwen_template_server, embedded_model, '{ "city" :"Paris" }')
    assert '"arguments": {"city": "Paris"}}\n</tool_call>' in prompt


def test_a_turn_after_non_json_arguments_is_answered(qwen_template_server: RunningServer) -> None:
    response = httpx.post(
        f"{qwen_template_server.base_url}/v1/chat/completions",
        json={"model": "m", "messages": _history("{bad"), "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] > 0
