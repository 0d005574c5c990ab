"""Every Claude Code capture session replayed twice through /v1/messages (#25 item 4).

The served prompt is a pure function of the request and the configuration, so:
- every response's `input + cache_read + cache_creation` equals `count_tokens` for the
  same body, asked after the response (when the server has generated more replies);
- every request of the second pass, a byte-identical repeat, reads all of its prompt but
  the one token whose logits must be computed from the cache.

Both with the default `--reply-history loop` and with `template` (no generated ids ever
stand in for the tokenizer's). The server runs the tiny llama (the embedded tokenizer and
template, tools told in the system prompt as for the embedded model; random replies, cut
at a few tokens, are the short envelope replies that used to change later prompts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server
from tests.http.test_claude_code_replay import (
    CAPTURES,
    DROP_HEADERS,
    assert_well_formed,
    load,
    parse_sse,
)

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# Every capture fits but two of the auto-compaction session's (~9.3k and ~10.7k tokens
# with the embedded tokenizer): those get the `prompt is too long` 400 Claude Code
# compacts on.
CONTEXT = 8192


@pytest.fixture(scope="module", params=["loop", "template"])
def replay_server(
    request: pytest.FixtureRequest, tiny_llama_model: LoadedModel
) -> Iterator[RunningServer]:
    running = start_server(
        tiny_llama_model,
        context_length=CONTEXT,
        # Replies long enough to be remembered for an echo (16+ characters).
        max_output_tokens=16,
        reply_history=request.param,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module's requests: each `httpx.post` builds a client, and with
    it an SSL context from certifi's bundle (~40 ms of CPU), hundreds of times here."""
    with httpx.Client(timeout=300) as client:
        yield client


def _post(
    http: httpx.Client, server: RunningServer, captured: dict[str, Any], path: str | None = None
) -> httpx.Response:
    headers = {k: v for k, v in captured["headers"].items() if k.lower() not in DROP_HEADERS}
    query = "&".join(f"{k}={v}" for k, vs in (captured.get("query") or {}).items() for v in vs)
    url = f"{server.base_url}{path or captured['path']}" + (f"?{query}" if query else "")
    return http.post(url, content=captured["raw_body"].encode(), headers=headers)


def _count_tokens(http: httpx.Client, server: RunningServer, captured: dict[str, Any]) -> int:
    response = _post(http, server, captured, "/v1/messages/count_tokens")
    assert response.status_code == 200, response.text[:300]
    count: int = response.json()["input_tokens"]
    return count


def _replay(
    http: httpx.Client, server: RunningServer, captured: dict[str, Any]
) -> tuple[int, dict[str, int]] | None:
    """(count_tokens, usage) of one request; None for the 400 that a too-long prompt gets."""
    response = _post(http, server, captured)
    counted = _count_tokens(http, server, captured)
    if counted > CONTEXT - 1:
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["message"] == (
            f"prompt is too long: {counted} tokens > {CONTEXT - 1} maximum"
        )
        return None
    assert response.status_code == 200, response.text[:300]
    events = parse_sse(response.text)
    assert_well_formed(events, counted)
    start = events[0][1]["message"]["usage"]
    delta = next(data for name, data in events if name == "message_delta")["usage"]
    return counted, {**start, **delta}


@pytest.mark.parametrize("capture", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_each_session_twice(http: httpx.Client, replay_server: RunningServer, capture: Any) -> None:
    requests = [r for r in load(capture) if r["path"] == "/v1/messages"]
    assert requests
    for captured in requests:
        _replay(http, replay_server, captured)  # pass 1: the usage checks are in _replay
    for i, captured in enumerate(requests):
        replayed = _replay(http, replay_server, captured)
        if replayed is None:
            continue
        counted, usage = replayed
        read = usage["cache_read_input_tokens"]
        assert read >= counted - 1, f"{capture.stem}[{i}]: repeat read {read} of {counted}"


def test_count_tokens_follows_max_tool_rounds(
    http: httpx.Client, tiny_llama_model: LoadedModel
) -> None:
    """Past `--max-tool-rounds` a request is served without tools: count_tokens counts
    that prompt too, not the one with the tools told."""
    from tests.shared_data import shared_dir

    running = start_server(
        tiny_llama_model, context_length=CONTEXT, max_output_tokens=6, max_tool_rounds=1
    )
    try:
        first, second = load(shared_dir() / "claude_code" / "tool_default.jsonl")
        with_tools = _replay(http, running, first)
        without_tools = _replay(http, running, second)  # it carries one tool round
        assert with_tools is not None and without_tools is not None
        # Served without the tools' text: shorter than the first turn it extends.
        assert without_tools[0] < with_tools[0]
    finally:
        running.stop()
