"""`GET /v1/status` (what the engine is doing now, and every configured model's state) and
`GET /metrics` (Prometheus text). Neither loads a model nor resets its idle timer."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from compat_serve.engine.metrics import CONTENT_TYPE
from compat_serve.models.weight_report import weights_status
from compat_serve.registry.hub import ModelHub
from compat_serve.registry.metrics import merge_expositions
from compat_serve.server.generation import model_hub
from compat_serve.server.state import ServerState

router = APIRouter()


def models_status(hub: ModelHub[ServerState]) -> list[dict[str, Any]]:
    now = time.monotonic()
    return [
        {
            "id": slot.entry.id,
            "kind": slot.kind,
            "state": slot.status,
            "default": slot.entry is hub.registry.default,
            "aliases": list(slot.entry.aliases),
            "resident_bytes": slot.resident_bytes,
            "idle_s": round(now - slot.last_used, 3) if slot.state is not None else None,
            "ttl_s": slot.ttl_s,
            "pinned": slot.pinned,
            "in_flight": slot.in_flight,
            "failure": slot.failure,
            # The weight plan the resident model runs (models/weight_report.py).
            "weights": weights_status(slot.chat_state.engine.model) if slot.chat_state else None,
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
    rows = []
    for slot in hub.resident() if len(hub.slots) > 1 else [hub.slots[hub.registry.default.id]]:
        chat = slot.chat_state
        if chat is None:
            continue
        # Token counts and decode rate come from the metrics registry, which counts every
        # token; the status board holds phase, prompt size and TTFT.
        progress = chat.engine.metrics.progress()
        for row in chat.engine.status.snapshot():
            row.update(progress.get(row["request_id"], {}))
            if len(hub.slots) > 1:
                row["model"] = slot.entry.id
            rows.append(row)
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
        "weights": weights_status(engine.model),
        "context_length": state.context_length,
        "speculation": engine.speculation_status(),
        "cache_pins": engine.cache_pins_status(),
        "sampling_defaults": state.sampling_defaults.as_dict(),
        "requests": rows,
        **models,
    } | (
        {"distributed": engine.distributed_status()}
        if engine.distributed_status is not None
        else {}
    )


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """The engines' series and the hub's per-model series. With several models configured,
    every resident model's engine series, each sample labelled `model="<id>"`."""
    hub = model_hub(request)
    if len(hub.slots) == 1:  # single-model mode: the engine's series as they always were
        state = hub.front_state()
        engines = state.engine.metrics.render() if state is not None else ""
    else:
        engines = merge_expositions(
            [
                (slot.entry.id, slot.chat_state.engine.metrics.render())
                for slot in hub.resident()
                if slot.chat_state is not None
            ]
        )
    return PlainTextResponse(engines + hub.metrics.render(), media_type=CONTENT_TYPE)
