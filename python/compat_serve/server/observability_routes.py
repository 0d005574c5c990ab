"""`GET /v1/status` (what the engine is doing now, and every configured model's state) and
`GET /metrics` (Prometheus text). Neither loads a model nor resets its idle timer."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from compat_serve.engine.metrics import CONTENT_TYPE
from compat_serve.registry.hub import ModelHub
from compat_serve.server.generation import model_hub

router = APIRouter()


def models_status(hub: ModelHub) -> list[dict[str, Any]]:
    now = time.monotonic()
    return [
        {
            "id": slot.entry.id,
            "state": slot.status,
            "default": slot.entry is hub.registry.default,
            "aliases": list(slot.entry.aliases),
            "resident_bytes": slot.resident_bytes,
            "idle_s": round(now - slot.last_used, 3) if slot.state is not None else None,
            "ttl_s": slot.ttl_s,
            "pinned": slot.pinned,
            "in_flight": slot.in_flight,
            "failure": slot.failure,
        }
        for slot in hub.slots.values()
    ]


@router.get("/v1/status")
async def status(request: Request) -> dict[str, Any]:
    hub = model_hub(request)
    state = hub.front_state()
    models = {
        "models": models_status(hub),
        "memory_budget_bytes": hub.budget_bytes,
        "resident_bytes": hub.resident_total(),
    }
    if state is None:  # several models configured, none resident yet
        return {"model": None, "requests": [], **models}
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
        **models,
    }


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """The front model's engine series (the default model's, else the last used) and the
    hub's per-model series."""
    hub = model_hub(request)
    state = hub.front_state()
    body = (state.engine.metrics.render() if state is not None else "") + hub.metrics.render()
    return PlainTextResponse(body, media_type=CONTENT_TYPE)
