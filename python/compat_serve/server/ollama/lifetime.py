"""Ollama's model lifetime idioms on the hub (registry/hub.py):

- `keep_alive` in a body: seconds or a duration ("5m"); 0 unloads the model as soon as
  the response is over and the model idle (else the hub's TTL reaper does, within a
  second of it going idle), a negative value pins it.
  The hub reads it when the request acquires its model (`model_state`); here it is only
  checked, so a value the hub cannot read is a 400 instead of being ignored.
- A body with no messages (`/api/chat`) or an empty prompt (`/api/generate`) loads the
  model without generating (`done_reason: "load"`); with `keep_alive: 0` it unloads it
  (`done_reason: "unload"`).

A model pinned by the server's configuration (`--model`, `pin: true`) is never
unpinned or unloaded by a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import Request

from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError, parse_lifetime
from compat_serve.server.errors import ApiError
from compat_serve.server.generation import model_error, model_hub, served_model_state
from compat_serve.server.output_format import bad
from compat_serve.server.state import ServerState


def keep_alive_seconds(value: Any) -> float | None:
    """The body's `keep_alive` in seconds (negative: forever), None when absent."""
    if value is None:
        return None
    seconds = None
    if not isinstance(value, bool) and isinstance(value, int | float | str):
        seconds = parse_lifetime({"keep_alive": value})
    if seconds is None:
        raise bad(
            "keep_alive",
            f"expected seconds or a duration such as '5m', '1h', '-1', not {value!r}",
        )
    return seconds


def require_model(name: str) -> None:
    if not name:
        raise ApiError(400, "model is required", param="model")


async def load(request: Request, name: str) -> None:
    """Ollama's preload: a configured model made resident (its lifetime from the body's
    keep_alive). Like an unload, it needs a name that matches a configured model."""
    entry = _configured(request, name)
    await served_model_state(request, entry.id, want=model_hub(request).slots[entry.id].kind)


async def unload(request: Request, name: str) -> None:
    """Unload a configured model now if it is idle; if it is busy, its TTL becomes 0 and
    the hub unloads it once its requests end. A name that matches no configured model is
    a 404 (a control call never falls back to the default model)."""
    hub = model_hub(request)
    entry = _configured(request, name)
    if entry.pin:
        return
    slot = hub.slots[entry.id]
    slot.pinned, slot.ttl_s = False, 0.0
    if slot.status == "loaded" and not slot.busy():
        with contextlib.suppress(ModelRequestError):  # busy again: the reaper's job
            await hub.unload(entry.id, "request", wait_s=0)


def _configured(request: Request, name: str) -> ModelEntry:
    hub = model_hub(request)
    entry = hub.registry.match(name)
    if entry is None:
        raise model_error(
            ModelRequestError(404, f"model '{name}' not found", code="model_not_found")
        )
    return entry


# How long a keep_alive 0 unload waits for the request's own lease to end (the app's
# middleware releases it right after the response).
_RELEASE_WAIT_S = 2.0
_POLL_S = 0.02
_unloads: set[asyncio.Task[None]] = set()


async def unload_when_released(request: Request, name: str) -> None:
    """After a `keep_alive: 0` request's response: unload its model once idle, unless a
    later request gave it another lifetime. Call when the response has been sent."""
    hub = model_hub(request)
    with contextlib.suppress(ModelRequestError):
        task = asyncio.get_running_loop().create_task(_unload_idle(hub, hub.route(name).id))
        _unloads.add(task)
        task.add_done_callback(_unloads.discard)


async def _unload_idle(hub: ModelHub[ServerState], model_id: str) -> None:
    slot = hub.slots[model_id]
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while slot.busy() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    if slot.status == "loaded" and slot.ttl_s == 0 and not slot.pinned and not slot.busy():
        with contextlib.suppress(ModelRequestError):
            await hub.unload(model_id, "ttl", wait_s=0)
