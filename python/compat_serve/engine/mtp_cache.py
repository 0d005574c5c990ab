"""The MTP head's own KV cache, per row, kept in step with the main model's (#45), and the
drafts chained through the head on it.

The head's decoder layer at position t reads the pair (hidden[t], token[t+1]) and attends
over the pairs of the row's earlier positions, as the reference implementations run it
(vllm's `deepseek_mtp.py`, EAGLE-style MTP) and as the checkpoints were trained. Its K/V
for those positions live here, handed over from the forwards the engine runs anyway:
`StepApplier` calls `MTPDrafter.observe` after every op it applies (engine/step_plan.py),
and for each position p the main model computed (a prefill chunk, a plain decode step,
the kept positions of a verify) the pair (hidden[p - 1], token[p]) goes through the
head's layer into its cache. So the head's cache is one position behind the main
model's: the hidden state of the row's last computed position waits (`_Row.pending`)
for the token after it, and the next draft's first step is that pair.

Rows are batched as the main model's caches are (engine/batch.py): a batch-1 `KVCache`
while the row prefills, merged into the head's `DecodeBatch` (one `BatchKVCache`, rows in
the main batch's order) when the main row joins, filtered out when it leaves. A verify
forward's positions are appended in one right-padded forward and the rejected ones rolled
back exactly as the main batch's (`DecodeBatch.rollback`): a rejected draft never stays.
Drafting runs k one-position steps over the whole batch, each chaining on the head's own
output, then trims those k positions again: the first step's pair comes back with the
next forward's hand-over, so the cache only ever holds verified positions.

A row whose prompt came partly from the prefix cache has no hidden states for the cached
positions: its head cache starts at the first computed position (RoPE is relative, so
positions count from there). That drafts a little worse for a while, never wrongly: the
main model verifies every draft. If the head's state ever disagrees with the main
model's (a row or batch mismatch, a failing op), it logs why and no row drafts again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from compat_serve.engine.batch import DecodeBatch
from compat_serve.engine.step_plan import (
    ClearBatch,
    Decode,
    Drop,
    Join,
    NewCache,
    PlanOp,
    Prefill,
    PrefillTogether,
    Restore,
    Rollback,
    Verify,
)

if TYPE_CHECKING:
    from compat_serve.engine.mtp_head import HiddenCapture, MTPHead
    from compat_serve.engine.sampling import RequestSampler

log = logging.getLogger("compat_serve.engine")


def _new_cache() -> KVCache:
    """A row's head cache while it prefills (mlx-lm's, as the model's layers get)."""
    cache: KVCache = KVCache()  # type: ignore[no-untyped-call]
    return cache


class HeadCacheError(RuntimeError):
    """The head's cache no longer follows the main model's (a bug: drafting stops)."""


@dataclass
class _Row:
    fed: int  # positions the main model holds for the row (its KV length)
    pending: mx.array | None = None  # [H]: the hidden state at position fed - 1


class MTPDrafter:
    """The head's per-row KV cache, following the main model's ops, and drafts on it."""

    def __init__(self, head: MTPHead, capture: HiddenCapture) -> None:
        self.head = head
        self.capture = capture
        self.own: dict[str, KVCache] = {}  # prefilling rows
        self.batch = DecodeBatch()  # decoding rows, in the main batch's order
        self.rows: dict[str, _Row] = {}
        self._verified: tuple[list[list[int]], mx.array] | None = None
        self.broken: str | None = None

    def ready(self, request_id: str, kv_length: int) -> bool:
        """Whether the row can draft: decoding, its head cache up to date with the main
        model's `kv_length` positions."""
        row = self.rows.get(request_id)
        return (
            self.broken is None
            and request_id in self.batch
            and row is not None
            and row.pending is not None
            and row.fed == kv_length
        )

    # ---- the hand-over: every op the main model's KV goes through -----------------------

    def observe(self, op: PlanOp) -> None:
        if self.broken is not None:
            return
        try:
            self._observe(op)
        except Exception as exc:
            log.exception("the MTP head's cache stopped following the model; drafting stops")
            self.broken = f"{op.kind}: {exc}"
            self.own.clear()
            self.rows.clear()
            self.batch.clear()
            self._verified = None

    def _observe(self, op: PlanOp) -> None:
        match op:
            case NewCache():
                self.own[op.request_id] = _new_cache()
                self.rows[op.request_id] = _Row(0)
            case Restore():  # positions with no hidden states: the head starts after them
                self.rows[op.request_id] = _Row(op.tokens)
            case Prefill():
                forwards = 2 if op.logits and len(op.tokens) > 1 else 1
                hidden = mx.concatenate(self.capture.latest(forwards), axis=1)
                self._prefilled(op.request_id, op.start, list(op.tokens), hidden)
            case PrefillTogether():
                longest = max(len(tokens) for tokens in op.token_lists)
                outputs = self.capture.latest(2 if longest > 1 else 1)
                for i, (request_id, tokens) in enumerate(
                    zip(op.request_ids, op.token_lists, strict=True)
                ):
                    # The first forward's rows are right-padded to the longest.
                    parts = [out[i : i + 1] for out in outputs]
                    if longest > 1:
                        parts[0] = parts[0][:, : len(tokens) - 1]
                    hidden = mx.concatenate(parts, axis=1)
                    start = self.rows[request_id].fed
                    self._prefilled(request_id, start, list(tokens), hidden)
            case Join():
                self.batch.add([(rid, [self.own.pop(rid)]) for rid in op.request_ids])
            case Drop():
                gone = set(op.request_ids)
                for request_id in gone:
                    self.own.pop(request_id, None)
                    self.rows.pop(request_id, None)
                self.batch.retain(r for r in self.batch.ids if r not in gone)
            case ClearBatch():
                for request_id in self.batch.ids:
                    self.rows.pop(request_id, None)
                self.batch.clear()
                self._verified = None
            case Decode():
                self._check_rows(op.request_ids)
                fed = [[token] for token in op.tokens]
                self._extend_batch(fed, self.capture.last, [1] * len(fed))
            case Verify():
                self._check_rows(op.request_ids)
                self._verified = ([list(row) for row in op.rows], self.capture.last)
            case Rollback():
                if self._verified is None:
                    raise HeadCacheError("a rollback without a verify")
                rows, hidden = self._verified
                self._verified = None
                width = hidden.shape[1]
                self._extend_batch(rows, hidden, [width - n for n in op.positions])

    def _prefilled(self, request_id: str, start: int, tokens: list[int], hidden: mx.array) -> None:
        """A prefill computed `tokens` from `start` (`hidden`: `[1, len, H]`)."""
        row = self.rows[request_id]
        cache = self.own[request_id]
        if row.fed != start:  # a gap: the cache restarts here
            row.pending = None
            cache = self.own[request_id] = _new_cache()
        pairs_hidden, pairs_tokens = hidden[:, :-1], tokens[1:]
        if row.pending is not None:
            pairs_hidden = mx.concatenate([row.pending[None, None], pairs_hidden], axis=1)
            pairs_tokens = tokens
        if pairs_tokens:
            self.head.extend(pairs_hidden, mx.array([pairs_tokens], dtype=mx.uint32), cache)
        row.pending = hidden[0, -1]
        row.fed = start + len(tokens)
        mx.eval(row.pending, [] if cache.keys is None else cache.state)

    def _extend_batch(self, fed: list[list[int]], hidden: mx.array, kept: list[int]) -> None:
        """A batch forward fed `fed[i]` to row i (`hidden`: `[rows, width, H]`, rows
        right-padded) and the main model kept its first `kept[i]` positions: append
        those positions' pairs (the padding and rejected ones rolled back)."""
        ids = self.batch.ids
        pending = [self.rows[request_id].pending for request_id in ids]
        if any(value is None for value in pending):
            raise HeadCacheError("a decoding row without a hidden state")
        width = hidden.shape[1]
        pairs_hidden = mx.concatenate(
            [mx.stack(pending)[:, None], hidden[:, : width - 1]],  # type: ignore[arg-type]
            axis=1,
        )
        tokens = mx.array([[*row, *[0] * (width - len(row))] for row in fed], dtype=mx.uint32)
        self.head.extend(pairs_hidden, tokens, self.batch.cache[0])
        self.batch.rollback([width - n for n in kept])
        for i, request_id in enumerate(ids):
            row = self.rows[request_id]
            row.pending = hidden[i, kept[i] - 1]
            row.fed += kept[i]
        layer = self.batch.cache[0]
        pending_now = [self.rows[r].pending for r in ids]
        mx.async_eval(layer.keys, layer.values, pending_now)  # type: ignore[no-untyped-call]

    def _check_rows(self, request_ids: Sequence[str]) -> None:
        if list(request_ids) != self.batch.ids:
            raise HeadCacheError(
                f"the head's rows {self.batch.ids} are not the batch's {list(request_ids)}"
            )

    # ---- drafting -----------------------------------------------------------------------

    def propose(
        self,
        request_ids: Sequence[str],
        last_tokens: Sequence[int],
        lengths: Sequence[int],
        samplers: Sequence[RequestSampler | None],
        vocab: int,
    ) -> tuple[list[list[int]], list[np.ndarray | None]]:
        """Up to `lengths[i]` drafts per row (rows with 0 draft nothing), the rows those of
        the batch in its order; sampled rows also get the head's distribution at each
        drafted position. Every row steps (a batched forward), and the cache is left as
        it was."""
        from compat_serve.engine.draft_model import DraftModel

        drafts: list[list[int]] = [[] for _ in request_ids]
        probs: list[list[np.ndarray]] = [[] for _ in request_ids]
        rows = [i for i, n in enumerate(lengths) if n > 0]
        if not rows:
            return drafts, [None] * len(request_ids)
        self._check_rows(request_ids)
        pending = [self.rows[request_id].pending for request_id in request_ids]
        if any(value is None for value in pending):
            raise HeadCacheError("a decoding row without a hidden state")
        hidden = mx.stack(pending)  # type: ignore[arg-type]
        tokens = mx.array(list(last_tokens), dtype=mx.uint32)
        picked = mx.array(rows)
        chosen_samplers = [samplers[i] for i in rows]
        cache = self.batch.cache[0]
        steps = 0
        try:
            for _ in range(max(lengths)):
                logits, hidden = self.head.step(hidden, tokens, cache)
                steps += 1
                chosen = DraftModel.pick(logits[picked], chosen_samplers, vocab)
                following = [0] * len(request_ids)
                for (token, q), i in zip(chosen, rows, strict=True):
                    drafts[i].append(token)
                    following[i] = token
                    if q is not None:
                        probs[i].append(q)
                tokens = mx.array(following, dtype=mx.uint32)
        finally:
            cache.trim(steps)  # the drafted positions leave; verified ones come back
        cut = [d[:n] for d, n in zip(drafts, lengths, strict=True)]
        dists = [np.stack(p[:n]) if p and n else None for p, n in zip(probs, lengths, strict=True)]
        return cut, dists
