"""The dashboard's one JSON document (`GET /v1/dashboard`): the live requests, the last
finished ones, the prefix cache, memory against its budgets, and the served model.

Everything is read from counters the engine already keeps (its status board and metrics
registry, the prefix cache's stats); nothing here waits for the engine thread.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from compat_serve import __version__
from compat_serve.models.device_memory import physical_memory_bytes
from compat_serve.models.weight_report import weights_status
from compat_serve.server.discovery import capabilities

if TYPE_CHECKING:
    from compat_serve.engine.engine import Engine
    from compat_serve.registry.adapters import AdapterEntry
    from compat_serve.server.state import ServerState

# Finished requests sent to the page (the status board keeps more).
RECENT_SHOWN = 60


def _server_state(state: ServerState) -> str:
    if state.draining:
        return "shutting down"
    return "serving" if state.engine.running else "engine stopped"


def _requests(engine: Engine) -> dict[str, Any]:
    rows = engine.status.snapshot()
    progress = engine.metrics.progress()
    for row in rows:
        row.update(progress.get(row["request_id"], {}))
    phases = [row["phase"] for row in rows]
    metrics = engine.metrics
    ttft = metrics.ttft
    return {
        "queued": phases.count("queued"),
        "prefilling": phases.count("prefill"),
        "decoding": phases.count("decode"),
        "decode_batch_size": int(metrics.batch_size.value()),
        "live": rows,
        "recent": engine.status.recent()[-RECENT_SHOWN:],
        # Totals since start, for rates: the page divides their change by the time's.
        "generated_tokens_total": int(metrics.generation_tokens.value()),
        "prompt_tokens_total": int(metrics.prompt_tokens.value()),
        "finished_total": int(metrics.requests.total()),
        "ttft_mean_s": round(ttft.sum / ttft.count, 3) if ttft.count else None,
        "preemptions_total": int(metrics.preemptions.value()),
    }


def _cache(engine: Engine) -> dict[str, Any]:
    prefix = engine.prefix
    if prefix is None:
        return {"enabled": False, "clients": engine.status.clients()}
    values = prefix.metrics()
    block_bytes = max(engine.kv_bytes_per_token, 1) * engine.config.block_size
    return {
        "enabled": True,
        "block_size": engine.config.block_size,
        "block_bytes": block_bytes,
        **values,
        "disk_enabled": prefix.disk is not None,
        "clients": engine.status.clients(),
        # cache_control breakpoints / prompt_cache_retention: tokens, TTL, seconds left.
        "pins": engine.cache_pins_status(),
    }


def _process_rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; None elsewhere).

    macOS has no /proc and the standard library no current-RSS call (getrusage gives the
    peak), so there the dashboard shows the process memory as unknown (docs/platforms.md)."""
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _mlx_memory() -> dict[str, int | None]:
    import mlx.core as mx

    def read(name: str) -> int | None:
        reader = getattr(mx, name, None)
        return int(reader()) if callable(reader) else None

    return {
        "mlx_active_bytes": read("get_active_memory"),
        "mlx_peak_bytes": read("get_peak_memory"),
        "mlx_cache_bytes": read("get_cache_memory"),
    }


def _memory(engine: Engine, cache: dict[str, Any]) -> dict[str, Any]:
    per_token = engine.kv_bytes_per_token
    return {
        "weights_bytes": engine.weights_bytes,
        "kv_in_use_bytes": engine.metrics.kv_bytes_in_use(),
        "kv_reserved_bytes": int(engine.metrics.kv_tokens_reserved.value()) * per_token,
        "kv_budget_bytes": engine.kv_memory_bytes,
        "kv_tokens_reserved": int(engine.metrics.kv_tokens_reserved.value()),
        "kv_tokens_capacity": engine.kv_capacity_tokens,
        "cache_bytes": cache.get("bytes", 0),
        "cache_budget_bytes": engine.cache_memory_bytes if cache["enabled"] else 0,
        "cache_disk_bytes": cache.get("disk_bytes", 0),
        "cache_disk_budget_bytes": cache.get("disk_capacity_bytes", 0),
        **_mlx_memory(),
        "process_rss_bytes": _process_rss_bytes(),
        "physical_bytes": physical_memory_bytes(),
    }


def _model(state: ServerState, adapters: Sequence[AdapterEntry]) -> dict[str, Any]:
    engine = state.engine
    loaded = engine.model
    parsing = (
        state.output_parsing.summary()
        if state.output_parsing is not None
        else {"tool_calls": "none", "reasoning": "none"}
    )
    return {
        "id": state.served_model_name,
        "name": loaded.name,
        "source": loaded.source,
        "architecture": loaded.model_type,
        "dtype": loaded.dtype,
        "weights": weights_status(loaded),
        "state": "loaded" if engine.running else "stopped",
        "context_window": state.context_length,
        "max_prompt_tokens": engine.max_prompt_tokens,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "kv_format": engine.kv_layout,
        "kv_cache": engine.kv_format_status(),
        "capabilities": capabilities(state),
        "output_parsing": parsing,
        "sampling_defaults": state.sampling_defaults.as_dict(),
        "speculation": engine.speculation_status(),
        # LoRA adapters served on it: each a model name of its own.
        "adapters": [
            {"name": a.name, "path": a.path, "aliases": list(a.aliases)} for a in adapters
        ],
    }


def dashboard_snapshot(state: ServerState, adapters: Sequence[AdapterEntry] = ()) -> dict[str, Any]:
    engine = state.engine
    cache = _cache(engine)
    return {
        "server": {
            "version": __version__,
            "state": _server_state(state),
            "uptime_s": round(time.monotonic() - engine.metrics.started_at, 3),
            "time": round(time.time(), 3),
            "api_key_required": state.api_key is not None,
        },
        "models": [_model(state, adapters)],
        "requests": _requests(engine),
        "cache": cache,
        "memory": _memory(engine, cache),
    }
