"""Quantized KV and the memory guard over HTTP, with the bodies clients send:
`--kv-memory 24MiB --context-length auto --kv-bits 8` serves and reports a window the
budget holds, a longer prompt gets each API's own error at once, the KV format shows on
/v1/status and /metrics, a session's cached reads agree with and without `--kv-bits 8`,
and 64 concurrent clients under a small budget all get an answer."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import RunningServer, start_server
from tests.http.responses_helpers import stream_events
from tests.platform_gates import needs_proc_rss
from tests.tiny_models import tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TOO_LONG = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")


@pytest.fixture(scope="module")
def auto_eight_bit(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(
        embedded_model, kv_memory="24MiB", context_length="auto", kv_bits=8, max_output_tokens=8
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tiny64(embedded_model: LoadedModel) -> LoadedModel:
    """A tiny random llama whose head dim (64) quantized KV groups divide."""
    return tiny_model(
        "llama",
        embedded_model,
        overrides={"hidden_size": 128, "num_attention_heads": 2, "head_dim": 64},
    )


def anthropic_body(text: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": text}],
    }


def openai_body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def test_auto_window_is_reported_and_longer_prompts_are_refused_at_once(
    auto_eight_bit: RunningServer,
) -> None:
    base = auto_eight_bit.base_url
    window = httpx.get(f"{base}/v1/models").json()["data"][0]["context_length"]
    engine = auto_eight_bit.state.engine  # type: ignore[attr-defined]
    assert window == engine.model.context_length < 2000
    assert window == 24 * 2**20 // engine.kv_format_status()["bytes_per_token"]
    assert httpx.get(f"{base}/props").json()["default_generation_settings"]["n_ctx"] == window
    status = httpx.get(f"{base}/v1/status").json()
    assert status["kv_cache"]["format"] == "q8g64" and status["context_length"] == window
    metrics = httpx.get(f"{base}/metrics").text
    assert 'compat_kv_cache_format_info{format="q8g64",bits="8",group_size="64"} 1' in metrics
    # While a request is generating, each API refuses a prompt past the window.
    busy = threading.Thread(
        target=httpx.post,
        args=(f"{base}/v1/messages",),
        kwargs={"json": anthropic_body("Tell me a long story about a fox."), "timeout": 120},
    )
    busy.start()
    long_text = "word " * 2500
    started = time.monotonic()
    anthropic = httpx.post(f"{base}/v1/messages", json=anthropic_body(long_text), timeout=30)
    anthropic_s = time.monotonic() - started
    assert anthropic.status_code == 400
    error = anthropic.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    match = TOO_LONG.match(error["error"]["message"])
    assert match is not None, error
    assert int(match.group(1)) > int(match.group(2)) and int(match.group(2)) < window
    started = time.monotonic()
    chat = httpx.post(f"{base}/v1/chat/completions", json=openai_body(long_text), timeout=30)
    openai_s = time.monotonic() - started
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    events = stream_events(base, {"model": "m", "input": long_text, "stream": True})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"
    busy.join(120)
    # Refused at admission, never queued behind the running request's steps.
    assert anthropic_s < 0.5 and openai_s < 0.5, (anthropic_s, openai_s)
    assert httpx.get(f"{base}/health").status_code == 200


def session_usage(base: str) -> list[dict[str, Any]]:
    """Two turns of one conversation (the reply of turn 1 fixed, as a client echoes it)."""
    first = " ".join(f"Note {i}: the lamp in room {i} is blue." for i in range(12))
    turns = [
        [{"role": "user", "content": first}],
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "Noted: every lamp is blue."},
            {"role": "user", "content": "Which room has the lamp?"},
        ],
    ]
    usages = []
    for messages in [*turns, turns[1]]:
        body = {"model": "m", "max_tokens": 1024, "messages": messages}
        reply = httpx.post(f"{base}/v1/messages", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        usages.append({k: usage[k] for k in ("input_tokens", "cache_read_input_tokens")})
    return usages


def test_a_session_reads_the_same_from_cache_with_and_without_eight_bit_kv(
    tiny64: LoadedModel,
) -> None:
    results = []
    for bits in (None, 8):
        running = start_server(tiny64, kv_bits=bits, max_output_tokens=4, block_size=16)
        try:
            results.append(session_usage(running.base_url))
        finally:
            running.stop()
    assert results[0] == results[1]
    assert results[1][2]["cache_read_input_tokens"] > 0


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@needs_proc_rss
def test_sixty_four_clients_under_a_small_budget(tiny64: LoadedModel) -> None:
    kv_memory = 576 * 512  # 512 tokens of this model's 8-bit K/V
    running = start_server(
        tiny64,
        kv_bits=8,
        kv_memory=str(kv_memory),
        cache_memory="2MiB",
        context_length="auto",
        max_output_tokens=16,
    )
    base = running.base_url
    engine = running.state.engine  # type: ignore[attr-defined]
    window = engine.model.context_length
    assert window == 512
    before = rss_bytes()

    async def client(i: int, http: httpx.AsyncClient) -> tuple[int, Any]:
        text = " ".join(f"item {i}.{j}" for j in range(20 + (i * 37) % 400))
        if i % 2:
            reply = await http.post(f"{base}/v1/messages", json=anthropic_body(text))
            body = reply.json()
            if reply.status_code == 400:
                assert body["error"]["type"] == "invalid_request_error"
                assert TOO_LONG.match(body["error"]["message"])
        else:
            reply = await http.post(f"{base}/v1/chat/completions", json=openai_body(text))
            body = reply.json()
            if reply.status_code == 400:
                assert body["error"]["code"] == "context_length_exceeded"
        return reply.status_code, body

    async def go() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(timeout=240) as http:
            return list(await asyncio.gather(*(client(i, http) for i in range(64))))

    try:
        answers = asyncio.run(go())
        statuses = [status for status, _ in answers]
        assert set(statuses) <= {200, 400}, statuses
        assert 200 in statuses and 400 in statuses
        # Everything released (the engine thread frees a request's KV just after its last
        # event, so the last answers can arrive a moment before).
        deadline = time.monotonic() + 10
        while engine.metrics.kv_tokens_reserved.value() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.metrics.kv_tokens_reserved.value() == 0
        grown = rss_bytes() - before
        assert grown < kv_memory + 2 * 2**20 + engine.memory.headroom, grown
        after = httpx.post(f"{base}/v1/messages", json=anthropic_body("Hi"), timeout=60)
        assert after.status_code == 200
    finally:
        running.stop()
