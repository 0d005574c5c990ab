"""Which configured models are resident, and the one place that loads and unloads them.

- A request names a model; `acquire` routes the name (registry/routing.py) and returns
  that model's state, loading it first if it is cold. Concurrent requests for a
  cold model share one load (one task, awaited by all).
- Listing and polling routes read `slots` and never load anything.
- Every size decision (admission, eviction, the never-fits refusal) reads one estimate
  per model: before its first load, the size its loader will make of its files under its
  weight plan (serve_models.estimate_bytes); after a load, the size measured then (a
  warning is logged when the two differ by more than `ESTIMATE_MARGIN`). A load that
  measures more than the whole budget is unloaded at once and refused like one
  estimated too large, so no admitted model exceeds the budget.
- Before a load, room is made under the memory budget: idle models past their TTL go
  first, then the least recently used idle unpinned ones. A model with requests in
  flight is never evicted, so no request is aborted: a request holds a lease on its
  model from routing until its response ends (the app's middleware releases it), and
  the engine's in-flight count covers the rest. A load that finds no room waits up to
  `wait_timeout_s`, then fails overloaded. A model larger than the whole budget fails at
  once, and is remembered.
- A load that fails answers 500 with the loader's message once; later requests get 400
  naming the failure until the model's files change.

The MLX work (building a model's state, releasing its memory) is done by the `load` and
`release` callables the bootstrap passes in; the hub only sequences it. `load_async`,
when given, is awaited instead of running `load` on a worker thread: serve_models passes
one that runs every MLX evaluation of the load on the engine host's thread, in slices
between the resident models' steps (engine/host.py, models/load_steps.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic

from compat_serve.registry.adapters import AdapterEntry
from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.metrics import HubMetrics
from compat_serve.registry.routing import ModelRegistry, Route, UnknownAdapter
from compat_serve.registry.slots import (
    ChatT,
    ModelRequestError,
    ModelSlot,
    add_adapters,
    cannot_reload,
    files_stamp,
    gib,
    parse_lifetime,
    resident_bytes,
)

__all__ = ["ModelHub", "ModelRequestError", "ModelSlot", "parse_lifetime"]

if TYPE_CHECKING:
    from compat_serve.embeddings.state import EmbeddingState

log = logging.getLogger("compat_serve.registry")

_POLL_S = 0.05
# How far a measured size may stray from the estimate before the hub warns about it.
ESTIMATE_MARGIN = 0.10


class ModelHub(Generic[ChatT]):
    def __init__(
        self,
        registry: ModelRegistry,
        load: Callable[[ModelEntry], ChatT | EmbeddingState],
        release: Callable[[ChatT | EmbeddingState], None],
        collect: Callable[[], None],
        estimate: Callable[[ModelEntry], int],
        *,
        api_key: str | None = None,
        max_request_bytes: int = 32 * 1024 * 1024,
        budget_bytes: int | None = None,
        wait_timeout_s: float = 300.0,
        start: Callable[[ChatT | EmbeddingState], None] | None = None,
        load_async: Callable[[ModelEntry], Awaitable[ChatT | EmbeddingState]] | None = None,
    ) -> None:
        self.registry = registry
        self._load_fn, self._release_fn, self._estimate_fn = load, release, estimate
        self._load_async = load_async
        self._collect_fn = collect
        # Starts a model's engine (serve_models: on the one engine host thread).
        self._start_fn = start or (lambda state: state.engine.start())
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.budget_bytes = budget_bytes
        self.wait_timeout_s = wait_timeout_s
        self.slots: dict[str, ModelSlot[ChatT]] = {
            entry.id: ModelSlot(entry, ttl_s=entry.ttl_s, pinned=entry.pin)
            for entry in registry.entries
        }
        self.metrics = HubMetrics(registry.ids)
        self.draining = False
        # Seconds between keep-alive frames of a stream waiting for its model.
        self.keepalive_s = 10.0
        # Models waiting for memory (id -> since when), and how long one waits before
        # new requests for the models in its way hold back (swap thrash).
        self._room_waiters: dict[str, float] = {}
        self.yield_after_s = 1.0
        # Models too large for the budget: id -> the 400's message.
        self._never_fits: dict[str, str] = {}
        self._load_lock: asyncio.Lock | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.engines_started = False

    @classmethod
    def of_one(cls, state: ChatT) -> ModelHub[ChatT]:
        """A hub around an already built state (tests and embedders that build their
        own): single-model mode, the model pinned and never reloaded."""
        entry = ModelEntry(
            state.served_model_name,
            state.engine.model.source,
            pin=True,
            preload=True,
            default=True,
            origin="--model",
        )
        hub = cls(
            ModelRegistry([entry], strict=state.strict_model_names),
            load=cannot_reload,
            release=lambda s: s.engine.shutdown(),
            collect=lambda: None,
            estimate=lambda _: 0,
            api_key=state.api_key,
            max_request_bytes=state.max_request_bytes,
        )
        hub.adopt(entry.id, state)
        return hub

    # ---- resident models -------------------------------------------------------------

    def adopt(
        self, model_id: str, state: ChatT | EmbeddingState, estimate: int | None = None
    ) -> None:
        """Make an already built state resident (preloaded at start, or a test's), with
        the adapters its model serves added to its engine (a bad adapter file raises
        AdapterError, a ValueError: the load fails naming it)."""
        add_adapters(state, self.registry.adapters.of(model_id))
        slot = self.slots[model_id]
        slot.state = state
        slot.loaded_at = slot.last_used = time.monotonic()
        slot.resident_bytes = slot.measured_bytes = resident_bytes(state)
        if estimate and abs(slot.resident_bytes - estimate) > ESTIMATE_MARGIN * estimate:
            log.warning(
                "model %s: estimated %s before loading, measured %s resident (more than "
                "%.0f%% off); the measured size is used from now on",
                model_id,
                gib(estimate),
                gib(slot.resident_bytes),
                ESTIMATE_MARGIN * 100,
            )
        self.metrics.loads.inc(model=model_id)
        self.metrics.set_resident(model_id, slot.resident_bytes)
        if self.engines_started:
            self._start_fn(state)

    def resident(self) -> list[ModelSlot[ChatT]]:
        return [slot for slot in self.slots.values() if slot.status == "loaded"]

    def front_state(self) -> ChatT | None:
        """The default model's state if resident, else the most recently used resident
        one, else None: what single-model routes (/props, /metrics, /v1/status) show.
        Chat models only: an embedding model has no generation settings to show."""
        default = self.slots[self.registry.default.id]
        if default.status == "loaded" and default.chat_state is not None:
            return default.chat_state
        resident = sorted(
            (s for s in self.resident() if s.chat_state is not None),
            key=lambda s: s.last_used,
            reverse=True,
        )
        return resident[0].chat_state if resident else None

    @property
    def in_flight(self) -> int:
        return sum(slot.in_flight for slot in self.slots.values())

    def start(self) -> None:
        """Start every resident engine (the app's lifespan) and the TTL reaper."""
        self.engines_started = True
        for slot in self.resident():
            assert slot.state is not None
            self._start_fn(slot.state)
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def shutdown(self) -> None:
        """Stop every engine (in-flight requests end with FinishReason.SHUTDOWN)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.slots.values():
            if slot.state is not None:
                slot.state.engine.shutdown()

    def set_draining(self) -> None:
        self.draining = True
        for slot in self.slots.values():
            if slot.state is not None:
                slot.state.draining = True

    # ---- requests --------------------------------------------------------------------

    def route(self, name: str | None) -> ModelEntry:
        return self.resolve(name).entry

    def resolve(self, name: str | None) -> Route:
        """The model and adapter a request for `name` is served by; 404 for a name that
        routes nowhere (under --strict-model-names) or to an adapter its base lacks."""
        try:
            routed = self.registry.resolve(name)
        except UnknownAdapter as exc:
            served = ", ".join(repr(a.name) for a in self.registry.adapters.of(exc.base.id))
            raise ModelRequestError(
                404,
                f"model {name!r} not found: {exc} (its adapters: {served or 'none'})",
                code="model_not_found",
            ) from None
        if routed is None:
            raise ModelRequestError(
                404,
                f"model {name!r} not found; this server serves "
                + ", ".join(repr(i) for i in self.registry.ids),
                code="model_not_found",
            )
        return routed

    async def acquire(
        self,
        name: str | None,
        lifetime: Mapping[str, Any] | None = None,
        leases: list[ModelSlot[ChatT]] | None = None,
    ) -> ChatT | EmbeddingState:
        """The state serving a request for `name`, loading its model if it is cold.
        `lifetime`: the body's `keep_alive` (Ollama) or `ttl` (LM Studio), if any.
        `leases`: the request's list; the model stays resident until its owner calls
        `release` on what it holds."""
        state, _ = await self.acquire_route(name, lifetime, leases)
        return state

    async def acquire_route(
        self,
        name: str | None,
        lifetime: Mapping[str, Any] | None = None,
        leases: list[ModelSlot[ChatT]] | None = None,
    ) -> tuple[ChatT | EmbeddingState, AdapterEntry | None]:
        """`acquire`, with the adapter the name picked (None: the base model)."""
        routed = self.resolve(name)
        entry = routed.entry
        keep = parse_lifetime(lifetime) if lifetime else None
        slot = self.slots[entry.id]
        await self._yield_to_waiting_loads(slot)
        if leases is not None:
            slot.leases += 1  # before the load: a load that makes room never evicts it
            leases.append(slot)
        state = await self.ensure_loaded(entry)
        if keep is not None:
            # -1 keeps it resident; a client never unpins a model its config pins.
            slot.pinned = entry.pin or keep < 0
            slot.ttl_s = None if keep < 0 else keep
        return state, routed.adapter

    # ---- adapters loaded at run time -------------------------------------------------

    async def load_adapter(self, base: ModelEntry, adapter: AdapterEntry) -> None:
        """Add an adapter to a model (loading the model first if it is cold): its engine
        reads the files, then requests may name it. 400 for a name already taken or files
        that are no adapter; loading the same name and path again is a no-op."""
        known = self.registry.adapters.get(base.id, adapter.name)
        if known is not None and known.path == adapter.path:
            await self.ensure_loaded(base)
            return
        taken = self.registry.taken(adapter.name)
        if taken is not None:
            raise ModelRequestError(
                400, f"adapter name {adapter.name!r} is already {taken}", code="adapter_exists"
            )
        state = await self.ensure_loaded(base)
        try:
            await asyncio.to_thread(add_adapters, state, [adapter])
        except ValueError as exc:  # AdapterError: files that are no adapter of this model
            raise ModelRequestError(
                400, f"adapter {adapter.name!r}: {exc}", code="adapter_load_failed"
            ) from exc
        self.registry.adapters.add(base.id, adapter)
        log.info("adapter %s loaded on model %s (%s)", adapter.name, base.id, adapter.path)

    async def unload_adapter(self, base: ModelEntry, adapter: AdapterEntry) -> None:
        """Remove an adapter: requests stop routing to it at once; its weights leave the
        engine (if the model is resident) once its requests in flight have finished
        (waiting up to the hub's wait timeout, then 503 and it stays)."""
        self.registry.adapters.remove(base.id, adapter.name)
        deadline = time.monotonic() + self.wait_timeout_s
        while (state := self.slots[base.id].chat_state) is not None:
            try:
                await asyncio.to_thread(state.engine.remove_adapter, adapter.name)
                break
            except KeyError:  # not in the engine (its base reloaded without it)
                break
            except ValueError as exc:  # requests with it still in flight
                if time.monotonic() >= deadline:
                    self.registry.adapters.add(base.id, adapter)
                    raise ModelRequestError(503, str(exc), overloaded=True) from exc
                await asyncio.sleep(_POLL_S)
        log.info("adapter %s unloaded from model %s", adapter.name, base.id)

    async def ensure_loaded(self, entry: ModelEntry) -> ChatT | EmbeddingState:
        slot = self.slots[entry.id]
        while True:
            if slot.state is not None and not slot.unloading:
                slot.last_used = time.monotonic()
                return slot.state
            if slot.unloading:
                await asyncio.sleep(_POLL_S)
                continue
            if slot.loading is None:
                self._check_loadable(slot)
                slot.loading = asyncio.get_running_loop().create_task(self._load(slot))
            # shield: a request that goes away does not cancel the load others await.
            await asyncio.shield(slot.loading)

    async def _yield_to_waiting_loads(self, slot: ModelSlot[ChatT]) -> None:
        """Swap thrash: while another model has waited `yield_after_s` for memory that
        this resident model holds, new requests for this one wait too, so it drains and
        the other loads and serves the requests queued for it; then these run (this
        model reloading if it was evicted). Waits are bounded by the other's load."""
        while slot.status == "loaded" and not slot.pinned:
            now = time.monotonic()
            starved = [
                model_id
                for model_id, since in self._room_waiters.items()
                if model_id != slot.entry.id and now - since >= self.yield_after_s
            ]
            if not starved:
                return
            await asyncio.sleep(_POLL_S)

    @staticmethod
    def release(leases: list[ModelSlot[Any]]) -> None:
        """End a request's leases (its response is over)."""
        for slot in leases:
            slot.leases -= 1
        leases.clear()

    def _check_loadable(self, slot: ModelSlot[ChatT]) -> None:
        model_id = slot.entry.id
        if model_id in self._never_fits:
            raise ModelRequestError(400, self._never_fits[model_id], code="model_too_large")
        if slot.failure is not None:
            if files_stamp(slot.entry.path) == slot.failure_stamp:
                raise ModelRequestError(
                    400,
                    f"model {model_id!r} failed to load: {slot.failure}",
                    code="model_load_failed",
                )
            slot.failure = None  # its files changed: try again

    async def _load(self, slot: ModelSlot[ChatT]) -> ChatT | EmbeddingState:
        """One model's load. Loads run one at a time: each sees the sizes the previous
        one measured, and two loads never hold their peak memory together."""
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        try:
            async with self._load_lock:
                return await self._load_now(slot)
        finally:
            slot.loading = None

    async def _load_now(self, slot: ModelSlot[ChatT]) -> ChatT | EmbeddingState:
        entry = slot.entry
        try:
            estimate = await self._make_room(slot)
        except ModelRequestError:
            raise
        except Exception as exc:  # files the estimate cannot read: the loader could not either
            raise self._load_failed(slot, exc) from exc
        started = time.monotonic()
        log.info("loading model %s (%s)", entry.id, entry.path or "embedded")
        try:
            if self._load_async is not None:
                state = await self._load_async(entry)
            else:
                state = await asyncio.to_thread(self._load_fn, entry)
        except Exception as exc:  # any loader failure: this model's, not the server's
            raise self._load_failed(slot, exc) from exc
        if self.draining:
            state.draining = True
        self.adopt(entry.id, state, estimate)
        budget = self.budget_bytes
        if budget is not None and slot.resident_bytes > budget:
            # Larger than estimated and than the whole budget: it never stays resident.
            message = self._too_large(entry, slot.resident_bytes, budget, "measured at its load")
            slot.unloading = True
            try:
                await self._release(slot, "too large")  # its own requests' leases: none ran
            finally:
                slot.unloading = False
            raise ModelRequestError(400, message, code="model_too_large")
        if not self.engines_started:
            self._start_fn(state)
        await self._trim()
        seconds = time.monotonic() - started
        self.metrics.load_seconds.observe(seconds)
        log.info(
            "model %s loaded in %.1fs (%.0f MiB resident)",
            entry.id,
            seconds,
            slot.resident_bytes / 2**20,
        )
        return state

    def _load_failed(self, slot: ModelSlot[ChatT], exc: Exception) -> ModelRequestError:
        """Remember a failed load (400 until the model's files change); its 500."""
        slot.resident_bytes = 0
        slot.failure, slot.failure_stamp = str(exc), files_stamp(slot.entry.path)
        log.error("model %s failed to load: %s", slot.entry.id, exc)
        return ModelRequestError(
            500, f"model {slot.entry.id!r} failed to load: {exc}", code="model_load_failed"
        )

    # ---- memory ----------------------------------------------------------------------

    def estimate(self, slot: ModelSlot[ChatT]) -> int:
        """A model's size: as measured at its last load, else as estimated before
        loading from its weight plan (the same for two entries of the same files)."""
        if slot.measured_bytes is not None:
            return slot.measured_bytes
        return self._estimate_fn(slot.entry)

    def _too_large(self, entry: ModelEntry, need: int, budget: int, how: str) -> str:
        message = (
            f"model {entry.id!r} needs about {gib(need)} (weights, KV and prefix cache, "
            f"{how}) and can never fit the memory budget of {gib(budget)} (--memory-budget)"
        )
        self._never_fits[entry.id] = message
        return message

    def resident_total(self) -> int:
        """Bytes of the resident models, and those reserved by loads under way."""
        return sum(
            s.resident_bytes
            for s in self.slots.values()
            if s.state is not None or s.loading is not None
        )

    async def _make_room(self, slot: ModelSlot[ChatT]) -> int | None:
        """Wait until the model's estimated size fits; that estimate (None: no budget)."""
        budget = self.budget_bytes
        if budget is None:
            return None
        need = self.estimate(slot)
        if need > budget:
            how = "estimated before loading" if slot.measured_bytes is None else "measured"
            message = self._too_large(slot.entry, need, budget, how)
            raise ModelRequestError(400, message, code="model_too_large")
        deadline = time.monotonic() + self.wait_timeout_s
        try:
            while self.resident_total() + need > budget:
                victim = self._victim()
                if victim is not None:
                    await self.unload(
                        victim.entry.id, "ttl" if victim.expired(time.monotonic()) else "lru"
                    )
                    continue
                if time.monotonic() >= deadline:
                    raise ModelRequestError(
                        503,
                        f"no memory for model {slot.entry.id!r}: the resident models are "
                        f"busy ({gib(self.resident_total())} of {gib(budget)}); retry later",
                        overloaded=True,
                    )
                self._room_waiters.setdefault(slot.entry.id, time.monotonic())
                await asyncio.sleep(_POLL_S)
        finally:
            self._room_waiters.pop(slot.entry.id, None)
        slot.resident_bytes = need  # reserved until the load measures it
        return need

    async def _trim(self) -> None:
        """After a load measured more than its estimate: unload idle models until the
        budget holds again."""
        budget = self.budget_bytes
        while budget is not None and self.resident_total() > budget:
            victim = self._victim()
            if victim is None:
                log.warning(
                    "resident models take %s, over the %s budget; all are busy or pinned",
                    gib(self.resident_total()),
                    gib(budget),
                )
                return
            await self.unload(victim.entry.id, "lru")

    def _victim(self) -> ModelSlot[ChatT] | None:
        """Expired TTL first, then the least recently used, among idle unpinned models."""
        now = time.monotonic()
        idle = [s for s in self.resident() if not s.pinned and not s.busy()]
        if not idle:
            return None
        expired = [s for s in idle if s.expired(now)]
        return min(expired or idle, key=lambda s: s.last_used)

    async def unload(self, model_id: str, reason: str, *, wait_s: float | None = None) -> bool:
        """Unload a resident model once its requests have finished (waiting up to
        `wait_s`, default the hub's wait timeout); False if it was not resident."""
        slot = self.slots[model_id]
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.state is None or slot.unloading:
            return False
        slot.unloading = True
        try:
            deadline = time.monotonic() + (self.wait_timeout_s if wait_s is None else wait_s)
            while slot.busy() and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
            if slot.busy():
                raise ModelRequestError(
                    503, f"model {model_id!r} still has requests in flight", overloaded=True
                )
            await self._release(slot, reason)
        finally:
            slot.unloading = False
        return True

    async def _release(self, slot: ModelSlot[ChatT], reason: str) -> None:
        """Stop a resident model's engine and free its memory (the caller has waited for
        its requests, or none has run on it)."""
        state, slot.state = slot.state, None
        if state is not None:
            await asyncio.to_thread(self._release_fn, state)
        del state  # the hub's last reference: the weights and KV can go
        await asyncio.to_thread(self._collect_fn)
        slot.resident_bytes = 0
        self.metrics.set_resident(slot.entry.id, 0)
        self.metrics.evictions.inc(model=slot.entry.id, reason=reason)
        log.info("model %s unloaded (%s)", slot.entry.id, reason)

    async def _reap(self) -> None:
        """Unload idle models whose TTL has passed, once a second."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in self.resident():
                if not slot.pinned and slot.expired(now) and not slot.busy():
                    with contextlib.suppress(ModelRequestError):  # busy again: next round
                        await self.unload(slot.entry.id, "ttl", wait_s=0)
