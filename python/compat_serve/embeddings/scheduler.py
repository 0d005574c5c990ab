"""Embedding and rerank work on the engine host's thread (#37).

An `EmbeddingEngine` is a hosted thing like a chat model's `Engine` (engine/host.py):
requests queue their inputs (token-id lists) here from the event loop, and the host's
thread takes bounded steps of them between the other models' steps, so MLX stays on one
thread and an embedding model shares the memory budget and registry like any model.

A step is one forward of one batch. Inputs of every queued request are pooled: the
oldest waiting input always goes in (no request starves), then its neighbours in length
order (similar lengths, little padding) while the padded batch (`longest x count`) stays
under `max_batch_tokens` and `max_batch_size`. A batch of 32 texts of 128 tokens is one
step at the default budget.

Fairness with a chat model: the host gives the next step to the engine that has used the
least step time. Alone that would split the thread half and half, and a chat model's
decode would drop to ~0.5x its solo speed while embedding batches run. An embedding
step is therefore charged `STEP_WEIGHT` times its seconds, so when both have work the
chat model gets `STEP_WEIGHT / (STEP_WEIGHT + 1)` of the thread and the embedding model
the rest; with nothing else to step, embedding steps run back to back at full speed.
7 (87.5%) rather than the 5 (83%) the issue's 0.8x would seem to need: measured through
the server (benches/embeddings.py), the HTTP, tokenizing and JSON work of the embedding
requests costs the chat model's decode another ~5% (the GIL, the two cores); at 5 it kept
0.78x, at 1 (plain fairness) 0.48x.

The weight sets the shares; the step's length sets how long the chat model's streams
wait between two tokens when an embedding step comes between them. Steps are therefore
also bounded in time: the engine keeps the padded tokens per second its forwards reach
and, while another model has work, takes at most `TARGET_STEP_S` of them per step (a
GPU takes the whole 4,096-token budget; a slow CPU, a fraction of it); a single input
always goes through. Alone, steps take the whole budget (the most inputs per second).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from compat_serve.engine.errors import EngineOverloaded, EngineStopped
from compat_serve.engine.host import EngineHost, WakingInbox

if TYPE_CHECKING:
    from compat_serve.embeddings.model import EmbeddingModel

log = logging.getLogger("compat_serve.engine")

# Virtual-time weight of an embedding step (see the module docstring). The environment
# variable is for benches/embeddings.py's comparison with plain fairness (1).
STEP_WEIGHT = float(os.environ.get("COMPAT_SERVE_EMBEDDING_STEP_WEIGHT", "7"))
# Padded tokens per forward (32 inputs of 128 tokens), and inputs per forward.
MAX_BATCH_TOKENS = 4096
MAX_BATCH_SIZE = 256
# Seconds an embedding step aims to take at most (its token budget shrinks to fit).
TARGET_STEP_S = 0.1
# Requests queued at once before new ones are refused (429, like the chat engine's queue).
MAX_QUEUED_REQUESTS = 256

Operation = Literal["embed", "score"]


@dataclass
class EmbeddingMemory:
    """What the registry counts for an embedding model: its weights (no KV, no cache)."""

    weights: int
    kv: int = 0
    cache: int = 0


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs; its future gets one result per input, in input order:
    float32 vectors (embed) or floats (score)."""

    operation: Operation
    inputs: list[list[int]]
    future: Future[list[np.ndarray]] = field(default_factory=Future)
    results: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)
        self.remaining = len(self.inputs)


@dataclass(eq=False)
class _Input:
    job: EmbeddingJob
    index: int
    seq: int  # arrival order, for the oldest-first rule

    @property
    def length(self) -> int:
        return len(self.job.inputs[self.index])


class _Stop:
    pass


class EmbeddingEngine:
    """The hosted stepper of one embedding or reranker model."""

    def __init__(
        self,
        model: EmbeddingModel,
        *,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        max_batch_size: int = MAX_BATCH_SIZE,
        max_queued: int = MAX_QUEUED_REQUESTS,
    ) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_queued = max_queued
        self.memory = EmbeddingMemory(weights=int(model.weight_bytes()))
        self._wake = threading.Event()
        self._inbox: WakingInbox[EmbeddingJob | _Stop] = WakingInbox(self._wake)
        self._pending: list[_Input] = []
        self._seq = 0
        self._open = 0
        self._open_lock = threading.Lock()
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._host: EngineHost | None = None
        # Padded tokens per second of the forwards so far (None: none measured yet).
        self._tokens_per_s: float | None = None
        # (inputs, padded tokens, seconds) of the last steps: benches and logs.
        self.step_log: list[tuple[int, int, float]] = []

    @property
    def operation(self) -> Operation:
        return "score" if self.model.kind == "reranker" else "embed"

    # ---- called from the event loop ------------------------------------------------

    def start(self, host: EngineHost | None = None) -> None:
        """Take steps on `host`'s thread (a private host when None: tests, embedders)."""
        if self._host is not None:
            return
        self._host = host or EngineHost(name="compat-embedding-host")
        self._inbox = WakingInbox(self._host.wake)
        self._host.attach(self, weight=STEP_WEIGHT)
        log.info(
            "embedding engine of %s: up to %d inputs and %d padded tokens per step, "
            "on the shared engine thread",
            self.model.name,
            self.max_batch_size,
            self.max_batch_tokens,
        )

    @property
    def running(self) -> bool:
        return self._host is not None and not self._done.is_set()

    @property
    def in_flight(self) -> int:
        with self._open_lock:
            return self._open

    def submit(self, operation: Operation, inputs: list[list[int]]) -> Future[list[np.ndarray]]:
        """Queue one request's inputs; raises EngineStopped or EngineOverloaded."""
        if self._stopping.is_set() or self._host is None:
            raise EngineStopped("the embedding engine is not running")
        if operation != self.operation:
            raise ValueError(f"this model cannot {operation}")
        with self._open_lock:
            if self._open >= self.max_queued:
                raise EngineOverloaded(self._open, self.max_queued)
            self._open += 1
        job = EmbeddingJob(operation, inputs)
        job.future.add_done_callback(self._closed)
        self._inbox.put(job)
        return job.future

    def _closed(self, _: Future[list[np.ndarray]]) -> None:
        with self._open_lock:
            self._open -= 1

    def shutdown(self, timeout: float = 30.0) -> None:
        """Fail what is queued (EngineStopped) and leave the host."""
        self._stopping.set()
        if self._host is None:
            self._done.set()
            return
        self._inbox.put(_Stop())
        self._done.wait(timeout)

    # ---- on the host's thread (engine/host.py) -------------------------------------

    def _drain_inbox(self, wait: float | None) -> bool:
        while True:
            try:
                command = self._inbox.get(block=wait != 0.0, timeout=wait or None)
            except queue.Empty:
                return True
            wait = 0.0
            if isinstance(command, _Stop):
                return False
            for index in range(len(command.inputs)):
                self._pending.append(_Input(command, index, self._seq))
                self._seq += 1

    def _hosted_has_work(self) -> bool:
        self._pending = [item for item in self._pending if not item.job.future.done()]
        return bool(self._pending)

    def _hosted_step(self) -> bool:
        batch = self.next_batch()
        started = time.monotonic()
        sequences = [item.job.inputs[item.index] for item in batch]
        try:
            rows = self._forward(sequences)
        except Exception as exc:  # the model's failure fails these requests, not the host
            log.exception("embedding forward of %s failed", self.model.name)
            for job in {item.job for item in batch}:
                _fail(job, exc)
            self._drop(batch)
            return True
        for item, row in zip(batch, rows, strict=True):
            job = item.job
            if job.future.done():  # the client went away
                continue
            job.results[item.index] = row
            job.remaining -= 1
            if job.remaining == 0:
                _settle(job)
        self._drop(batch)
        padded = max(len(s) for s in sequences) * len(sequences)
        seconds = time.monotonic() - started
        self.step_log = [*self.step_log[-255:], (len(batch), padded, seconds)]
        rate = padded / max(seconds, 1e-6)
        # A moving estimate: one odd step (a first call compiling shapes) does not set it.
        self._tokens_per_s = (
            rate if self._tokens_per_s is None else 0.7 * self._tokens_per_s + 0.3 * rate
        )
        return True

    @property
    def step_tokens(self) -> int:
        """Padded tokens a step beside another model's may take: the budget, or fewer
        where the forwards measured so far would take longer than `TARGET_STEP_S`."""
        if self._tokens_per_s is None:
            return self.max_batch_tokens
        return max(1, min(self.max_batch_tokens, int(self._tokens_per_s * TARGET_STEP_S)))

    def _forward(self, sequences: list[list[int]]) -> list[np.ndarray]:
        import mlx.core as mx

        if self.operation == "score":
            out = self.model.score(sequences).astype(mx.float32)
        else:
            out = self.model.embed(sequences).astype(mx.float32)
        mx.eval(out)
        values = np.array(out, copy=True)
        return list(values)

    def _drop(self, batch: list[_Input]) -> None:
        taken = {id(item) for item in batch}
        self._pending = [item for item in self._pending if id(item) not in taken]

    def next_batch(self) -> list[_Input]:
        """The oldest pending input and its length neighbours, under the step's budget."""
        pending = sorted(self._pending, key=lambda item: (item.length, item.seq))
        oldest = min(range(len(pending)), key=lambda i: pending[i].seq)
        contended = self._host is not None and self._host.others_busy(self)
        budget = self.step_tokens if contended else self.max_batch_tokens
        low, high = oldest, oldest + 1  # the batch is pending[low:high]
        longest = pending[oldest].length
        while high - low < self.max_batch_size:
            left = pending[low - 1] if low > 0 else None
            right = pending[high] if high < len(pending) else None
            if left is None and right is None:
                break
            # The closer length first: less padding for the batch.
            take_left = right is None or (
                left is not None and longest - left.length <= right.length - longest
            )
            candidate = left if take_left else right
            assert candidate is not None
            if max(longest, candidate.length) * (high - low + 1) > budget:
                break
            longest = max(longest, candidate.length)
            if take_left:
                low -= 1
            else:
                high += 1
        return pending[low:high]

    def _hosted_finish(self, *, failed: bool) -> None:
        self._stopping.set()
        stopped = EngineStopped("the embedding engine stopped")
        for job in {item.job for item in self._pending}:
            _fail(job, stopped)
        self._pending.clear()
        while True:  # submissions that raced with the stop
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, EmbeddingJob):
                _fail(command, stopped)
        self._done.set()
        log.info("embedding engine of %s stopped%s", self.model.name, " (failed)" if failed else "")


def _settle(job: EmbeddingJob) -> None:
    if job.future.set_running_or_notify_cancel():
        job.future.set_result([row for row in job.results if row is not None])


def _fail(job: EmbeddingJob, exc: BaseException) -> None:
    if not job.future.done() and job.future.set_running_or_notify_cancel():
        job.future.set_exception(exc)
