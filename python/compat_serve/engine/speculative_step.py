"""A speculative decode step: draft, verify, roll back (engine/speculation.py explains
the method; this module runs it for the executor).

`SpeculativeStep` decides each row's draft (prompt lookup or a draft model, cut at stop
tokens and where a grammar refuses, capped where verifying would not pay), has the
applier verify them in one forward over the decode batch, accepts per row (greedy: the
longest prefix equal to the argmax; sampled: the speculative sampling rule), and has the
applier roll the rejected positions back. The accepted tokens then go to the executor
one by one (`StepHost.accept_token`), exactly as if each had been decoded on its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from compat_serve._native import GrammarError, Scheduler
from compat_serve.engine.applier import StepApplier
from compat_serve.engine.constraints import masked_logits
from compat_serve.engine.draft_model import DraftModel, DraftModelError
from compat_serve.engine.metrics import EngineMetrics
from compat_serve.engine.mtp_cache import MTPDrafter
from compat_serve.engine.mtp_head import HiddenCapture, MTPHeadError
from compat_serve.engine.sampling import accept_draft
from compat_serve.engine.sequence import Phase, Sequence
from compat_serve.engine.speculation import (
    Drafter,
    NGramDrafter,
    RowState,
    SpeculationConfig,
    SpeculationStats,
)
from compat_serve.engine.speculation_depth import DepthTuner
from compat_serve.engine.status import StatusBoard

log = logging.getLogger("compat_serve.engine")


class StepHost(Protocol):
    """What a speculative step needs from the executor."""

    def accept_token(self, seq: Sequence, token: int) -> None: ...

    def fail(self, seq: Sequence, exc: BaseException) -> None: ...

    def fail_batch(self, seqs: list[Sequence], exc: BaseException, what: str) -> None: ...


Drafts = tuple[list[list[int]], list[Any]]


class SpeculativeStep:
    def __init__(
        self,
        config: SpeculationConfig,
        applier: StepApplier,
        scheduler: Scheduler,
        status: StatusBoard,
        metrics: EngineMetrics,
        prefill_chunk: int,
        rollback_ok: bool,
    ) -> None:
        self._spec = config
        self._apply = applier
        self._scheduler = scheduler
        self._status = status
        self._metrics = metrics
        self.stats = SpeculationStats(config.mode)
        self.stats.depth = config.max_depth
        if config.auto_depth:
            self.stats.tuner = DepthTuner(config.max_depth)
            self.stats.depth = self.stats.tuner.depth
        self._drafter: Drafter | None = None
        self._draft_model: DraftModel | None = None
        self._mtp: MTPDrafter | None = None
        if config.mode == "off":
            return
        if not rollback_ok:
            self.stats.disabled_reason = "the model's cache cannot be rolled back"
            log.warning(
                "speculative decoding is off: this model's cache has layers that cannot "
                "roll back rejected tokens (not attention, sliding-window or recurrent state)"
            )
            return
        if config.mode == "ngram":
            self._drafter = NGramDrafter(config.ngram_min, config.ngram_max)
        elif config.mode == "mtp":
            assert config.mtp is not None  # engine/mtp_setup.py with_mtp_head
            try:
                self._mtp = MTPDrafter(config.mtp, HiddenCapture(applier.runner.model))
            except MTPHeadError as exc:
                self.stats.disabled_reason = str(exc)
                log.warning("speculative decoding is off: %s", exc)
                return
            applier.observers.append(self._mtp.observe)  # the head's cache follows the KV
        else:
            assert config.draft is not None  # SpeculationConfig.validate
            try:
                self._draft_model = DraftModel(config.draft, prefill_chunk)
            except DraftModelError as exc:
                self.stats.disabled_reason = str(exc)
                log.warning("speculative decoding is off: %s", exc)
                return
        metrics.extra_renderers.append(self.stats.render)

    @property
    def active(self) -> bool:
        return self._drafter is not None or self._draft_model is not None or self._mtp is not None

    def drafts_or_none(self, seqs: list[Sequence]) -> Drafts | None:
        """`drafts`, or None (a plain step) when drafting failed: the draft model is then
        off for good; the target's batch is intact."""
        try:
            return self.drafts(seqs)
        except Exception as exc:
            log.exception("drafting failed; this step decodes without drafts")
            self._draft_model = None
            self._mtp_off(f"drafting failed: {exc}")
            return None

    def _mtp_off(self, reason: str) -> None:
        """MTP drafts no more: its head's cache stops following the model's ops."""
        if self._mtp is not None:
            self._apply.observers.remove(self._mtp.observe)
            self._mtp = None
        self.stats.disabled_reason = reason

    def drafts(self, seqs: list[Sequence]) -> Drafts | None:
        """Each row's draft (and for draft-model sampled rows, the draft distribution), or
        None for a plain step: when no row drafts, or when the measured cost of verifying
        does not pay for the tokens the rows are expected to accept (`StepCosts`)."""
        rooms = self._draft_rooms(seqs)
        if not any(rooms):
            return None
        stats = self.stats
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
                [None if seq.ensure_sampler().greedy else seq.ensure_sampler() for seq in seqs],
                self._apply.runner.logits_width,
            )
            drafts, probs = proposal.drafts, proposal.probs
        elif self._mtp is not None:  # as the draft model: decide, then run the head
            mtp = self._mtp
            if mtp.broken is not None:
                self._mtp_off(f"the MTP head's cache: {mtp.broken}")
                return None
            rooms = [  # the main model holds all but the last emitted token
                room if mtp.ready(seq.request_id, seq.prompt_len + len(seq.generated) - 1) else 0
                for seq, room in zip(seqs, rooms, strict=True)
            ]
            if not any(rooms):
                return None
            cap = self._verify_width([[0] * room for room in rooms], rates)
            if not cap:
                return None
            drafts, probs = mtp.propose(
                [seq.request_id for seq in seqs],
                [seq.generated[-1] for seq in seqs],
                [min(room, cap) for room in rooms],
                [None if seq.ensure_sampler().greedy else seq.ensure_sampler() for seq in seqs],
                self._apply.runner.logits_width,
            )
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
        if self._draft_model is None and self._mtp is None:
            cap = self._verify_width(drafts, rates)
            if not cap:
                return None
            drafts = [d[:cap] for d in drafts]
        return drafts, probs

    def _verify_width(self, drafts: list[list[int]], rates: list[float]) -> int:
        if self._spec.cost_aware:
            return self.stats.costs.choose_width(drafts, rates)
        return max(len(draft) for draft in drafts)

    def _draft_rooms(self, seqs: list[Sequence]) -> list[int]:
        """How many tokens each row may draft: no more than its adaptive length, than what
        leaves the request running (max tokens, context) and, all rows together, than the
        free KV. A sampled row with a grammar drafts nothing from a draft model (cutting
        its draft where the grammar refuses would bias the sampling rule), and no row
        drafts past the point where its thinking budget forces the close."""
        kv_free = self._scheduler.kv_tokens_free
        limit = self._scheduler.token_limit
        rooms: list[int] = []
        for seq in seqs:
            state = self.stats.per_row.get(seq.request_id)
            if state is None:
                state = self.stats.per_row[seq.request_id] = RowState(self._spec.max_depth)
            out = len(seq.generated)
            room = min(
                state.k,
                self.stats.depth,
                seq.request.sampling.max_tokens - out - 1,
                limit - (seq.prompt_len + out) - 1,
                kv_free,
            )
            by_model = self._draft_model is not None or self._mtp is not None
            model_sampled = by_model and not seq.ensure_sampler().greedy
            budget_room = seq.budget.draft_room() if seq.budget is not None else None
            if budget_room is not None:  # a draft never reaches its reasoning's forced close
                room = min(room, budget_room)
            if room <= 0 or (model_sampled and seq.constraint is not None):
                room = 0
            room = room if room and state.wants_draft() else 0
            kv_free -= room
            rooms.append(room)
        return rooms

    def decode(
        self,
        host: StepHost,
        seqs: list[Sequence],
        drafts: Drafts,
        sampled: list[tuple[str, int]],
        started: float,
    ) -> None:
        """One forward verifies every row's draft; each row emits its accepted drafts plus
        the model's next token, and its rejected positions are rolled back (in the draft
        model's cache too). `started`: when drafting began (its cost counts)."""
        rows_drafts, probs = drafts
        try:
            rows = [
                [seq.generated[-1], *draft] for seq, draft in zip(seqs, rows_drafts, strict=True)
            ]
            logits = self._apply.verify([seq.request_id for seq in seqs], rows, rope_deltas(seqs))
            mx.eval(logits)
            emitted = self._verify(logits, seqs, rows_drafts, probs)
            width = max(len(row) for row in rows)
            # Positions kept: the fed token and the accepted drafts (the last emitted
            # token is, as always, fed next step).
            self._apply.rollback([width - _kept(tokens) for tokens in emitted])
            if self._draft_model is not None:
                self._draft_model.settle(
                    {s.request_id: _kept(t) - 1 for s, t in zip(seqs, emitted, strict=True)}
                )
        except Exception as exc:  # the batch is lost with the forward that failed
            host.fail_batch(seqs, exc, "a speculative decode step")
            return
        stats = self.stats
        stats.costs.observe(len(seqs), width, time.perf_counter() - started)
        stats.steps += 1
        stats.row_steps += len(seqs)
        stats.last_depth = max(len(draft) for draft in rows_drafts)
        for seq, draft, tokens in zip(seqs, rows_drafts, emitted, strict=True):
            if isinstance(tokens, GrammarError):
                host.fail(seq, tokens)
                continue
            accepted = len(tokens) - 1
            stats.record(len(draft), accepted)
            row = stats.per_row[seq.request_id]
            row.record(len(draft), accepted)
            row.drafted += len(draft)
            row.accepted += accepted
            self._status.update(
                seq.request_id, draft_tokens=row.drafted, accepted_tokens=row.accepted
            )
            for i, verified in enumerate(tokens):
                # Only the model's own token after the drafts can be replaced by a forced
                # close (`_draft_rooms`): a replaced draft would leave its K/V in the cache.
                token = seq.next_token(verified)
                assert token == verified or i == len(tokens) - 1, "a draft past the budget"
                sampled.append((seq.request_id, token))
                host.accept_token(seq, token)
                stats.emitted += 1
                if seq.phase is Phase.FINISHED or token in seq.stop_ids:
                    break
        if stats.tuner is not None and stats.tuner.after_verify(stats.costs, len(seqs)):
            stats.depth = stats.tuner.depth
            log.info(
                "speculative decoding: draft depth %d (--speculative-tokens auto)", stats.depth
            )

    def _verify(
        self,
        logits: mx.array,
        seqs: list[Sequence],
        drafts: list[list[int]],
        draft_probs: list[Any],
    ) -> list[list[int] | GrammarError]:
        """Per row, the tokens to emit: the accepted prefix of its draft plus one token
        sampled from the model (greedy: longest prefix equal to the argmax)."""
        plain_greedy = [seq.constraint is None and seq.ensure_sampler().greedy for seq in seqs]
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
            sampler = seq.ensure_sampler()
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
                    # `accept_token`, a stop token is never consumed): what follows is
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
        self.stats.per_row.pop(request_id, None)


def rope_deltas(seqs: list[Sequence]) -> list[int]:
    """Each row's M-RoPE position delta when a row has one (image rows of vision-language
    models); `[]` otherwise, so text batches call the model exactly as before."""
    deltas = [s.request.vision.rope_delta if s.request.vision is not None else 0 for s in seqs]
    return deltas if any(deltas) else []


def _record_logprobs(seq: Sequence, logits: mx.array) -> None:
    recorder = seq.ensure_sampler().logprobs
    if recorder is not None:
        recorder.record(logits)


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
