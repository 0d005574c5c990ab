"""Anthropic response side: message_response and the SSE stream encoder.

The encoder's frames are also replayed through the official `anthropic` SDK (its own SSE
decoder and stream accumulator, over an in-memory transport): the message it rebuilds
must equal `message_response` for the same engine events.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import anthropic
import httpx2
import pytest

from compat_serve.engine.types import EngineEvent, FinishReason, Usage
from compat_serve.server.anthropic.adapter import (
    AnthropicUsage,
    MessageStreamEncoder,
    message_response,
)
from compat_serve.server.errors import ApiError, anthropic_error_body

MODEL = "claude-opus-5-5"
MSG_ID = "msg_0123456789abcdef01234567"


def piece(text: str, *ids: int) -> EngineEvent:
    return EngineEvent("r", text=text, token_ids=ids or (1,))


def final(
    reason: FinishReason = FinishReason.STOP_TOKEN,
    text: str = "",
    *,
    prompt: int = 12,
    completion: int = 3,
    **fields: Any,
) -> EngineEvent:
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion)
    return EngineEvent("r", text=text, token_ids=(9,), finish_reason=reason, usage=usage, **fields)


def encode(
    events: list[EngineEvent], prompt: int = 12, cache_read: int = 0, cache_creation: int = 0
) -> str:
    encoder = MessageStreamEncoder(MSG_ID, MODEL)
    frames = encoder.start(prompt, cache_read, cache_creation) + encoder.ping()
    return frames + "".join(encoder.feed(e) for e in events)


def parse(frames: str) -> list[tuple[str, dict[str, Any]]]:
    assert frames.endswith("\n\n")
    out = []
    for frame in frames[:-2].split("\n\n"):
        name_line, data_line = frame.split("\n")
        name = name_line.removeprefix("event: ")
        payload = json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == name
        out.append((name, payload))
    return out


def names(frames: str) -> list[str]:
    return [name for name, _ in parse(frames) if name != "ping"]


def expected(events: list[EngineEvent]) -> dict[str, Any]:
    last = events[-1]
    assert last.usage is not None
    usage = AnthropicUsage.from_usage(last.usage)
    return message_response(MSG_ID, MODEL, "".join(e.text for e in events), last, usage)


def sdk_client(body: bytes, content_type: str) -> anthropic.Anthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": content_type}, content=body)

    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://compat-serve.invalid",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


def sdk_stream(frames: str) -> dict[str, Any]:
    client = sdk_client(frames.encode(), "text/event-stream")
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[]) as stream:
        message = stream.get_final_message()
    rebuilt: dict[str, Any] = message.to_dict()
    assert rebuilt.pop("stop_details", None) is None  # SDK-only field, never sent
    return rebuilt


def sdk_create(body: dict[str, Any]) -> dict[str, Any]:
    client = sdk_client(json.dumps(body).encode(), "application/json")
    message = client.messages.create(model=MODEL, max_tokens=64, messages=[])
    return message.to_dict()


# ---------------------------------------------------------------- message_response


def test_message_response_shape() -> None:
    events = [piece("Hel"), piece("lo"), final()]
    assert expected(events) == {
        "id": MSG_ID,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello"}],
        "model": MODEL,
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 3,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        },
    }


def test_message_response_empty_text_has_no_block() -> None:
    body = expected([final(FinishReason.LENGTH, completion=0)])
    assert body["content"] == []
    assert body["stop_reason"] == "max_tokens"
    assert "stop_sequence" in body and body["stop_sequence"] is None


@pytest.mark.parametrize(
    ("reason", "stop_reason", "stop_sequence"),
    [
        (FinishReason.STOP_TOKEN, "end_turn", None),
        (FinishReason.STOP_STRING, "stop_sequence", "END"),
        (FinishReason.LENGTH, "max_tokens", None),
        (FinishReason.CONTEXT, "model_context_window_exceeded", None),
    ],
)
def test_stop_reasons(reason: FinishReason, stop_reason: str, stop_sequence: str | None) -> None:
    matched = "END" if reason is FinishReason.STOP_STRING else None
    events = [piece("x"), final(reason, matched_stop=matched)]
    body = expected(events)
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)
    (delta,) = [p for n, p in parse(encode(events)) if n == "message_delta"]
    assert delta["delta"] == {"stop_reason": stop_reason, "stop_sequence": stop_sequence}


def test_usage_invariant_with_cache_fields() -> None:
    usage = AnthropicUsage.from_usage(Usage(100, 5, cached_tokens=60, cache_creation_tokens=10))
    assert usage.to_json() == {
        "input_tokens": 30,
        "output_tokens": 5,
        "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 10,
        "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 0},
    }
    split = Usage(100, 5, cached_tokens=60, cache_creation_tokens=10, cache_creation_1h_tokens=4)
    assert AnthropicUsage.from_usage(split).to_json()["cache_creation"] == {
        "ephemeral_5m_input_tokens": 6,
        "ephemeral_1h_input_tokens": 4,
    }


# ---------------------------------------------------------------- encoder frames


def test_text_stream_sequence() -> None:
    frames = encode([piece("Hel"), piece(""), piece("lo"), final(text="!")])
    assert names(frames) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    events = dict(parse(frames))
    assert events["message_start"]["message"] == {
        "id": MSG_ID,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        },
    }
    assert events["content_block_start"] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [p["delta"] for n, p in parse(frames) if n == "content_block_delta"]
    assert deltas == [{"type": "text_delta", "text": t} for t in ("Hel", "lo", "!")]
    assert events["content_block_stop"] == {"type": "content_block_stop", "index": 0}
    assert events["message_delta"]["usage"]["output_tokens"] == 3
    assert "[DONE]" not in frames


def test_empty_output_has_no_content_block() -> None:
    frames = encode([final(completion=1)])
    assert names(frames) == ["message_start", "message_delta", "message_stop"]


def test_ping_frame() -> None:
    assert MessageStreamEncoder(MSG_ID, MODEL).ping() == 'event: ping\ndata: {"type": "ping"}\n\n'


def test_message_delta_usage_is_cumulative() -> None:
    frames = encode([piece("a"), cached_final(60, 10)], 100, 60, 10)
    events = dict(parse(frames))
    start_usage = events["message_start"]["message"]["usage"]
    assert start_usage == {
        "input_tokens": 30,
        "output_tokens": 0,
        "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 10,
        "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 0},
    }
    assert events["message_delta"]["usage"] == {**start_usage, "output_tokens": 2}


def test_output_tokens_fall_back_to_token_count() -> None:
    last = EngineEvent("r", token_ids=(7,), finish_reason=FinishReason.STOP_TOKEN)
    frames = encode([piece("a", 1, 2), last])
    assert dict(parse(frames))["message_delta"]["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("reason", [FinishReason.ERROR, FinishReason.ABORTED])
def test_engine_failure_is_an_error_event(reason: FinishReason) -> None:
    encoder = MessageStreamEncoder(MSG_ID, MODEL)
    frames = encoder.start(5) + encoder.feed(piece("par"))
    frames += encoder.feed(EngineEvent("r", finish_reason=reason, error="boom"))
    assert names(frames) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    error = parse(frames)[-1][1]
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "generation failed: boom"},
    }
    assert encoder.finished
    assert encoder.feed(final()) == ""


def test_error_method() -> None:
    encoder = MessageStreamEncoder(MSG_ID, MODEL)
    frame = encoder.error("overloaded_error", "queue full")
    assert parse(frame) == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}})
    ]


def test_feed_before_start_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        MessageStreamEncoder(MSG_ID, MODEL).feed(piece("x"))


# ---------------------------------------------------------------- the official SDK agrees

SCENARIOS = {
    "text": [piece("Hello"), piece(", "), piece("wörld 🎉"), final(completion=4)],
    "empty": [final(completion=1)],
    "text_on_final": [final(text="only", completion=1)],
    "stop_sequence": [piece("1 2 3"), final(FinishReason.STOP_STRING, matched_stop="\n\n")],
    "max_tokens": [piece("long"), final(FinishReason.LENGTH, completion=64)],
    "context": [piece("x"), final(FinishReason.CONTEXT)],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sdk_accumulator_rebuilds_message_response(scenario: str) -> None:
    events = SCENARIOS[scenario]
    assert sdk_stream(encode(events)) == expected(events)


def cached_final(read: int, creation: int) -> EngineEvent:
    usage = Usage(100, 2, cached_tokens=read, cache_creation_tokens=creation)
    return dataclasses.replace(final(prompt=100, completion=2), usage=usage)


def test_sdk_accumulator_with_cache_fields() -> None:
    events = [piece("cached"), cached_final(64, 32)]
    rebuilt = sdk_stream(encode(events, 100, cache_read=64, cache_creation=32))
    assert rebuilt == expected(events)
    assert rebuilt["usage"]["cache_read_input_tokens"] == 64
    assert rebuilt["usage"]["input_tokens"] == 4


def test_exact_cache_figures_in_message_delta_replace_the_admission_preview() -> None:
    # Another request stored the same blocks meanwhile: fewer newly written than previewed.
    events = [piece("x"), cached_final(64, 16)]
    frames = parse(encode(events, 100, cache_read=64, cache_creation=32))
    start = frames[0][1]["message"]["usage"]
    delta = next(p for n, p in frames if n == "message_delta")["usage"]
    assert start["cache_creation_input_tokens"] == 32
    assert delta["cache_creation_input_tokens"] == 16 and delta["input_tokens"] == 20
    assert delta["cache_creation"]["ephemeral_5m_input_tokens"] == 16
    rebuilt = sdk_stream(encode(events, 100, cache_read=64, cache_creation=32))
    # The SDK's MessageDeltaUsage has no `cache_creation`: the accumulated message keeps
    # message_start's split (Anthropic's own stream carries it there only).
    assert rebuilt.pop("usage")["cache_creation"]["ephemeral_5m_input_tokens"] == 32
    want = expected(events)
    want.pop("usage")
    assert rebuilt == want


def test_inconsistent_usage_is_refused() -> None:
    with pytest.raises(ValueError, match="inconsistent usage"):
        AnthropicUsage.from_usage(Usage(10, 1, cached_tokens=8, cache_creation_tokens=8))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sdk_parses_message_response(scenario: str) -> None:
    body = expected(SCENARIOS[scenario])
    assert sdk_create(body) == body


def test_sdk_raises_on_error_event() -> None:
    events = [piece("par"), EngineEvent("r", finish_reason=FinishReason.ERROR, error="oom")]
    client = sdk_client(encode(events).encode(), "text/event-stream")
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(model=MODEL, max_tokens=64, messages=[]) as stream,
    ):
        stream.get_final_message()
    assert info.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "generation failed: oom"},
    }


# ---------------------------------------------------------------- error bodies


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_body(status: int, kind: str) -> None:
    body = anthropic_error_body(ApiError(status, "nope", param="x"), "req_123")
    assert body == {
        "type": "error",
        "error": {"type": kind, "message": "nope"},
        "request_id": "req_123",
    }
