"""Streams under slow prompts and engine faults, for both APIs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# ~200 prompt tokens in 16-token chunks: a dozen prefill steps of the 30-layer model, each
# a step's fixed cost at least, against a ping every 0.2 s.
LONG = [{"role": "user", "content": "word " * 200}]


@pytest.fixture(scope="module")
def slow_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model, prefill_chunk=16)
    running.state.ping_interval_s = 0.2  # type: ignore[attr-defined]
    yield running
    running.stop()


def stream_lines(server: RunningServer, path: str, body: dict[str, Any]) -> list[tuple[float, str]]:
    out = []
    started = time.monotonic()
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                out.append((time.monotonic() - started, line))
    return out


def test_message_start_at_admission_then_pings_during_prefill(slow_server: RunningServer) -> None:
    lines = stream_lines(
        slow_server,
        "/v1/messages",
        {"model": "m", "max_tokens": 2, "stream": True, "messages": LONG},
    )
    events = [(t, line.removeprefix("event: ")) for t, line in lines if line.startswith("event: ")]
    assert events[0][1] == "message_start"
    first_block = next(t for t, name in events if name in ("content_block_start", "message_delta"))
    pings = [t for t, name in events if name == "ping" and t < first_block]
    assert len(pings) >= 2, events
    # message_start arrived well before the prompt was processed.
    assert events[0][0] < pings[0] < first_block


@pytest.fixture
def faulty_runner(slow_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = slow_server.state.engine._runner  # type: ignore[attr-defined]

    def broken(*_args: Any) -> Any:
        raise RuntimeError("injected decode fault")

    monkeypatch.setattr(runner, "decode_logits", broken)


@pytest.mark.usefixtures("faulty_runner")
def test_engine_fault_after_200_is_an_error_event(slow_server: RunningServer) -> None:
    hi = [{"role": "user", "content": "hi"}]
    lines = stream_lines(
        slow_server, "/v1/messages", {"model": "m", "max_tokens": 8, "stream": True, "messages": hi}
    )
    names = [line.removeprefix("event: ") for _, line in lines if line.startswith("event: ")]
    assert names[-1] == "error" and "message_stop" not in names
    error = json.loads(lines[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "injected decode fault" in error["error"]["message"]

    openai = stream_lines(
        slow_server,
        "/v1/chat/completions",
        {"model": "m", "max_tokens": 8, "stream": True, "messages": hi},
    )
    payloads = [line.removeprefix("data: ") for _, line in openai]
    assert payloads[-1] == "[DONE]"
    assert "injected decode fault" in json.loads(payloads[-2])["error"]["message"]


@pytest.mark.usefixtures("faulty_runner")
def test_engine_fault_without_streaming_is_a_500_in_each_shape(slow_server: RunningServer) -> None:
    hi = [{"role": "user", "content": "hi"}]
    anthropic = httpx.post(
        f"{slow_server.base_url}/v1/messages",
        json={"model": "m", "max_tokens": 8, "messages": hi},
        timeout=60,
    )
    assert anthropic.status_code == 500
    assert anthropic.json()["error"]["type"] == "api_error"
    openai = httpx.post(
        f"{slow_server.base_url}/v1/chat/completions",
        json={"model": "m", "max_tokens": 8, "messages": hi},
        timeout=60,
    )
    assert openai.status_code == 500
    assert "injected decode fault" in openai.json()["error"]["message"]
    # The engine survived: a healthy request afterwards is served.
    assert httpx.get(f"{slow_server.base_url}/health", timeout=10).status_code == 200


def test_anthropic_disconnect_during_prefill_aborts(slow_server: RunningServer) -> None:
    engine = slow_server.state.engine  # type: ignore[attr-defined]
    # A prompt no earlier test sent: the prefix cache cannot serve it, so a dozen prefill
    # steps follow message_start (LONG itself may be cached, and a sampled reply to a
    # cached prompt can end before the check below).
    fresh = [{"role": "user", "content": "disconnect " + "word " * 200}]
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": fresh}
    with httpx.stream("POST", f"{slow_server.base_url}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: message_start"):
                break
        live = engine.status.snapshot()
        assert live, "the request should be in the engine"
        assert live[0]["phase"] in ("queued", "prefill"), live
    deadline = time.monotonic() + 10
    while engine.status.snapshot() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.status.snapshot() == []
