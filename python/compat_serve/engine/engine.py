"""The engine: one dedicated thread runs every MLX forward pass.

HTTP handlers call `submit()` from the event loop and read a `RequestStream`; the
engine thread takes commands from a thread-safe inbox, and runs one step at a time:
a prefill chunk or one decode token. Aborts take effect at the next step boundary, so
at most one prefill chunk later. Today one sequence runs at a time in FIFO order; the
Rust scheduler replaces `_pick_next` and batches decode without changing this shape.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from compat_serve.engine.detokenizer import IncrementalDetokenizer
from compat_serve.engine.errors import EngineOverloaded, EngineStopped, PromptTooLong
from compat_serve.engine.metrics import EngineMetrics
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.sampling import RequestSampler
from compat_serve.engine.sequence import Phase, Sequence
from compat_serve.engine.status import RequestStatus, StatusBoard
from compat_serve.engine.stop_strings import StopStringMatcher
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, Usage
from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve.engine")


@dataclass(frozen=True)
class EngineConfig:
    prefill_chunk: int = 512
    max_queue: int = 256
    # Log prefill progress at most this often for long prompts.
    progress_interval_s: float = 5.0


@dataclass(frozen=True)
class _Submit:
    sequence: Sequence


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Stop


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = loaded
        self.config = config or EngineConfig()
        self.status = StatusBoard()
        self.metrics = EngineMetrics(loaded.name)
        self._runner = ModelRunner(loaded)
        tokenizer = loaded.tokenizer
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        self._special_ids = frozenset(tokenizer.special_token_ids)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: Sequence | None = None
        self._queued = 0  # submitted but not yet finished; read by submit() for backpressure
        self._queued_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- called from other threads -------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="compat-engine", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestStream:
        """Queue a request; returns its event stream. Raises on overload or oversize."""
        if self._stopping.is_set() or not self.running:
            raise EngineStopped("the engine is not running")
        max_prompt = self.model.context_length - (1 if request.sampling.max_tokens > 0 else 0)
        if len(request.prompt_ids) > max_prompt:
            raise PromptTooLong(len(request.prompt_ids), max_prompt)
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        with self._queued_lock:
            if self._queued >= self.config.max_queue:
                raise EngineOverloaded(self._queued, self.config.max_queue)
            self._queued += 1
        stream = RequestStream(request.request_id, loop or asyncio.get_running_loop(), self.abort)
        seq = Sequence(
            request=request,
            stream=stream,
            detokenizer=IncrementalDetokenizer(
                self.model.tokenizer, self._special_ids, request.visible_special_ids
            ),
            stops=StopStringMatcher(request.sampling.stop_strings),
            stop_ids=frozenset(request.sampling.stop_token_ids)
            | (self._eos_ids if request.sampling.stop_at_eos else frozenset()),
        )
        self.status.put(
            RequestStatus(
                request.request_id,
                Phase.QUEUED.value,
                len(request.prompt_ids),
                submitted_at=seq.timings.submitted,
            )
        )
        self.metrics.on_submit(request.request_id, seq.prompt_len, seq.timings.submitted)
        self._inbox.put(_Submit(seq))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and stop the thread."""
        self._stopping.set()
        self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    # ---- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        log.info("engine thread started (prefill chunk %d)", self.config.prefill_chunk)
        while True:
            idle = self._active is None and not self._waiting
            if not self._drain_inbox(block=idle):
                break
            if self._active is None and self._waiting:
                self._active = self._waiting.popleft()
            if self._active is not None:
                self._step(self._active)
        leftover = [*self._waiting, *([self._active] if self._active else [])]
        while True:  # submissions that raced with the stop command
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                leftover.append(command.sequence)
        for seq in leftover:
            self._finish(seq, FinishReason.ABORTED)
        self._waiting.clear()
        self._active = None
        log.info("engine thread stopped")

    def _drain_inbox(self, *, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._waiting.append(command.sequence)
            else:
                self._apply_abort(command.request_id)

    def _apply_abort(self, request_id: str) -> None:
        if self._active is not None and self._active.request_id == request_id:
            self._finish(self._active, FinishReason.ABORTED)
            return
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                self._finish(seq, FinishReason.ABORTED)
                return

    def _step(self, seq: Sequence) -> None:
        try:
            if seq.phase in (Phase.QUEUED, Phase.PREFILL):
                self._prefill_step(seq)
            else:
                self._decode_step(seq)
        except Exception as exc:  # one bad request must never take the engine down
            log.exception("request %s failed in the engine", seq.request_id)
            self._finish(seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _prefill_step(self, seq: Sequence) -> None:
        if seq.phase is Phase.QUEUED:
            seq.phase = Phase.PREFILL
            seq.cache = self._runner.new_cache()
            seq.sampler = RequestSampler(seq.request.sampling)
            seq.timings.extra["prefill_started"] = time.monotonic()
            self.status.update(seq.request_id, phase=Phase.PREFILL.value)
            self.metrics.on_start(seq.request_id)
        assert seq.cache is not None and seq.sampler is not None
        prompt = seq.request.prompt_ids
        end = min(seq.computed + self.config.prefill_chunk, len(prompt))
        chunk = list(prompt[seq.computed : end])
        if end < len(prompt):
            self._runner.prefill(seq.cache, chunk)
            seq.computed = end
            self.metrics.on_prefill(seq.request_id, end, seq.cache)
            self.status.update(seq.request_id, computed_tokens=end)
            self._log_progress(seq)
            return
        logits = self._runner.last_logits(seq.cache, chunk)
        seq.computed = end
        self.metrics.on_prefill(seq.request_id, end, seq.cache)
        seq.timings.prompt_done = time.monotonic()
        self.status.update(seq.request_id, computed_tokens=end, phase=Phase.DECODE.value)
        if seq.request.sampling.max_tokens == 0:
            mx.eval(logits)
            self._finish(seq, FinishReason.LENGTH)
            return
        seq.pending = seq.sampler(logits)
        mx.async_eval(seq.pending)  # type: ignore[no-untyped-call]
        seq.phase = Phase.DECODE

    def _decode_step(self, seq: Sequence) -> None:
        assert seq.cache is not None and seq.sampler is not None and seq.pending is not None
        current = seq.pending
        produced = len(seq.generated) + 1
        room = seq.prompt_len + produced < self.model.context_length
        if produced < seq.request.sampling.max_tokens and room:
            # Queue the next forward pass before reading this token: the CPU stays busy
            # while Python handles detokenization and streaming.
            seq.pending = seq.sampler(self._runner.decode_logits(seq.cache, current))
            mx.async_eval(seq.pending)  # type: ignore[no-untyped-call]
        else:
            seq.pending = None
        self._accept_token(seq, _token_value(current))

    def _accept_token(self, seq: Sequence, token: int) -> None:
        now = time.monotonic()
        if not seq.generated:
            seq.timings.first_token = now
            self.status.update(seq.request_id, ttft_s=round(now - seq.timings.submitted, 4))
        seq.generated.append(token)
        self.metrics.on_token(seq.request_id, now)
        n = len(seq.generated)
        if token in seq.stop_ids:
            self._finish(seq, FinishReason.STOP_TOKEN, stop_token_id=token)
            return
        match = seq.stops.feed(seq.detokenizer.add(token))
        # One event per token, even when its text is still held back (partial character,
        # possible stop-string prefix): consumers see every id the model produced.
        seq.stream.push(EngineEvent(seq.request_id, text=match.emit, token_ids=(token,)))
        if match.matched is not None:
            self._finish(seq, FinishReason.STOP_STRING, matched_stop=match.matched)
        elif n >= seq.request.sampling.max_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.prompt_len + n >= self.model.context_length:
            self._finish(seq, FinishReason.CONTEXT)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        matched_stop: str | None = None,
        stop_token_id: int | None = None,
        error: str | None = None,
    ) -> None:
        if seq.phase is Phase.FINISHED:
            return
        tail = ""
        if reason is not FinishReason.STOP_STRING:
            tail = seq.stops.feed(seq.detokenizer.flush()).emit + seq.stops.flush()
        seq.phase = Phase.FINISHED
        seq.timings.finished = time.monotonic()
        seq.cache = None
        seq.pending = None
        if self._active is seq:
            self._active = None
        with self._queued_lock:
            self._queued -= 1
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.generated))
        # Clear the status row before the final event: a client that sees its request
        # finished must not still find it in /v1/status.
        self.status.remove(seq.request_id)
        self.metrics.on_finish(seq.request_id, reason, seq.timings.finished)
        seq.stream.push(
            EngineEvent(
                seq.request_id,
                text=tail,
                finish_reason=reason,
                matched_stop=matched_stop,
                stop_token_id=stop_token_id,
                usage=usage,
                error=error,
            )
        )
        self._log_finished(seq, reason)

    def _log_progress(self, seq: Sequence) -> None:
        last = seq.timings.extra.get("progress_logged", seq.timings.submitted)
        now = time.monotonic()
        if now - last >= self.config.progress_interval_s:
            seq.timings.extra["progress_logged"] = now
            started = seq.timings.extra.get("prefill_started", seq.timings.submitted)
            rate = seq.computed / max(now - started, 1e-9)
            log.info(
                "%s: prefill %d/%d tokens (%.0f tok/s)",
                seq.request_id,
                seq.computed,
                seq.prompt_len,
                rate,
            )

    def _log_finished(self, seq: Sequence, reason: FinishReason) -> None:
        t = seq.timings
        end = t.finished or time.monotonic()
        ttft = (t.first_token - t.submitted) if t.first_token else None
        decode_s = (end - t.first_token) if t.first_token else 0.0
        rate = (len(seq.generated) - 1) / decode_s if decode_s > 0 else 0.0
        log.info(
            "%s: %s — prompt %d tok, generated %d tok, ttft %s, decode %.1f tok/s, total %.2fs",
            seq.request_id,
            reason.value,
            seq.prompt_len,
            len(seq.generated),
            f"{ttft:.2f}s" if ttft is not None else "-",
            rate,
            end - t.submitted,
        )


def _token_value(token: mx.array) -> int:
    value = token.item()
    assert isinstance(value, int)
    return value
