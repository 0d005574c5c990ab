"""Every bad Anthropic request gets a 4xx in Anthropic's envelope; the server keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

HEADERS = {"anthropic-version": "2023-06-01"}
HI = [{"role": "user", "content": "hi"}]
OK = {"model": "claude-x", "max_tokens": 2, "messages": HI}


def post(
    server: RunningServer, body: Any = None, *, path: str = "/v1/messages", **kw: Any
) -> httpx.Response:
    if body is not None:
        kw["json"] = body
    return httpx.post(
        f"{server.base_url}{path}", headers={**HEADERS, **kw.pop("headers", {})}, timeout=60, **kw
    )


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, *needles: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert body["request_id"] == response.headers["request-id"]
    assert body["request_id"].startswith("req_")
    message: str = body["error"]["message"]
    for needle in needles:
        assert needle in message, message
    return message


BAD_BODIES: list[tuple[str, dict[str, Any], str]] = [
    ("missing model", {"max_tokens": 2, "messages": HI}, "model"),
    ("missing max_tokens", {"model": "m", "messages": HI}, "max_tokens"),
    ("missing messages", {"model": "m", "max_tokens": 2}, "messages"),
    ("max_tokens wrong type", {**OK, "max_tokens": "many"}, "max_tokens"),
    ("negative max_tokens", {**OK, "max_tokens": -5}, "max_tokens"),
    ("temperature out of range", {**OK, "temperature": 1.5}, "temperature"),
    ("messages not a list", {**OK, "messages": "hi"}, "messages"),
    ("empty messages", {**OK, "messages": []}, "messages"),
    ("bad role", {**OK, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    (
        "thinking budget too small",
        {**OK, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 10}},
        "budget_tokens",
    ),
    (
        "thinking budget not below max_tokens",
        {**OK, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 4096}},
        "budget_tokens",
    ),
    (
        "unknown block type",
        {**OK, "messages": [{"role": "user", "content": [{"type": "hologram", "x": 1}]}]},
        "hologram",
    ),
    (
        "image for a text-only model",
        {**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
        "text-only",
    ),
    (
        "tool_use without input",
        {**OK, "messages": [*HI, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f"}]}]},
        "input",
    ),
    (
        "prefill ending in whitespace",
        {**OK, "messages": [*HI, {"role": "assistant", "content": "Sure "}]},
        "trailing whitespace",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "needle"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_are_400(
    server: RunningServer, name: str, body: dict[str, Any], needle: str
) -> None:
    assert_anthropic_error(post(server, body), 400, "invalid_request_error", needle)


def test_an_empty_prefill_alone_is_accepted_on_both_routes(server: RunningServer) -> None:
    # Anthropic allows an empty final assistant message ("all messages must have non-empty
    # content except for the optional final assistant message"); an empty prefill is no
    # prefill, so alone (or beside empty system text) the conversation is empty and the
    # model answers from the template's own start, on both routes alike.
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    for name in ("MessagesRequest", "CountTokensRequest"):
        messages = document["components"]["schemas"][name]["properties"]["messages"]
        assert "It may be empty, as Anthropic allows" in messages["description"]
    bodies = (
        {**OK, "messages": [{"role": "assistant", "content": ""}]},
        {**OK, "system": "", "messages": [{"role": "system", "content": ""},
                                          {"role": "assistant", "content": []}]},
    )  # fmt: skip
    counts = set()
    for body in bodies:
        counted = post(server, body, path="/v1/messages/count_tokens")
        assert counted.status_code == 200, counted.text
        counts.add(counted.json()["input_tokens"])
        answered = post(server, body)
        assert answered.status_code == 200, answered.text
        usage = answered.json()["usage"]
        prompt = (
            usage["input_tokens"]
            + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"]
        )
        assert prompt == counted.json()["input_tokens"]
    # Both bodies are the same empty conversation: the same prompt, one of a few tokens
    # (the template's generation prompt), never an empty one.
    assert len(counts) == 1 and 0 < counts.pop() < 16


def test_bad_json(server: RunningServer) -> None:
    response = post(server, content=b'{"model": ', headers={"content-type": "application/json"})
    assert_anthropic_error(response, 400, "invalid_request_error", "JSON")


def test_count_tokens_errors(server: RunningServer) -> None:
    response = post(server, {"model": "m"}, path="/v1/messages/count_tokens")
    assert_anthropic_error(response, 400, "invalid_request_error", "messages")


def test_prompt_too_long_has_claude_code_wording(server: RunningServer) -> None:
    huge = [{"role": "user", "content": "word " * 9000}]
    message = assert_anthropic_error(
        post(server, {**OK, "messages": huge}), 400, "invalid_request_error"
    )
    assert message.startswith("prompt is too long: ")
    n, rest = message.removeprefix("prompt is too long: ").split(" tokens > ")
    assert int(n) > 8192 and rest == "8191 maximum"


def test_unknown_path_is_not_found_error(server: RunningServer) -> None:
    response = post(server, {}, path="/v1/messages/batches/nope")
    assert_anthropic_error(response, 404, "not_found_error")


def test_sdk_raises_typed_errors(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=2, messages=[])
    assert info.value.status_code == 400


@pytest.fixture(scope="module")
def strict_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(
        embedded_model, api_key="sekret", max_request_bytes=64 * 1024, max_queue=1
    )
    yield running
    running.stop()


def test_wrong_or_missing_key_is_401(strict_server: RunningServer) -> None:
    assert_anthropic_error(post(strict_server, OK), 401, "authentication_error", "missing")
    wrong = post(strict_server, OK, headers={"x-api-key": "nope"})
    assert_anthropic_error(wrong, 401, "authentication_error", "invalid")
    bearer = post(strict_server, OK, headers={"authorization": "Bearer sekret"})
    assert bearer.status_code == 200, bearer.text


def test_oversized_body_is_413(strict_server: RunningServer) -> None:
    big = {**OK, "messages": [{"role": "user", "content": "x" * 100_000}]}
    response = post(strict_server, big, headers={"x-api-key": "sekret"})
    assert_anthropic_error(response, 413, "request_too_large", "limit")


def test_full_queue_is_529_with_retry_after(strict_server: RunningServer) -> None:
    key = {"x-api-key": "sekret"}
    busy = {"model": "m", "messages": HI, "max_tokens": 400, "ignore_eos": True}
    holder = threading.Thread(
        target=lambda: httpx.post(
            f"{strict_server.base_url}/v1/chat/completions", json=busy, headers=key, timeout=120
        )
    )
    holder.start()
    engine = strict_server.state.engine  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while not engine.status.snapshot() and time.monotonic() < deadline:
        time.sleep(0.02)
    response = post(strict_server, OK, headers=key)
    assert_anthropic_error(response, 529, "overloaded_error", "overloaded")
    assert response.headers["retry-after"].isdigit()
    engine.abort(engine.status.snapshot()[0]["request_id"])
    holder.join(60)


def test_server_keeps_serving_after_errors(server: RunningServer) -> None:
    for _name, body, _needle in BAD_BODIES[:5]:
        post(server, body)
    response = post(server, OK)
    assert response.status_code == 200
    assert response.json()["type"] == "message"
