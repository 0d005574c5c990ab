"""Executes the scheduler's plans with MLX, one step at a time, on the engine thread.

A step is: `schedule()` → drop the KV of preempted requests → one batched decode forward
for every running request (each row sampled with its own settings) → the planned
prefill chunks, each on its request's own cache, sampling the first token after a last
chunk → `update()`, which ends requests on stop tokens, max tokens or a full context →
requests whose prompt is done join the decode batch. Text, stop strings and stream
events are handled here per token; a stop string ends the request through
`Scheduler.finish`. A failing forward pass fails only the requests it computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import numpy as np

from compat_serve._native import GrammarError, Scheduler, SchedulerError
from compat_serve.engine.batch import DecodeBatch, can_rollback
from compat_serve.engine.constraints import masked_logits
from compat_serve.engine.draft_model import DraftModel, DraftModelError
from compat_serve.engine.metrics import EngineMetrics
from compat_serve.engine.prefix.cache import PrefixCaching
from compat_serve.engine.runner import ModelRunner, plain_kv
from compat_serve.engine.sampling import RequestSampler, accept_draft, sample_rows
from compat_serve.engine.sequence import Phase, Sequence
from compat_serve.engine.speculation import (
    Drafter,
    NGramDrafter,
    RowState,
    SpeculationConfig,
    SpeculationStats,
)
from compat_serve.engine.status import StatusBoard
from compat_serve.engine.types import EngineEvent, FinishReason, Usage

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
    """Owns the live requests and the decode batch; only the engine thread calls it."""

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
        self._runner = runner
        self._scheduler = scheduler
        self._status = status
        self._metrics = metrics
        self._progress_interval_s = progress_interval_s
        self._on_finished = on_finished
        self._seqs: dict[str, Sequence] = {}
        self._batch = DecodeBatch()
        self.prefix = prefix
        self._prefill_chunk = prefill_chunk
        self._spec = speculation or SpeculationConfig()
        self.spec_stats = SpeculationStats(self._spec.mode)
        self._drafter: Drafter | None = None
        self._draft_model: DraftModel | None = None
        if self._spec.mode != "off":
            if can_rollback(runner.new_cache()):
                self._start_speculation(prefill_chunk)
            else:
                self.spec_stats.disabled_reason = "the model's cache cannot be rolled back"
                log.warning(
                    "speculative decoding is off: this model's cache (rotating or recurrent "
                    "layers) cannot roll back rejected tokens"
                )

    def _start_speculation(self, prefill_chunk: int) -> None:
        if self._spec.mode == "ngram":
            self._drafter = NGramDrafter(self._spec.ngram_min, self._spec.ngram_max)
        else:
            assert self._spec.draft is not None  # SpeculationConfig.validate
            try:
                self._draft_model = DraftModel(self._spec.draft, prefill_chunk)
            except DraftModelError as exc:
                self.spec_stats.disabled_reason = str(exc)
                log.warning("speculative decoding is off: %s", exc)
                return
        self._metrics.extra_renderers.append(self.spec_stats.render)

    @property
    def _speculating(self) -> bool:
        return self._drafter is not None or self._draft_model is not None

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    # ---- commands ------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> None:
        sampling = seq.request.sampling
        cached = 0
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
        self._batch.retain(self._decoding_ids())
        self._metrics.on_step(len(self._batch), self._scheduler.kv_tokens_used)

    def abort_all(
        self, never_admitted: Iterable[Sequence] = (), reason: FinishReason = FinishReason.ABORTED
    ) -> None:
        for seq in [*self._seqs.values(), *never_admitted]:
            self._scheduler.abort(seq.request_id)
            self._end(seq, reason)
        self._batch.clear()
        self._metrics.on_step(0, self._scheduler.kv_tokens_used)

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
        self._batch.retain(self._decoding_ids())
        self._metrics.on_step(len(self._batch), self._scheduler.kv_tokens_used)
        return bool(plan.decode or plan.prefill)

    def _decoding_ids(self) -> list[str]:
        return [rid for rid, seq in self._seqs.items() if seq.phase is Phase.DECODE]

    def _preempt(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self._seqs[request_id]
            log.info(
                "%s: preempted (KV memory full); it will recompute %d tokens",
                request_id,
                seq.prompt_len + len(seq.generated),
            )
            seq.phase = Phase.QUEUED
            seq.cache = None
            seq.computed = 0
            if self.prefix is not None:
                self.prefix.preempted(seq)
            self._metrics.on_preempt(request_id)
            self._status.update(request_id, phase=Phase.QUEUED.value, computed_tokens=0)
        if request_ids:
            self._batch.retain(self._decoding_ids())

    def _join(self, seqs: list[Sequence]) -> None:
        joining = []
        for seq in seqs:
            assert seq.cache is not None
            joining.append((seq.request_id, seq.cache))
            seq.cache = None  # the batch owns it now
        try:
            self._batch.add(joining)
        except Exception as exc:
            log.exception("could not batch %d requests", len(seqs))
            for seq in [*seqs, *(self._seqs[r] for r in self._batch.ids)]:
                self._fail(seq, exc)
            self._batch.clear()

    def _decode(self, planned: list[str], sampled: list[tuple[str, int]]) -> None:
        rows = self._batch.ids
        if sorted(rows) != sorted(planned):
            raise SchedulerError(f"decode plan {planned} does not match the batch {rows}")
        seqs = [self._seqs[request_id] for request_id in rows]
        self._metrics.on_decode_step(len(seqs))
        started = time.perf_counter()
        if self._speculating:
            try:
                planned_drafts = self._drafts(seqs)
            except Exception as exc:  # the draft model's forward: the target's batch is intact
                log.exception("drafting failed; this step decodes without drafts")
                planned_drafts = None
                self._draft_model = None
                self.spec_stats.disabled_reason = f"drafting failed: {exc}"
            if planned_drafts is not None:
                self._decode_speculative(seqs, *planned_drafts, sampled, started)
                return
            started = time.perf_counter()
        try:
            logits = self._runner.decode_logits(
                self._batch.cache, [s.generated[-1] for s in seqs], *_rope_args(seqs)
            )
            logits, grammar_errors = self._constrain(logits, seqs)
            tokens = sample_rows(logits, [_sampler(s) for s in seqs])
            mx.eval(tokens)
            values: list[int] = tokens.tolist()  # type: ignore[assignment]
        except Exception as exc:  # the batch is lost with the forward that failed
            self._fail_batch(seqs, exc, "a decode step")
            return
        if self._speculating:
            self.spec_stats.costs.observe(len(seqs), 1, time.perf_counter() - started)
        for seq, token, grammar_error in zip(seqs, values, grammar_errors, strict=True):
            if grammar_error is not None:
                self._fail(seq, GrammarError(grammar_error))
                continue
            sampled.append((seq.request_id, token))
            self._accept_token(seq, token)

    # ---- speculative decoding (engine/speculation.py) -------------------------------------

    def _drafts(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[Any]] | None:
        """Each row's draft (and for draft-model sampled rows, the draft distribution), or
        None for a plain step: when no row drafts, or when the measured cost of verifying
        does not pay for the tokens the rows are expected to accept (`StepCosts`)."""
        rooms = self._draft_rooms(seqs)
        if not any(rooms):
            return None
        stats = self.spec_stats
        rates = [stats.per_row[seq.request_id].rate for seq in seqs]
        probs: list[Any] = [None] * len(seqs)
        if self._draft_model is not None:  # decide before paying for the draft forwards
            cap = self._verify_width([[0] * room for room in rooms], rates)
            if not cap:
                return None
            proposal = self._draft_model.propose(
                [seq.request_id for seq in seqs],
                [[*seq.request.prompt_ids, *seq.generated] for seq in seqs],
                [min(room, cap) for room in rooms],
                [None if _sampler(seq).greedy else _sampler(seq) for seq in seqs],
                self._runner.logits_width,
            )
            drafts, probs = proposal.drafts, proposal.probs
        else:
            assert self._drafter is not None
            drafts = [
                self._drafter.propose(seq.request_id, [*seq.request.prompt_ids, *seq.generated], n)
                if n
                else []
                for seq, n in zip(seqs, rooms, strict=True)
            ]
        for i, seq in enumerate(seqs):
            draft = drafts[i]
            for j, token in enumerate(draft):
                if token in seq.stop_ids:  # nothing after a stop token is needed
                    draft = draft[: j + 1]
                    break
            if draft and seq.constraint is not None:
                draft = draft[: seq.constraint.validate(draft)]
            drafts[i] = draft
            if probs[i] is not None:
                probs[i] = probs[i][: len(draft)] if draft else None
        if not any(drafts):
            return None
        if self._draft_model is None:
            cap = self._verify_width(drafts, rates)
            if not cap:
                return None
            drafts = [d[:cap] for d in drafts]
        return drafts, probs

    def _verify_width(self, drafts: list[list[int]], rates: list[float]) -> int:
        if self._spec.cost_aware:
            return self.spec_stats.costs.choose_width(drafts, rates)
        return max(len(draft) for draft in drafts)

    def _draft_rooms(self, seqs: list[Sequence]) -> list[int]:
        """How many tokens each row may draft: no more than its adaptive length, than what
        leaves the request running (max tokens, context) and, all rows together, than the
        free KV. A sampled row with a grammar drafts nothing from a draft model (cutting
        its draft where the grammar refuses would bias the sampling rule)."""
        kv_free = self._scheduler.kv_tokens_free
        limit = self._scheduler.token_limit
        rooms: list[int] = []
        for seq in seqs:
            state = self.spec_stats.per_row.get(seq.request_id)
            if state is None:
                state = self.spec_stats.per_row[seq.request_id] = RowState(self._spec.num_tokens)
            out = len(seq.generated)
            room = min(
                state.k,
                seq.request.sampling.max_tokens - out - 1,
                limit - (seq.prompt_len + out) - 1,
                kv_free,
            )
            model_sampled = self._draft_model is not None and not _sampler(seq).greedy
            if room <= 0 or (model_sampled and seq.constraint is not None):
                room = 0
            room = room if room and state.wants_draft() else 0
            kv_free -= room
            rooms.append(room)
        return rooms

    def _decode_speculative(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        probs: list[Any],
        sampled: list[tuple[str, int]],
        started: float,
    ) -> None:
        """One forward verifies every row's draft; each row emits its accepted drafts plus
        the model's next token, and its rejected positions are rolled back (in the draft
        model's cache too). `started`: when drafting began (its cost counts)."""
        try:
            rows = [[seq.generated[-1], *draft] for seq, draft in zip(seqs, drafts, strict=True)]
            logits = self._runner.verify_logits(self._batch.cache, rows, *_rope_args(seqs))
            mx.eval(logits)
            emitted = self._verify(logits, seqs, drafts, probs)
            width = max(len(row) for row in rows)
            # Positions kept: the fed token and the accepted drafts (the last emitted
            # token is, as always, fed next step).
            self._batch.rollback([width - _kept(tokens) for tokens in emitted])
            if self._draft_model is not None:
                self._draft_model.settle(
                    {s.request_id: _kept(t) - 1 for s, t in zip(seqs, emitted, strict=True)}
                )
        except Exception as exc:  # the batch is lost with the forward that failed
            self._fail_batch(seqs, exc, "a speculative decode step")
            return
        stats = self.spec_stats
        stats.costs.observe(len(seqs), width, time.perf_counter() - started)
        stats.steps += 1
        stats.row_steps += len(seqs)
        for seq, draft, tokens in zip(seqs, drafts, emitted, strict=True):
            if isinstance(tokens, GrammarError):
                self._fail(seq, tokens)
                continue
            accepted = len(tokens) - 1
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.emitted += len(tokens)
            row = stats.per_row[seq.request_id]
            row.record(len(draft), accepted)
            row.drafted += len(draft)
            row.accepted += accepted
            self._status.update(
                seq.request_id, draft_tokens=row.drafted, accepted_tokens=row.accepted
            )
            for token in tokens:
                sampled.append((seq.request_id, token))
                self._accept_token(seq, token)
                if seq.phase is Phase.FINISHED or token in seq.stop_ids:
                    break

    def _verify(
        self,
        logits: mx.array,
        seqs: list[Sequence],
        drafts: list[list[int]],
        draft_probs: list[Any],
    ) -> list[list[int] | GrammarError]:
        """Per row, the tokens to emit: the accepted prefix of its draft plus one token
        sampled from the model (greedy: longest prefix equal to the argmax)."""
        plain_greedy = [seq.constraint is None and _sampler(seq).greedy for seq in seqs]
        argmax: list[list[int]] = []
        if any(plain_greedy):
            argmax = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        out: list[list[int] | GrammarError] = []
        for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            positions = len(draft) + 1
            if plain_greedy[i]:
                _record_logprobs(seq, logits[i, :positions])
                out.append(_greedy_accept(argmax[i][:positions], draft))
                continue
            row = logits[i, :positions]
            if seq.constraint is not None:
                masked = self._masked_positions(seq, row, draft)
                if isinstance(masked, GrammarError):
                    out.append(masked)
                    continue
                row = masked
            _record_logprobs(seq, row)  # the verified tokens' own
            sampler = _sampler(seq)
            if sampler.greedy:
                targets: list[int] = mx.argmax(row, axis=-1).tolist()  # type: ignore[assignment]
                out.append(_greedy_accept(targets, draft))
            else:
                probs = np.array(sampler.probs(row), dtype=np.float32)
                out.append(accept_draft(probs, draft, sampler.rng, draft_probs[i]))
        return out

    def _masked_positions(
        self, seq: Sequence, row: mx.array, draft: list[int]
    ) -> mx.array | GrammarError:
        """A constrained row's logits at each drafted position plus one, each masked by
        the grammar state after the drafts before it (consumed, then rolled back)."""
        matcher = seq.constraint
        assert matcher is not None
        started = time.monotonic()
        masked: list[mx.array] = []
        consumed = 0
        try:
            for j in range(len(draft) + 1):
                if j and (draft[j - 1] in seq.stop_ids or matcher.is_stopped()):
                    # The request ends at draft j - 1 if it is accepted (as in
                    # `_accept_token`, a stop token is never consumed): what follows is
                    # never emitted, so it is left unmasked.
                    masked.append(row[j:])
                    break
                logits, (error,) = masked_logits(row[j : j + 1], [matcher])
                if error is not None:
                    return GrammarError(error)
                masked.append(logits)
                if j < len(draft) and draft[j] not in seq.stop_ids:
                    matcher.consume(draft[j])
                    consumed += 1
        except GrammarError as exc:
            return exc
        finally:
            if consumed:
                matcher.rollback(consumed)
            self._metrics.grammar_mask_seconds.observe(time.monotonic() - started)
        return mx.concatenate(masked, axis=0)

    def forget_row(self, request_id: str) -> None:
        if self._drafter is not None:
            self._drafter.forget(request_id)
        self.spec_stats.per_row.pop(request_id, None)

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
            if seq.cache is None:
                if start != seq.cached_tokens:
                    raise SchedulerError(f"{seq.request_id}: prefill from {start} without a cache")
                self._start_prefill(seq)
            assert seq.cache is not None
            if start != seq.computed:
                raise SchedulerError(f"{seq.request_id}: prefill from {start}, at {seq.computed}")
            tokens = seq.known_tokens(start, start + length)
            token = self._compute_chunk(seq, start, tokens, is_last)
        except SchedulerError:
            raise
        except Exception as exc:  # one bad request must never take the engine down
            log.exception("request %s failed in prefill", seq.request_id)
            self._fail(seq, exc)
            return
        self._chunk_done(seq, start, length, is_last, token, prefilled, sampled)

    def _whole_prompt_left(self, seq: Sequence, start: int, length: int, is_last: bool) -> bool:
        """Whether this chunk can join a batched prefill (`_prefill_together`): the last
        chunk of a request that starts now and has a token to sample, on a plain-attention
        model, short enough that padding it to its neighbours wastes little."""
        if (self.prefix is not None and self.prefix.hybrid) or seq.request.vision is not None:
            return False
        fresh = seq.cache is None and start == seq.cached_tokens
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
        caches = [seq.cache for seq, _, _, _ in chunks if seq.cache is not None]
        if len(caches) != len(chunks) or not all(plain_kv(cache) for cache in caches):
            return False
        token_lists = [seq.known_tokens(start, start + length) for seq, start, length, _ in chunks]
        try:
            logits, own = self._runner.last_logits_together(caches, token_lists)
            logits, grammar_errors = self._constrain(logits, [seq for seq, _, _, _ in chunks])
            if any(grammar_errors):
                return False  # one by one: the failing request fails alone
            tokens = sample_rows(logits, [_sampler(seq) for seq, _, _, _ in chunks])
            mx.eval(tokens)
            values: list[int] = tokens.tolist()  # type: ignore[assignment]
        except Exception:  # the requests' own caches are untouched: run them one by one
            log.exception("a batched prefill of %d requests failed; prefilling each", len(chunks))
            return False
        for (seq, start, length, is_last), cache, token, tokens_in in zip(
            chunks, own, values, token_lists, strict=True
        ):
            seq.cache = cache
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
        self._metrics.on_prefill(seq.request_id, prompt_done, seq.cache)
        self._status.update(seq.request_id, computed_tokens=prompt_done)
        if not is_last:
            self._log_progress(seq)
            return
        seq.timings.prompt_done = time.monotonic()
        seq.phase = Phase.DECODE
        self._status.update(seq.request_id, phase=Phase.DECODE.value)
        if token is not None:
            sampled.append((seq.request_id, token))
            self._accept_token(seq, token)

    def _compute_chunk(
        self, seq: Sequence, start: int, tokens: list[int], is_last: bool
    ) -> int | None:
        """Run one planned chunk; after a last chunk, sample the next token."""
        assert seq.cache is not None
        prefix = self.prefix
        if is_last and prefix is not None and prefix.hybrid:
            # End the prompt's last full block on its own forward pass, so the state at
            # that boundary can be snapshotted for the next turn.
            boundary = (start + len(tokens)) // prefix.block_size * prefix.block_size
            if start < boundary < start + len(tokens):
                head, tokens = tokens[: boundary - start], tokens[boundary - start :]
                self._runner.prefill(seq.cache, head, seq.request.vision, start)
                self._cache_computed(seq, start, head)
                start = boundary
        if not is_last:
            self._runner.prefill(seq.cache, tokens, seq.request.vision, start)
            self._cache_computed(seq, start, tokens)
            return None
        logits = self._runner.last_logits(seq.cache, tokens, seq.request.vision, start)
        token: int | None = None
        if seq.request.sampling.max_tokens == 0:
            mx.eval(logits)
        else:
            logits, (grammar_error,) = self._constrain(logits, [seq])
            if grammar_error is not None:
                raise GrammarError(grammar_error)
            token = _token_value(_sampler(seq)(logits))
        self._cache_computed(seq, start, tokens)
        return token

    def _cache_computed(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        if self.prefix is None or seq.cache is None:
            return
        try:
            self.prefix.computed(seq, seq.cache, start, tokens)
        except Exception as exc:  # caching is an optimisation: the request goes on
            self.prefix.fault(seq, exc)

    def _start_prefill(self, seq: Sequence) -> None:
        seq.cache = self._runner.new_cache()
        seq.phase = Phase.PREFILL
        if seq.sampler is None:
            seq.sampler = RequestSampler(seq.request.sampling)
        seq.timings.extra.setdefault("prefill_started", time.monotonic())
        self._status.update(seq.request_id, phase=Phase.PREFILL.value)
        self._metrics.on_start(seq.request_id)
        seq.computed = seq.cached_tokens
        if not seq.cached_tokens or self.prefix is None:
            return
        try:
            self.prefix.restore(seq, seq.cache)
        except Exception as exc:  # a cache fault never wedges the engine: recompute
            self.prefix.fault(seq, exc)
            seq.cache = self._runner.new_cache()
            prompt = list(seq.request.prompt_ids[: seq.cached_tokens])
            for i in range(0, len(prompt), self._prefill_chunk):
                chunk = prompt[i : i + self._prefill_chunk]
                self._runner.prefill(seq.cache, chunk, seq.request.vision, i)

    def _accept_token(self, seq: Sequence, token: int) -> None:
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
                self._fail(seq, exc)
                return
        match = seq.stops.feed(seq.detokenizer.add(token))
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

    def _fail_batch(self, seqs: list[Sequence], exc: BaseException, what: str) -> None:
        """A batched forward failed: its rows fail, and the batch (its K/V) is dropped."""
        log.exception("%s of %d requests failed", what, len(seqs))
        for seq in seqs:
            self._fail(seq, exc)
        self._batch.clear()

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
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
            in_batch = healthy and seq.request_id in self._batch
            row = self._batch.ids.index(seq.request_id) if in_batch else 0
            self.prefix.finished(
                seq,
                self._batch.cache if in_batch else None,
                row,
                own_cache=seq.cache if healthy else None,
            )
        seq.phase = Phase.FINISHED
        seq.timings.finished = time.monotonic()
        seq.cache = None
        self._seqs.pop(seq.request_id, None)
        self.forget_row(seq.request_id)
        self._on_finished()
        usage = Usage(
            prompt_tokens=seq.prompt_len,
            completion_tokens=len(seq.generated),
            cached_tokens=seq.cached_tokens,
            cache_creation_tokens=seq.cache_written,
        )
        # Clear the status row before the final event: a client that sees its request
        # finished must not still find it in /v1/status.
        self._status.finish(
            seq.request_id,
            reason.value,
            len(seq.generated),
            _decode_rate(seq),
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
        _log_finished(seq, reason)

    def _log_progress(self, seq: Sequence) -> None:
        last = seq.timings.extra.get("progress_logged", seq.timings.submitted)
        now = time.monotonic()
        if now - last >= self._progress_interval_s:
            seq.timings.extra["progress_logged"] = now
            started = seq.timings.extra.get("prefill_started", seq.timings.submitted)
            rate = seq.computed / max(now - started, 1e-9)
            log.info(
                "%s: prefill %d/%d tokens (%.0f tok/s, %d requests decoding)",
                seq.request_id,
                seq.computed,
                seq.prompt_len + len(seq.generated),
                rate,
                len(self._batch),
            )


def _sampler(seq: Sequence) -> RequestSampler:
    if seq.sampler is None:
        seq.sampler = RequestSampler(seq.request.sampling)
    return seq.sampler


def _record_logprobs(seq: Sequence, logits: mx.array) -> None:
    recorder = _sampler(seq).logprobs
    if recorder is not None:
        recorder.record(logits)


def _rope_args(seqs: list[Sequence]) -> tuple[list[int], ...]:
    """`(deltas,)`: each row's M-RoPE position delta when a row has one (image rows of
    vision-language models); `()` otherwise, so text batches call exactly as before."""
    deltas = [s.request.vision.rope_delta if s.request.vision is not None else 0 for s in seqs]
    return (deltas,) if any(deltas) else ()


def _kept(tokens: list[int] | GrammarError) -> int:
    """Positions a verified row keeps in the cache (its request fails on an error)."""
    return len(tokens) if isinstance(tokens, list) else 1


def _greedy_accept(targets: list[int], draft: list[int]) -> list[int]:
    """The longest prefix of `draft` equal to the model's argmax, then the argmax after
    it: exactly the tokens plain greedy decoding would produce."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return [*draft[:accepted], targets[accepted]]


def _token_value(token: mx.array) -> int:
    value = token.item()
    assert isinstance(value, int)
    return value


def _decode_rate(seq: Sequence) -> float | None:
    """Tokens per second after the first one (None before a second token)."""
    t = seq.timings
    end = t.finished or time.monotonic()
    decode_s = (end - t.first_token) if t.first_token else 0.0
    if len(seq.generated) < 2 or decode_s <= 0:
        return None
    return round((len(seq.generated) - 1) / decode_s, 2)


def _log_finished(seq: Sequence, reason: FinishReason) -> None:
    t = seq.timings
    end = t.finished or time.monotonic()
    ttft = (t.first_token - t.submitted) if t.first_token else None
    rate = _decode_rate(seq) or 0.0
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
