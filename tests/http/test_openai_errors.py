"""Every bad OpenAI request gets a 4xx in OpenAI's error shape; the server keeps serving."""

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

OK_MESSAGES = [{"role": "user", "content": "hi"}]
SHARED = shared_dir()


def post(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    ("payload", "needle", "param"),
    [
        ({"messages": OK_MESSAGES}, "model", "model"),
        ({"model": "m"}, "messages", "messages"),
        ({"model": "m", "messages": []}, "messages", "messages"),
        (
            {"model": "m", "messages": OK_MESSAGES, "temperature": "hot"},
            "temperature",
            "temperature",
        ),
        ({"model": "m", "messages": OK_MESSAGES, "temperature": 3.5}, "temperature", "temperature"),
        ({"model": "m", "messages": OK_MESSAGES, "max_tokens": -2}, "max_tokens", "max_tokens"),
        ({"model": "m", "messages": OK_MESSAGES, "n": 2}, "n=1", "n"),
        (
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "role",
            "messages[0].role",
        ),
        ({"model": "m", "messages": [{"content": "x"}]}, "role", "messages[0].role"),
        ({"model": "m", "messages": "hello"}, "messages", "messages"),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ],
            },
            "text-only",
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_chat_requests(
    server: RunningServer, payload: dict[str, Any], needle: str, param: str
) -> None:
    error = assert_openai_error(post(server, "/v1/chat/completions", json=payload), 400, needle)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_malformed_json(server: RunningServer) -> None:
    response = post(
        server,
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, "not valid JSON")


def test_a_text_prompt_of_no_tokens_is_the_stated_rule(
    server: RunningServer, embedded_model: LoadedModel
) -> None:
    # Schema-valid (a non-empty string), but this vocabulary has no token for U+0013.
    assert embedded_model.tokenizer.encode("\x13", add_special_tokens=False) == []
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert "text must tokenize to at least one token" in prompt["description"]
    for path in ("/v1/completions", "/v1/completions/render"):
        for body in ({"model": "m", "prompt": "\x13"}, {"model": "m", "prompt": ["\x13\x13"]}):
            error = assert_openai_error(post(server, path, json=body), 400)
            assert error["message"] == (
                "prompt: the text tokenizes to no tokens (this model's vocabulary has none "
                "for its characters)"
            )
            assert error["param"] == "prompt"


def test_the_completion_render_refuses_the_output_constraints_completions_refuses(
    server: RunningServer,
) -> None:
    # schemathesis seed 1 found the render route taking `guided_choice: [null, null]`. The
    # render checks each constraint's shape; compiling one is the engine's (no render).
    bodies = (
        {"guided_choice": [None, None]},
        {"guided_choice": []},
        {"guided_regex": ""},
        {"response_format": {"type": "xml"}},
        {"guided_regex": "a+", "guided_choice": ["a"]},
    )
    for extra in bodies:
        body = {"model": "m", "prompt": "Once upon", **extra}
        for path in ("/v1/completions", "/v1/completions/render"):
            response = post(server, path, json=body)
            assert response.status_code == 400, (path, extra, response.text)
            param = response.json()["error"]["param"]
            assert param.startswith(tuple(extra)), (path, extra, param)
    rendered = post(
        server,
        "/v1/completions/render",
        json={"model": "m", "prompt": "Hi", "guided_choice": ["a"]},
    )
    assert rendered.status_code == 200 and rendered.json()[0]["token_ids"]


def test_prompt_longer_than_context(server: RunningServer) -> None:
    huge = "hello " * 9000
    response = post(
        server,
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": huge}]},
    )
    error = assert_openai_error(response, 400, "8192")
    assert error["code"] == "context_length_exceeded"
    assert any(c.isdigit() for c in error["message"].split("has")[1])


def test_completions_errors(server: RunningServer) -> None:
    assert_openai_error(post(server, "/v1/completions", json={"model": "m"}), 400, "prompt")
    assert_openai_error(
        post(server, "/v1/completions", json={"model": "m", "prompt": ""}), 400, "empty"
    )
    assert_openai_error(
        post(server, "/v1/completions", json={"model": "m", "prompt": [10**9]}), 400, "out of range"
    )
    assert_openai_error(
        post(server, "/v1/completions", json={"model": "m", "prompt": ["a", "b"]}), 400, "single"
    )


def test_unknown_endpoint_and_method(server: RunningServer) -> None:
    assert_openai_error(post(server, "/v1/nope", json={}), 404, "no such endpoint")
    response = httpx.get(f"{server.base_url}/v1/chat/completions", timeout=10)
    assert_openai_error(response, 405, "not allowed")


def test_unknown_fields_are_ignored(server: RunningServer) -> None:
    response = post(
        server,
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi", "weird": 1}],
            "max_tokens": 2,
            "frobnicate": {"x": 1},
            "logit_bias": {"1": 2},
        },
    )
    assert response.status_code == 200, response.text


def test_a_constraint_the_vocabulary_cannot_continue_is_the_request_error(
    server: RunningServer,
) -> None:
    """`guided_regex` needing a character the tokenizer cannot write (it drops \x14): the
    grammar dead-ends after the first character. A 400 in the API's shape, streamed as an
    error event; never a 500 (found by schemathesis)."""
    body = {"model": "m", "messages": OK_MESSAGES, "guided_regex": "\u00e3\u0014"}
    error = assert_openai_error(post(server, "/v1/chat/completions", json=body), 400, "vocabulary")
    assert error["code"] == "invalid_grammar"
    streamed = post(server, "/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200
    assert (
        '"code": "invalid_grammar"' in streamed.text or '"code":"invalid_grammar"' in streamed.text
    )


def test_server_still_serves_after_errors(server: RunningServer) -> None:
    for _ in range(3):
        post(server, "/v1/chat/completions", content=b"nonsense")
    response = post(
        server,
        "/v1/chat/completions",
        json={"model": "m", "messages": OK_MESSAGES, "max_tokens": 2},
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] <= 2


@pytest.fixture(scope="module")
def keyed_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model, api_key="sekret")
    yield running
    running.stop()


def test_api_key_required_when_configured(keyed_server: RunningServer) -> None:
    body = {"model": "m", "messages": OK_MESSAGES, "max_tokens": 1}
    assert_openai_error(post(keyed_server, "/v1/chat/completions", json=body), 401, "missing")
    wrong = post(
        keyed_server, "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"}
    )
    assert_openai_error(wrong, 401, "invalid")
    for headers in ({"authorization": "Bearer sekret"}, {"x-api-key": "sekret"}):
        ok = post(keyed_server, "/v1/chat/completions", json=body, headers=headers)
        assert ok.status_code == 200, ok.text
    assert httpx.get(f"{keyed_server.base_url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def gemma_template_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    template = SHARED / "templates" / "google-gemma-2-2b-it.jinja"
    assert template.is_file(), f"missing shared template {template}"
    running = start_server(embedded_model, chat_template=str(template))
    yield running
    running.stop()


def test_template_exception_is_a_400(gemma_template_server: RunningServer) -> None:
    response = post(
        gemma_template_server,
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "system", "content": "x"}, *OK_MESSAGES]},
    )
    assert_openai_error(response, 400, "System role not supported")
