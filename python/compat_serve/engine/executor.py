"""Decides each engine step and has it applied, one step at a time, on the engine thread.

A step is: `schedule()` → drop the KV of preempted requests → one batched decode forward
for every running request (each row sampled with its own settings) → the planned
prefill chunks, each on its request's own cache, sampling the first token after a last
chunk → `update()`, which ends requests on stop tokens, max tokens or a full context →
requests whose prompt is done join the decode batch. Text, stop strings and stream
events are handled here per token; a stop string ends the request through
`Scheduler.finish`. A failing forward pass fails only the requests it computed.

`StepExecutor` is the deciding side: the scheduler, admission, preemption, the prefix
cache, sampling, grammars, stop strings and usage. Every forward and every change to the
KV goes through its `StepApplier` (engine/applier.py), which records it as an op of the
step's `StepPlan` (engine/step_plan.py); `on_plan` receives each plan. Speculative
decoding's draft, verify and rollback live in engine/speculative_step.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import mlx.core as mx

from compat_serve._native import GrammarError, Scheduler, SchedulerError
from compat_serve.engine.applier import StepApplier
from compat_serve.engine.constraints import masked_logits
from compat_serve.engine.metrics import EngineMetrics
from compat_serve.engine.prefix.cache import PrefixCaching
from compat_serve.engine.prefix.pins import creation_split
from compat_serve.engine.request_log import decode_rate, log_finished, log_progress
from compat_serve.engine.runner import ModelRunner, plain_kv
from compat_serve.engine.sampling import sample_rows
from compat_serve.engine.sequence import Phase, Sequence
from compat_serve.engine.speculation import SpeculationConfig, SpeculationStats
from compat_serve.engine.speculative_step import SpeculativeStep, rope_deltas
from compat_serve.engine.status import StatusBoard
from compat_serve.engine.step_plan import Restore, StepPlan
from compat_serve.engine.types import EngineEvent, FinishReason, Usage
from compat_serve.engine.verify_rollback import verify_can_roll_back

log = logging.getLogger("compat_serve.engine")

# Last chunks of requests that start in the same step run as one batch
# (`StepExecutor._prefill_together`) when each has at most this many tokens to compute
# (short prompts, where a forward's fixed cost dominates and padding wastes little) on at
# most this many restored tokens (merging copies them).
TOGETHER_MAX_TOKENS = 256
TOGETHER_MAX_CACHED = 4096

PlannedChunk = tuple[Sequence, int, int, bool]  # request, start, length, is_last

_SCHEDULER_REASONS = {
    "stop_token": FinishReason.STOP_TOKEN,
    "max_tokens": FinishReason.LENGTH,
    "context_full": FinishReason.CONTEXT,
    "aborted": FinishReason.ABORTED,
}


class StepExecutor:
    """Owns the live requests and decides each step; only the engine thread calls it."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        status: StatusBoard,
        metrics: EngineMetrics,
        progress_interval_s: float,
        on_finished: Callable[[], None],
        prefix: PrefixCaching | None = None,
        prefill_chunk: int = 512,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._status = status
        self._metrics = metrics
        self._progress_interval_s = progress_interval_s
        self._on_finished = on_finished
        self._seqs: dict[str, Sequence] = {}
        self.applier = StepApplier(runner)
        # Called with each step's plan (the ops applied), e.g. to send it to followers.
        self.on_plan: Callable[[StepPlan], None] | None = None
        # Batched prefill of several prompts runs its forward before it commits; off in
        # distributed mode, where every forward is sent to the other ranks first.
        self.batch_prefill = True
        self.prefix = prefix
        if prefix is not None:  # its K/V copies and drops go into the plan too
            prefix.record = self.applier.record
        self._prefill_chunk = prefill_chunk
        spec = speculation or SpeculationConfig()
        rollback_ok = spec.mode != "off" and verify_can_roll_back(runner.new_cache())
        self.spec = SpeculativeStep(
            spec, self.applier, scheduler, status, metrics, prefill_chunk, rollback_ok
        )

    @property
    def spec_stats(self) -> SpeculationStats:
        return self.spec.stats

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    def requests_with_adapter(self, name: str) -> int:
        """Live requests that run with the LoRA adapter `name`."""
        return sum(1 for seq in self._seqs.values() if seq.request.adapter == name)

    # ---- commands ------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> None:
        sampling = seq.request.sampling
        cached = 0
        bank = self.applier.runner.adapters
        adapter = seq.request.adapter
        if adapter is not None and (bank is None or adapter not in bank.names()):
            # Removed between its submit and now.
            self._end(seq, FinishReason.ERROR, error=f"the adapter {adapter!r} is not loaded")
            return
        try:
            if self.prefix is not None:
                cached = self.prefix.admit(seq)
            self._scheduler.add_request(
                seq.request_id,
                seq.prompt_len,
                sampling.max_tokens,
                sorted(seq.stop_ids),
                cached_tokens=cached,
            )
        except (SchedulerError, ValueError, OverflowError) as exc:  # bad counts: fail this one
            self._end(seq, FinishReason.ERROR, error=str(exc))
            return
        self._status.update(
            seq.request_id, cached_tokens=cached, cache_hit=seq.cache_hit if cached else "miss"
        )
        self._seqs[seq.request_id] = seq

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._scheduler.abort(request_id)
        self._end(seq, FinishReason.ABORTED)
        self._release_ended()
        self._metrics.on_step(len(self.applier.batch), self._scheduler.kv_tokens_used)
        self._emit_plan()

    def abort_all(
        self, never_admitted: Iterable[Sequence] = (), reason: FinishReason = FinishReason.ABORTED
    ) -> None:
        for seq in [*self._seqs.values(), *never_admitted]:
            self._scheduler.abort(seq.request_id)
            self._end(seq, reason)
        self.applier.drop(self.applier.held_ids())
        self._metrics.on_step(0, self._scheduler.kv_tokens_used)
        self._emit_plan()

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> bool:
        """Runs one planned step; False when the plan had nothing to compute."""
        plan = self._scheduler.schedule()
        self._preempt(plan.preempted)
        prefilled: list[tuple[str, int]] = []
        sampled: list[tuple[str, int]] = []
        if plan.decode:
            self._decode(plan.decode, sampled)
        planned: list[PlannedChunk] = []
        for request_id, start, length, is_last in plan.prefill:
            seq = self._seqs.get(request_id)
            if seq is not None:
                planned.append((seq, start, length, is_last))
        together = [chunk for chunk in planned if self._whole_prompt_left(*chunk)]
        if not self.batch_prefill:
            together = []
        if len(together) < 2 or not self._prefill_together(together, prefilled, sampled):
            together = []  # none, one, or the batched forward failed: each on its own
        done = {id(chunk[0]) for chunk in together}
        for seq, start, length, is_last in planned:
            if id(seq) not in done and seq.request_id in self._seqs:
                self._prefill(seq, start, length, is_last, prefilled, sampled)
        joining = [chunk[0] for chunk in planned if chunk[0].phase is Phase.DECODE]
        for request_id, reason in self._scheduler.update(prefilled, sampled):
            seq = self._seqs.get(request_id)
            if seq is not None:
                stop_token = seq.generated[-1] if reason == "stop_token" else None
                self._end(seq, _SCHEDULER_REASONS[reason], stop_token_id=stop_token)
        self._join([seq for seq in joining if seq.request_id in self._seqs])
        self._release_ended()
        self._metrics.on_step(len(self.applier.batch), self._scheduler.kv_tokens_used)
        self._emit_plan()
        return bool(plan.decode or plan.prefill)

    def _release_ended(self) -> None:
        """Free the KV of requests that ended (finished, aborted, failed)."""
        self.applier.drop([rid for rid in self.applier.held_ids() if rid not in self._seqs])

    def _emit_plan(self) -> None:
        plan = self.applier.take_plan()
        if plan is not None and self.on_plan is not None:
            self.on_plan(plan)

    def _preempt(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self._seqs[request_id]
            log.info(
                "%s: preempted (KV memory full); it will recompute %d tokens",
                request_id,
                seq.prompt_len + len(seq.generated),
            )
            seq.phase = Phase.QUEUED
            seq.computed = 0
            if self.prefix is not None:
                self.prefix.preempted(seq)
            self._metrics.on_preempt(request_id)
            self._status.update(request_id, phase=Phase.QUEUED.value, computed_tokens=0)
        self.applier.drop(request_ids)

    def _join(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        try:
            self.applier.join([seq.request_id for seq in seqs])
        except Exception as exc:
            log.exception("could not batch %d requests", len(seqs))
            batched = [self._seqs[r] for r in self.applier.batch.ids if r in self._seqs]
            for seq in [*seqs, *batched]:
                self.fail(seq, exc)
            self.applier.clear_batch()

    def _decode(self, planned: list[str], sampled: list[tuple[str, int]]) -> None:
        rows = self.applier.batch.ids
        if sorted(rows) != sorted(planned):
            raise SchedulerError(f"decode plan {planned} does not match the batch {rows}")
        seqs = [self._seqs[request_id] for request_id in rows]
        self._metrics.on_decode_step(len(seqs))
        started = time.perf_counter()
        spec = self.spec
        if spec.active:
            drafts = spec.drafts_or_none(seqs)
            if drafts is not None:
                spec.decode(self, seqs, drafts, sampled, started)
                return
            started = time.perf_counter()
        try:
            logits = self.applier.decode(rows, [s.generated[-1] for s in seqs], rope_deltas(seqs))
            logits, grammar_errors = self._constrain(logits, seqs)
            tokens = sample_rows(logits, [s.ensure_sampler() for s in seqs])
            mx.eval(tokens)
            values: list[int] = tokens.tolist()  # type: ignore[assignment]
        except Exception as exc:  # the batch is lost with the forward that failed
            self.fail_batch(seqs, exc, "a decode step")
            return
        if spec.active:
            spec.stats.costs.observe(len(seqs), 1, time.perf_counter() - started)
        for seq, value, grammar_error in zip(seqs, values, grammar_errors, strict=True):
            if grammar_error is not None:
                self.fail(seq, GrammarError(grammar_error))
                continue
            token = seq.next_token(value)
            sampled.append((seq.request_id, token))
            self.accept_token(seq, token)

    def _prefill(
        self,
        seq: Sequence,
        start: int,
        length: int,
        is_last: bool,
        prefilled: list[tuple[str, int]],
        sampled: list[tuple[str, int]],
    ) -> None:
        try:
            if self.applier.own_cache(seq.request_id) is None:
                if start != seq.cached_tokens:
                    raise SchedulerError(f"{seq.request_id}: prefill from {start} without a cache")
                self._start_prefill(seq)
            if start != seq.computed:
                raise SchedulerError(f"{seq.request_id}: prefill from {start}, at {seq.computed}")
            tokens = seq.known_tokens(start, start + length)
            token = self._compute_chunk(seq, start, tokens, is_last)
        except SchedulerError:
            raise
        except Exception as exc:  # one bad request must never take the engine down
            log.exception("request %s failed in prefill", seq.request_id)
            self.fail(seq, exc)
            return
        self._chunk_done(seq, start, length, is_last, token, prefilled, sampled)

    def _whole_prompt_left(self, seq: Sequence, start: int, length: int, is_last: bool) -> bool:
        """Whether this chunk can join a batched prefill (`_prefill_together`): the last
        chunk of a request that starts now and has a token to sample, on a plain-attention
        model, short enough that padding it to its neighbours wastes little."""
        if (self.prefix is not None and self.prefix.hybrid) or seq.request.vision is not None:
            return False
        fresh = self.applier.own_cache(seq.request_id) is None and start == seq.cached_tokens
        return (
            is_last
            and fresh
            and seq.request.sampling.max_tokens > 0
            and length <= TOGETHER_MAX_TOKENS
            and seq.cached_tokens <= TOGETHER_MAX_CACHED
        )

    def _prefill_together(
        self,
        chunks: list[PlannedChunk],
        prefilled: list[tuple[str, int]],
        sampled: list[tuple[str, int]],
    ) -> bool:
        """The whole (remaining) prompts of several requests in batched forwards
        (`ModelRunner.last_logits_together`), each row sampled with its own settings. False
        when nothing was computed (a request's restored cache is not plain K/V, or the
        batched forward failed): the caller then prefills each request on its own."""
        for seq, _, _, _ in chunks:
            self._start_prefill(seq)
        caches = [self.applier.own_cache(seq.request_id) for seq, _, _, _ in chunks]
        if not all(cache is not None and plain_kv(cache) for cache in caches):
            return False
        token_lists = [seq.known_tokens(start, start + length) for seq, start, length, _ in chunks]
        try:
            logits, commit = self.applier.prefill_together(
                [seq.request_id for seq, _, _, _ in chunks], token_lists
            )
            logits, grammar_errors = self._constrain(logits, [seq for seq, _, _, _ in chunks])
            if any(grammar_errors):
                return False  # one by one: the failing request fails alone
            tokens = sample_rows(logits, [seq.ensure_sampler() for seq, _, _, _ in chunks])
            mx.eval(tokens)
            values: list[int] = tokens.tolist()  # type: ignore[assignment]
        except Exception:  # the requests' own caches are untouched: run them one by one
            log.exception("a batched prefill of %d requests failed; prefilling each", len(chunks))
            return False
        commit()
        for (seq, start, length, is_last), token, tokens_in in zip(
            chunks, values, token_lists, strict=True
        ):
            self._cache_computed(seq, start, tokens_in)
            self._chunk_done(seq, start, length, is_last, token, prefilled, sampled)
        return True

    def _chunk_done(
        self,
        seq: Sequence,
        start: int,
        length: int,
        is_last: bool,
        token: int | None,
        prefilled: list[tuple[str, int]],
        sampled: list[tuple[str, int]],
    ) -> None:
        """Bookkeeping after a computed chunk: progress, status, and after a last chunk the
        switch to decode with its first token."""
        seq.computed = start + length
        prefilled.append((seq.request_id, length))
        prompt_done = min(seq.computed, seq.prompt_len)
        self._metrics.on_prefill(
            seq.request_id, prompt_done, self.applier.own_cache(seq.request_id)
        )
        self._status.update(seq.request_id, computed_tokens=prompt_done)
        if not is_last:
            log_progress(seq, self._progress_interval_s, len(self.applier.batch))
            return
        seq.timings.prompt_done = time.monotonic()
        seq.phase = Phase.DECODE
        self._status.update(seq.request_id, phase=Phase.DECODE.value)
        if token is not None:
            token = seq.next_token(token)
            sampled.append((seq.request_id, token))
            self.accept_token(seq, token)

    def _compute_chunk(
        self, seq: Sequence, start: int, tokens: list[int], is_last: bool
    ) -> int | None:
        """Run one planned chunk; after a last chunk, sample the next token."""
        request_id, vision = seq.request_id, seq.request.vision
        prefix = self.prefix
        if is_last and prefix is not None and prefix.hybrid:
            # End the prompt's last full block on its own forward pass, and (text only)
            # the prompt minus its last token, so the state at each can be snapshotted:
            # for the next turn, and for an exact repeat (prefix/points.py).
            end = start + len(tokens)
            cuts = {end // prefix.block_size * prefix.block_size}
            if vision is None:
                cuts.add(end - 1)
            for cut in sorted(c for c in cuts if start < c < end):
                head, tokens = tokens[: cut - start], tokens[cut - start :]
                self.applier.prefill(request_id, start, head, vision)
                self._cache_computed(seq, start, head)
                start = cut
        if not is_last:
            self.applier.prefill(request_id, start, tokens, vision)
            self._cache_computed(seq, start, tokens)
            return None
        logits = self.applier.last_logits(request_id, start, tokens, vision)
        token: int | None = None
        if seq.request.sampling.max_tokens == 0:
            mx.eval(logits)
        else:
            logits, (grammar_error,) = self._constrain(logits, [seq])
            if grammar_error is not None:
                raise GrammarError(grammar_error)
            token = _token_value(seq.ensure_sampler()(logits))
        self._cache_computed(seq, start, tokens)
        return token

    def _cache_computed(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        cache = self.applier.own_cache(seq.request_id)
        if self.prefix is None or cache is None:
            return
        try:
            self.prefix.computed(seq, cache, start, tokens)
        except Exception as exc:  # caching is an optimisation: the request goes on
            self.prefix.fault(seq, exc)

    def _start_prefill(self, seq: Sequence) -> None:
        cache = self.applier.new_cache(seq.request_id, seq.request.adapter)
        seq.phase = Phase.PREFILL
        seq.ensure_sampler()
        seq.timings.extra.setdefault("prefill_started", time.monotonic())
        self._status.update(seq.request_id, phase=Phase.PREFILL.value)
        self._metrics.on_start(seq.request_id)
        seq.computed = seq.cached_tokens
        if not seq.cached_tokens or self.prefix is None:
            return
        tail = seq.cache_tail[1] if seq.cache_tail is not None else 0
        restored = Restore(seq.request_id, seq.cached_tokens, tuple(seq.cached_blocks), tail)
        try:
            self.prefix.restore(seq, cache)
            self.applier.restored(restored)
        except Exception as exc:  # a cache fault never wedges the engine: recompute
            self.prefix.fault(seq, exc)
            self.applier.new_cache(seq.request_id, seq.request.adapter)
            prompt = list(seq.request.prompt_ids[: seq.cached_tokens])
            for i in range(0, len(prompt), self._prefill_chunk):
                chunk = prompt[i : i + self._prefill_chunk]
                self.applier.prefill(seq.request_id, i, chunk, seq.request.vision)

    def accept_token(self, seq: Sequence, token: int) -> None:
        now = time.monotonic()
        if not seq.generated:
            seq.timings.first_token = now
            self._status.update(seq.request_id, ttft_s=round(now - seq.timings.submitted, 4))
        seq.generated.append(token)
        self._metrics.on_token(seq.request_id, now)
        recorder = seq.sampler.logprobs if seq.sampler is not None else None
        logprob = recorder.take(token) if recorder is not None else None
        if token in seq.stop_ids:
            return  # the scheduler ends it in update(); the token is never shown
        if seq.constraint is not None:
            try:
                seq.constraint.consume(token)
            except GrammarError as exc:
                self.fail(seq, exc)
                return
        text = seq.detokenizer.add(token)
        if seq.budget is not None:
            seq.budget.observe(token, text)
        match = seq.stops.feed(text)
        # One event per token, even when its text is still held back (partial character,
        # possible stop-string prefix): consumers see every id the model produced.
        seq.stream.push(
            EngineEvent(
                seq.request_id,
                text=match.emit,
                token_ids=(token,),
                logprobs=() if logprob is None else (logprob,),
            )
        )
        if match.matched is not None:
            self._scheduler.finish(seq.request_id, "external")
            self._end(seq, FinishReason.STOP_STRING, matched_stop=match.matched)
        elif seq.constraint is not None and seq.constraint.is_stopped():
            # The grammar is complete and nothing may follow: end now instead of spending
            # a step on the end-of-sequence token it would force.
            self._scheduler.finish(seq.request_id, "external")
            self._end(seq, FinishReason.STOP_TOKEN)

    def _constrain(
        self, logits: mx.array, seqs: list[Sequence]
    ) -> tuple[mx.array, list[str | None]]:
        """Logits with each constrained row's grammar mask applied (see constraints.py)."""
        matchers = [seq.constraint for seq in seqs]
        if all(m is None for m in matchers):
            return logits, [None] * len(seqs)
        mx.async_eval(logits)  # type: ignore[no-untyped-call]  # forward runs during masks
        started = time.monotonic()
        masked, errors = masked_logits(logits, matchers)
        self._metrics.grammar_mask_seconds.observe(time.monotonic() - started)
        return masked, errors

    # ---- endings -------------------------------------------------------------------------

    def fail_batch(self, seqs: list[Sequence], exc: BaseException, what: str) -> None:
        """A batched forward failed: its rows fail, and the batch (its K/V) is dropped."""
        log.exception("%s of %d requests failed", what, len(seqs))
        for seq in seqs:
            self.fail(seq, exc)
        self.applier.clear_batch()

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        self._scheduler.finish(seq.request_id, "external")
        self._end(seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _end(
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
        if self.prefix is not None and seq.request_id in self._seqs:
            healthy = reason is not FinishReason.ERROR  # a failed forward's K/V is suspect
            batch = self.applier.batch
            in_batch = healthy and seq.request_id in batch
            row = batch.ids.index(seq.request_id) if in_batch else 0
            self.prefix.finished(
                seq,
                batch.cache if in_batch else None,
                row,
                own_cache=self.applier.own_cache(seq.request_id) if healthy else None,
            )
        seq.phase = Phase.FINISHED
        seq.timings.finished = time.monotonic()
        self._seqs.pop(seq.request_id, None)  # its KV is dropped at the end of the step
        self.spec.forget_row(seq.request_id)
        self._on_finished()
        _, written_1h = creation_split(seq.request.cache_pins, seq.cached_tokens, seq.cache_written)
        usage = Usage(
            prompt_tokens=seq.prompt_len,
            completion_tokens=len(seq.generated),
            cached_tokens=seq.cached_tokens,
            cache_creation_tokens=seq.cache_written,
            cache_creation_1h_tokens=written_1h,
        )
        # Clear the status row before the final event: a client that sees its request
        # finished must not still find it in /v1/status.
        self._status.finish(
            seq.request_id,
            reason.value,
            len(seq.generated),
            decode_rate(seq),
            seq.timings.finished,
        )
        self._metrics.on_finish(seq.request_id, reason, seq.timings.finished)
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
        log_finished(seq, reason)


def _token_value(token: mx.array) -> int:
    value = token.item()
    assert isinstance(value, int)
    return value
