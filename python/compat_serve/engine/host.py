"""One thread that steps several engines (#27 item 3): every resident model keeps its own
scheduler, KV pool and prefix cache (its `Engine`), and this host's thread is the only
one that runs their steps, so one MLX stream serves them all.

Each turn the host applies every engine's queued commands, then takes one step of the
engine with work that has used the least step time (its virtual time), so a background
model's request is not starved by a main model that decodes without pause: a model that
was idle re-enters at the busy ones' floor rather than with a head start of credit.
An engine attached with a `weight` is charged that many seconds of virtual time per second
of its steps: an embedding model (weight 7, embeddings/scheduler.py) gets an eighth of
the thread while a chat model decodes beside it, and all of it when alone.
When every engine with work is stalled (waiting for KV), the host sleeps a moment; with
no work at all it sleeps until a submission wakes it.

A model being loaded meanwhile (`run_steps`, models/load_steps.py) has its MLX work run
here too, after each turn's step, bounded slices for about as long as that step took,
so the resident models go on stepping while it loads (each waits about one step more)
and no other thread evaluates MLX arrays; with nothing else to step its slices run back
to back. Its slices without MLX (files, tokenizers) run on a
worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from compat_serve.engine.mlx_threads import release_thread_mlx

if TYPE_CHECKING:
    from compat_serve.models.load_steps import Step

log = logging.getLogger("compat_serve.engine")

_STALL_WAIT_S = 0.01
T = TypeVar("T")


class WakingInbox(queue.SimpleQueue[T]):
    """A hosted engine's inbox: a put (submission, abort, stop) wakes the host."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._wake = wake

    def put(self, item: T, block: bool = True, timeout: Any = None) -> None:
        super().put(item, block, timeout)
        self._wake.set()


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class HostedEngine(Protocol):
    """What the host calls on what it steps: a chat model's `Engine`, or an embedding
    model's `EmbeddingEngine` (embeddings/scheduler.py)."""

    @property
    def model(self) -> _Named: ...
    @property
    def _inbox(self) -> queue.SimpleQueue[Any]: ...
    def _drain_inbox(self, wait: float | None) -> bool: ...
    def _hosted_has_work(self) -> bool: ...
    def _hosted_step(self) -> bool: ...
    def _hosted_finish(self, *, failed: bool) -> None: ...


@dataclass(eq=False)
class _Hosted:
    engine: HostedEngine
    # Seconds of steps taken (times `weight`), the fairness clock.
    virtual_s: float = 0.0
    weight: float = 1.0
    was_busy: bool = False
    stalled: bool = False


@dataclass(eq=False)
class _Slice:
    work: Callable[[], Any]
    label: str | None
    future: Future[Any] = field(default_factory=Future)


class EngineHost:
    def __init__(self, name: str = "compat-engine-host") -> None:
        self._name = name
        self._hosted: list[_Hosted] = []
        self._slices: deque[_Slice] = deque()
        # Loads under way: the thread outlives its engines until they are done, since
        # MLX streams belong to a thread and a load's lazy arrays to the thread's streams.
        self._loads = 0
        # Seconds of the last engine step: a load's share of the next turn.
        self._last_step_s = 0.0
        # The fairness clock's floor: the least virtual time of the engines stepping, never
        # decreasing (`_step`).
        self._floor = 0.0
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self._thread: threading.Thread | None = None
        # (label, seconds) of the slices run, newest last (benches, logs).
        self.slice_times: deque[tuple[str, float]] = deque(maxlen=4096)

    @property
    def thread_name(self) -> str:
        return self._name

    def attach(self, engine: HostedEngine, *, weight: float = 1.0) -> threading.Thread:
        """Step `engine` from now on, its step seconds counted `weight` times in the
        fairness clock; the host thread (started on first use)."""
        with self._lock:
            floor = min((h.virtual_s for h in self._hosted), default=0.0)
            self._hosted.append(_Hosted(engine, virtual_s=floor, weight=weight))
            thread = self._ensure_thread()
        self.wake.set()
        return thread

    def _ensure_thread(self) -> threading.Thread:
        """The host thread, started if it is not running (call with the lock held)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self._thread

    def run_slice(self, work: Callable[[], T], label: str | None) -> Future[T]:
        """Run `work` on the host thread between two steps; its result's future. Its
        seconds go to `slice_times` under `label` (None: `work` records its own)."""
        item = _Slice(work, label)
        with self._lock:
            self._slices.append(item)
            self._ensure_thread()
        self.wake.set()
        return item.future

    async def run_steps(self, steps: Generator[Step, None, T]) -> T:
        """Drive a load (models/load_steps.py): its host slices here, between steps
        (`_advance_while_alone`), the others on a worker thread; its result."""
        from compat_serve.models.load_steps import advance

        with self._lock:
            self._loads += 1
        failed = True
        try:
            on_host, label = False, "files"
            while True:
                if on_host:
                    done, value = await asyncio.wrap_future(
                        self.run_slice(partial(self._advance_while_alone, steps, label), None)
                    )
                else:
                    done, value = await asyncio.to_thread(advance, steps)
                if done:
                    failed = False
                    result: T = value
                    return result
                on_host, label = value.on_host, value.label
        finally:
            # A loaded model: no wake, so the thread waits for its engine's attach rather
            # than ending first, and the engine runs on the thread that built it (MLX
            # streams, and lazy arrays with them, belong to one thread). A failed one:
            # the thread may end if nothing else is left.
            with self._lock:
                self._loads -= 1
            if failed:
                self.wake.set()

    def _advance_while_alone(self, steps: Generator[Step, None, T], label: str) -> tuple[bool, Any]:
        """On the host thread: slices of a load, one after the other while no engine has
        work and no other slice waits (a load with nothing else to step runs at full
        speed); otherwise for about as long as the step just taken (at least one
        slice), so a load shares the thread half and half with the models that step."""
        from compat_serve.models.load_steps import advance

        budget = self._last_step_s
        spent = 0.0
        while True:
            started = time.monotonic()
            done, value = advance(steps)
            seconds = time.monotonic() - started
            spent += seconds
            self.slice_times.append((label, seconds))
            if done or not value.on_host or (spent >= budget and self._others_waiting()):
                return done, value
            label = value.label

    def others_busy(self, engine: HostedEngine) -> bool:
        """Whether an engine other than `engine` has work (on the host's thread: whether
        a step of `engine` now delays another model's)."""
        with self._lock:
            hosted = list(self._hosted)
        return any(h.was_busy for h in hosted if h.engine is not engine)

    def _others_waiting(self) -> bool:
        with self._lock:
            if self._slices:
                return True
            hosted = list(self._hosted)
        return any(not h.engine._inbox.empty() or h.engine._hosted_has_work() for h in hosted)

    @property
    def engines(self) -> int:
        with self._lock:
            return len(self._hosted)

    def _run(self) -> None:
        while True:
            self.wake.clear()  # before reading the inboxes: a later put sets it again
            with self._lock:
                hosted = list(self._hosted)
                ending = not hosted and not self._slices and not self._loads
                if ending:
                    self._thread = None
            if ending:
                release_thread_mlx()
                return
            busy = [h for h in hosted if self._poll(h)]
            if busy:
                self._step(busy)
            if self._run_one_slice():
                continue
            if not busy:
                self.wake.wait()
            elif all(h.stalled for h in busy):
                self.wake.wait(_STALL_WAIT_S)
                for h in busy:
                    h.stalled = False

    def _run_one_slice(self) -> bool:
        """Run the oldest queued load slice, if any."""
        with self._lock:
            if not self._slices:
                return False
            item = self._slices.popleft()
        if not item.future.set_running_or_notify_cancel():
            return True
        started = time.monotonic()
        try:
            result = item.work()
        except BaseException as exc:  # the load's failure, reported to whoever awaits it
            item.future.set_exception(exc)
        else:
            item.future.set_result(result)
        if item.label is not None:
            self.slice_times.append((item.label, time.monotonic() - started))
        return True

    def _step(self, busy: list[_Hosted]) -> None:
        """One step of the busy engine that has used the least step time."""
        running = [h.virtual_s for h in busy if h.was_busy]
        # The floor never goes back: a model that was idle while another stepped alone
        # re-enters at the clock that one reached, not at its own older time (which would
        # be credit banked while idle: it would then hold the thread until it caught up).
        self._floor = max(self._floor, min(running) if running else 0.0)
        for h in busy:
            if not h.was_busy:  # back from idle: no credit for the time it slept
                h.virtual_s = max(h.virtual_s, self._floor)
                h.was_busy = True
        chosen = min(busy, key=lambda h: (h.stalled, h.virtual_s))
        started = time.monotonic()
        try:
            progressed = chosen.engine._hosted_step()
        except Exception:  # a scheduler bug: that model's requests fail, others go on
            log.exception("the engine loop of %s failed", chosen.engine.model.name)
            self._detach(chosen, failed=True)
            busy.remove(chosen)
            return
        self._last_step_s = time.monotonic() - started
        chosen.virtual_s += self._last_step_s * chosen.weight
        chosen.stalled = not progressed

    def _poll(self, hosted: _Hosted) -> bool:
        """Apply the engine's commands; whether it has work. An engine asked to stop is
        finished and detached here."""
        try:
            alive = hosted.engine._drain_inbox(0.0)
        except Exception:
            log.exception("the engine inbox of %s failed", hosted.engine.model.name)
            alive = False
        if not alive:
            self._detach(hosted, failed=False)
            return False
        busy = hosted.engine._hosted_has_work()
        if not busy:
            hosted.was_busy = hosted.stalled = False
        return busy

    def _detach(self, hosted: _Hosted, *, failed: bool) -> None:
        with self._lock:
            self._hosted.remove(hosted)
        hosted.engine._hosted_finish(failed=failed)
        self.wake.set()  # look again: with no engine left the thread ends
