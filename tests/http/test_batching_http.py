"""Batching seen from HTTP: a client leaving mid-prefill frees its slot within a chunk
(watched through /v1/status) while other streams keep flowing, and the server serves on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import RunningServer, start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

CHUNK = 64


@pytest.fixture(scope="module")
def chunked_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model, prefill_chunk=CHUNK, max_num_seqs=4)
    yield running
    running.stop()


def status(server: RunningServer) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.base_url}/v1/status", timeout=10).json()
    return body


def row_of(server: RunningServer) -> dict[str, Any] | None:
    rows = [r for r in status(server)["requests"] if r["prompt_tokens"] > 1500]
    return rows[0] if rows else None


def long_prompt_body() -> dict[str, Any]:
    words = " ".join(f"item{i} is listed here." for i in range(400))  # ~2.4k tokens
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"Summarise: {words}"}],
        "max_tokens": 8,
        "stream": True,
    }


def stream_tokens(server: RunningServer, arrivals: list[float], done: threading.Event) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
            if done.is_set():
                return


def test_client_leaving_mid_prefill_frees_its_slot_within_one_chunk(
    chunked_server: RunningServer,
) -> None:
    server = chunked_server
    # A stream already decoding keeps flowing while the long prompt is admitted.
    arrivals: list[float] = []
    done = threading.Event()
    background = threading.Thread(target=stream_tokens, args=(server, arrivals, done))
    background.start()
    try:
        deadline = time.monotonic() + 60
        while len(arrivals) < 3:
            assert time.monotonic() < deadline, "the background stream never started"
            time.sleep(0.05)
        with (
            httpx.Client(timeout=120) as http,
            http.stream(
                "POST", f"{server.base_url}/v1/chat/completions", json=long_prompt_body()
            ) as response,
        ):
            assert response.status_code == 200
            while True:
                row = row_of(server)
                if row is not None and row["computed_tokens"] >= 2 * CHUNK:
                    break
                assert time.monotonic() < deadline, f"prefill never progressed: {row}"
                time.sleep(0.02)
            tokens_before = len(arrivals)
            left_at = row["computed_tokens"]
        # The client is gone: the row must vanish before the prefill moves on by more
        # than the chunk in flight (plus the one that may start as the abort arrives).
        seen = left_at
        while (row := row_of(server)) is not None:
            seen = max(seen, row["computed_tokens"])
            assert time.monotonic() < deadline + 60
            time.sleep(0.01)
        assert seen <= left_at + 2 * CHUNK, (left_at, seen)
        assert seen < 1500
        # The background stream kept producing tokens throughout.
        time.sleep(1.0)
        assert len(arrivals) > tokens_before
    finally:
        done.set()
        background.join(120)
    after = status(server)
    deadline = time.monotonic() + 30
    while after["requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
        after = status(server)
    assert after["requests"] == [] and after["kv_tokens_reserved"] == 0
    assert after["decode_batch_size"] == 0
    # ... and the server serves on.
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
