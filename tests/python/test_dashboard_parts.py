"""The dashboard's parts without a server: the log ring, the KV format read from real
mlx-lm caches, client labels from headers, and the status board's finished requests."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from starlette.requests import Request

from compat_serve.engine.kv_format import describe_kv_cache
from compat_serve.engine.status import MAX_CLIENTS, RequestStatus, StatusBoard
from compat_serve.server.clients import client_label
from compat_serve.server.dashboard.log_ring import MAX_MESSAGE_CHARS, LogRing
from compat_serve.server.dashboard.routes import QuietPolling
from tests.tiny_models import tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def ring_logger(ring: LogRing, name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(ring)
    return logger


def test_log_ring_pages_forward_and_drops_the_oldest() -> None:
    ring = LogRing(capacity=3)
    logger = ring_logger(ring, "compat_serve.test_ring")
    for i in range(5):
        logger.info("line %d", i)
    lines = ring.lines()
    assert [line["message"] for line in lines] == ["line 2", "line 3", "line 4"]
    assert [line["seq"] for line in lines] == [3, 4, 5]
    assert {line["level"] for line in lines} == {"INFO"}
    assert {line["logger"] for line in lines} == {"compat_serve.test_ring"}
    assert [line["message"] for line in ring.lines(after=4)] == ["line 4"]
    assert ring.lines(after=5) == []
    assert [line["message"] for line in ring.lines(limit=1)] == ["line 4"]
    logger.removeHandler(ring)


def test_log_ring_keeps_tracebacks_cut_and_survives_bad_formats() -> None:
    ring = LogRing()
    logger = ring_logger(ring, "compat_serve.test_ring_errors")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("the step failed")
    logger.warning("x" * (MAX_MESSAGE_CHARS + 50))
    logger.error("%d tokens", "not a number")  # a bad format string: the raw message
    failed, long, bad = ring.lines()
    assert failed["message"].startswith("the step failed\nTraceback")
    assert "ValueError: boom" in failed["message"] and failed["level"] == "ERROR"
    assert len(long["message"]) == MAX_MESSAGE_CHARS
    assert bad["message"] == "%d tokens"
    logger.removeHandler(ring)


@pytest.fixture(scope="module")
def tiny_llama(embedded_model: LoadedModel) -> LoadedModel:
    return tiny_model("llama", embedded_model)


def filled_cache(loaded: LoadedModel) -> list[object]:
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([[1, 2, 3]], dtype=mx.uint32), cache=cache)
    mx.eval(logits)
    return cache


def test_kv_format_of_plain_quantized_and_sliding_caches(
    tiny_llama: LoadedModel, embedded_model: LoadedModel
) -> None:
    cache = filled_cache(tiny_llama)
    assert describe_kv_cache(cache) == {"layers": {"KVCache": 2}, "dtype": "float32"}
    # Quantized K/V (the embedded model's heads are wide enough for a 32-wide group).
    embedded_cache = filled_cache(embedded_model)
    layers = len(embedded_cache)
    quantized = [layer.to_quantized(group_size=32, bits=8) for layer in embedded_cache]  # type: ignore[attr-defined]
    assert describe_kv_cache(quantized) == {
        "layers": {"QuantizedKVCache": layers},
        "dtype": "uint32",
        "bits": [8],
    }
    gemma = filled_cache(tiny_model("gemma3_text", embedded_model))
    assert describe_kv_cache(gemma) == {
        "layers": {"KVCache": 1, "RotatingKVCache": 1},
        "dtype": "float32",
    }
    # Before the first forward there is no K/V to read a dtype from.
    empty = make_prompt_cache(tiny_llama.model)
    assert describe_kv_cache(empty) == {"layers": {"KVCache": 2}, "dtype": None}


def request_with(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


@pytest.mark.parametrize(
    ("headers", "label"),
    [
        (
            {
                "user-agent": "claude-cli/2.0.14 (external, cli)",
                "X-Claude-Code-Session-Id": "2fa7b109-13cc-4825-8e11-9db81c282c5f",
            },
            "claude-cli 1c282c5f",
        ),
        (
            {
                "user-agent": "codex_exec/0.163.0 (Debian 12)",
                "session-id": "01a2093b-8fa0-7652-9538-d574a215783e",
            },
            "codex_exec a215783e",
        ),
        ({"user-agent": "opencode/1.18.3 ai-sdk/provider-utils/3.0.0"}, "opencode"),
        ({"user-agent": "Mozilla/5.0 (X11)", "x-client-name": "dashboard"}, "dashboard"),
        # OpenCode 1.18: the session in x-session-affinity and X-Session-Id.
        (
            {
                "user-agent": "opencode/1.18.3",
                "x-session-affinity": "ses_2a41c7e3effeQ8mZpL0xYk3Rt",
                "x-session-id": "ses_2a41c7e3effeQ8mZpL0xYk3Rt",
            },
            "opencode L0xYk3Rt",
        ),
        ({"x-opencode-session": "ses_abcdefghijkl"}, "unknown efghijkl"),
        ({}, "unknown"),
        ({"x-client-name": "a\x1bb" + "c" * 100}, "ab" + "c" * 38),
    ],
)
def test_client_labels_from_headers(headers: dict[str, str], label: str) -> None:
    assert client_label(request_with(headers)) == label


def test_status_board_moves_finished_requests_and_counts_reads_per_client() -> None:
    board = StatusBoard()
    for i in range(MAX_CLIENTS + 1):
        board.put(RequestStatus(f"r{i}", "queued", 100, client=f"c{i}", submitted_at=1.0))
        board.update(f"r{i}", cached_tokens=64, ttft_s=0.5)
        board.finish(f"r{i}", "stop_token", 7, 12.5, now=3.0)
    board.put(RequestStatus("again", "queued", 40, client=f"c{MAX_CLIENTS}", submitted_at=5.0))
    board.finish("again", "length", 3, None, now=5.5)
    board.finish("never-started", "aborted", 0, None)  # unknown ids are ignored
    assert board.snapshot() == []
    recent = board.recent()
    assert [row["request_id"] for row in recent][-2:] == [f"r{MAX_CLIENTS}", "again"]
    last = recent[-1]
    assert last["outcome"] == "length" and last["phase"] == "finished"
    assert last["generated_tokens"] == 3 and last["duration_s"] == 0.5
    assert recent[0]["cached_tokens"] == 64 and recent[0]["decode_tokens_per_s"] == 12.5
    clients = board.clients()
    assert len(clients) == MAX_CLIENTS and "c0" not in {c["client"] for c in clients}
    assert clients[0] == {
        "client": f"c{MAX_CLIENTS}",
        "requests": 2,
        "prompt_tokens": 140,
        "cached_tokens": 64,
        "generated_tokens": 10,
    }


@pytest.mark.parametrize(
    ("path", "status", "kept"),
    [
        ("/v1/dashboard", 200, False),
        ("/v1/logs?after=12", 200, False),
        ("/v1/dashboard", 401, True),
        ("/dashboard", 200, True),
        ("/v1/chat/completions", 200, True),
    ],
)
def test_successful_polls_leave_the_access_log(path: str, status: int, kept: bool) -> None:
    # The record uvicorn's access logger writes (uvicorn/protocols/http/*_impl.py).
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:50000", "GET", path, "1.1", status),
        None,
    )
    assert QuietPolling().filter(record) is kept
