"""`GET /v1/status` (what the engine is doing now) and `GET /metrics` (Prometheus text)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from compat_serve.engine.metrics import CONTENT_TYPE
from compat_serve.server.generation import server_state

router = APIRouter()


@router.get("/v1/status")
async def status(request: Request) -> dict[str, Any]:
    state = server_state(request)
    engine = state.engine
    rows = engine.status.snapshot()
    # Token counts and decode rate come from the metrics registry, which counts every
    # token; the status board holds phase, prompt size and TTFT.
    progress = engine.metrics.progress()
    for row in rows:
        row.update(progress.get(row["request_id"], {}))
    queued, running = engine.metrics.counts()
    return {
        "model": state.served_model_name,
        "uptime_s": round(time.monotonic() - engine.metrics.started_at, 3),
        "queue_depth": queued,
        "running": running,
        "decode_batch_size": int(engine.metrics.batch_size.value()),
        "kv_tokens_reserved": int(engine.metrics.kv_tokens_reserved.value()),
        "kv_tokens_capacity": engine.kv_capacity_tokens,
        "kv_cache": engine.kv_format_status(),
        "context_length": state.context_length,
        "speculation": engine.speculation_status(),
        "sampling_defaults": state.sampling_defaults.as_dict(),
        "requests": rows,
    } | (
        {"distributed": engine.distributed_status()}
        if engine.distributed_status is not None
        else {}
    )


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    body = server_state(request).engine.metrics.render()
    return PlainTextResponse(body, media_type=CONTENT_TYPE)
