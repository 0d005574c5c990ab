"""Replay the multi-turn recipe_final Claude Code session through /v1/messages with the
prefix cache: every turn reads from cache all it shares with earlier turns (whole blocks
and the partial block after them), an exact repeat of each turn reads all but one token,
and the usage invariant holds on every response.

The accounting does not depend on what the model says, so the server runs the tiny llama
(the embedded tokenizer and template, a fraction of the prefill compute): the session's
~3.7k prompt tokens cost seconds instead of most of a minute."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.server.anthropic.adapter import to_chat_request
from compat_serve.server.anthropic.protocol import MessagesRequest
from tests.conftest import start_server
from tests.http.test_claude_code_replay import DROP_HEADERS, load, parse_sse
from tests.shared_data import shared_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

BLOCK = 16


@pytest.fixture(scope="module")
def cache_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(
        tiny_llama_model, context_length=4096, max_output_tokens=4, block_size=BLOCK
    )
    yield running
    running.stop()


def shared_prefix(ids: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for other in earlier:
        n = next(
            (i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b),
            min(len(ids), len(other)),
        )
        best = max(best, n)
    return best


def test_recipe_final_reads_everything_it_shares_from_the_cache(
    cache_server: RunningServer,
) -> None:
    builder = cache_server.state.prompt_builder  # type: ignore[attr-defined]
    turns = load(shared_dir() / "claude_code" / "recipe_final.jsonl")
    seen: list[list[int]] = []
    report = []
    for i, captured in enumerate(turns):
        chat = to_chat_request(
            MessagesRequest.model_validate(captured["body"]), default_max_tokens=1
        )
        ids = list(builder.build(chat).token_ids)
        headers = {k: v for k, v in captured["headers"].items() if k.lower() not in DROP_HEADERS}
        response = httpx.post(
            f"{cache_server.base_url}/v1/messages",
            content=captured["raw_body"].encode(),
            headers=headers,
            timeout=600,
        )
        assert response.status_code == 200, response.text[:300]
        events = parse_sse(response.text)
        start = events[0][1]["message"]["usage"]
        usage: dict[str, Any] = {
            **start,
            **next(d for n, d in events if n == "message_delta")["usage"],
        }
        read, made = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
        assert usage["input_tokens"] + read + made == len(ids)
        shared = shared_prefix(ids, seen)
        # Everything shared with an earlier turn is served (one token is always computed).
        assert read >= min(shared, len(ids) - 1), (
            i,
            read,
            shared,
        )
        report.append((i, len(ids), shared, read, made, usage["input_tokens"]))
        seen.append(ids)
    print("\nturn | prompt | shared with earlier | cache read | created | uncached")
    for row in report:
        print(" | ".join(str(v) for v in row), f"({row[3] / row[1]:.0%} read)")
    # The session's continuing turn (same conversation, one more exchange) is ≥ 90% cached.
    continuing = [r for r in report if r[2] >= 0.9 * r[1]]
    assert continuing and all(r[3] >= 0.9 * r[1] for r in continuing)
    # An exact repeat of any finished request reads all of it but the token it computes,
    # including the prompt's partial last block (in a tail or in a block its reply filled).
    repeats = []
    for captured, ids in zip(turns, seen, strict=True):
        headers = {k: v for k, v in captured["headers"].items() if k.lower() not in DROP_HEADERS}
        response = httpx.post(
            f"{cache_server.base_url}/v1/messages",
            content=captured["raw_body"].encode(),
            headers=headers,
            timeout=600,
        )
        assert response.status_code == 200, response.text[:300]
        delta = next(d for n, d in parse_sse(response.text) if n == "message_delta")["usage"]
        repeats.append((len(ids), delta["cache_read_input_tokens"]))
    print("exact repeats (prompt, read):", repeats)
    assert all(read == n - 1 for n, read in repeats)


def test_count_tokens_matches_usage(cache_server: RunningServer) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
    counted = httpx.post(f"{cache_server.base_url}/v1/messages/count_tokens", json=body, timeout=60)
    reply = httpx.post(f"{cache_server.base_url}/v1/messages", json=body, timeout=60)
    usage = reply.json()["usage"]
    total = (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )
    assert counted.json()["input_tokens"] == total
