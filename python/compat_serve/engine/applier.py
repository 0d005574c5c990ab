"""The applying side of a step: the KV caches and every forward pass over them.

`StepApplier` owns each prefilling request's batch-1 cache and the decode batch
(`DecodeBatch`), and is the only thing the executor reaches the model through. Each
public method is one op of the step plan (engine/step_plan.py): it is recorded, then
applied. `take_plan()` hands the recorded ops over as a `StepPlan`; `apply(plan)` runs a
plan's ops on another applier (a follower with the same weights), returning the logits
of its forwards in order, and reproduces the recorder's KV bit for bit.

Forward methods return lazy logits: sampling, grammars, stop strings and everything a
request's text needs stay with the deciding side (`StepExecutor`). `observers` are called
with each op once it is applied (the MTP head's cache follows the KV that way:
engine/mtp_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten

from compat_serve.engine.batch import DecodeBatch, LayerCaches
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.step_plan import (
    PREFIX_OPS,
    ClearBatch,
    Decode,
    Drop,
    Join,
    NewCache,
    PlanError,
    PlanOp,
    Prefill,
    PrefillTogether,
    Restore,
    Rollback,
    StepPlan,
    Verify,
)
from compat_serve.engine.verify_rollback import PADDING_MASKED, VerifyPass
from compat_serve.models.vision_input import VisionInput

if TYPE_CHECKING:
    from compat_serve.engine.prefix.shard import ShardPrefix


class StepApplier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.batch = DecodeBatch()
        self._own: dict[str, LayerCaches] = {}
        # Each request's LoRA adapter (set with its first cache, kept until dropped).
        self._adapter_of: dict[str, str] = {}
        self._ops: list[PlanOp] = []
        self._plans = 0
        # The verify pass just run, until its rollback: what the rollback of sliding-window
        # and recurrent layers needs, its rows' ids and M-RoPE deltas.
        self._verified: tuple[VerifyPass, list[str], list[int]] | None = None
        # Distributed rank 0 (distributed/leader.py): called after a forward op is
        # recorded and before it runs, to send the plan so far; each forward's logits are
        # then evaluated at once, so every rank runs the model's collectives in one order.
        self.before_forward: Callable[[], None] | None = None
        # With it set: the forwards run and the seconds they took (evaluated in the op:
        # the model's compute with its own collectives, the wait for the other ranks
        # included; the plan channel's time is not in it).
        self.forwards = 0
        self.forward_seconds = 0.0
        self._forward_started = 0.0
        self.observers: list[Callable[[PlanOp], None]] = []

    # ---- reading (the deciding side's prefix cache and metrics) --------------------

    def own_cache(self, request_id: str) -> LayerCaches | None:
        """The request's batch-1 cache while it prefills (None before and after)."""
        return self._own.get(request_id)

    def held_ids(self) -> list[str]:
        """Every request that has KV here: prefilling, then decoding."""
        return [*self._own, *self.batch.ids]

    @property
    def own_caches(self) -> dict[str, LayerCaches]:
        return dict(self._own)

    def take_plan(self) -> StepPlan | None:
        """The ops applied since the last plan, as the next plan (None: none)."""
        if not self._ops:
            return None
        plan = StepPlan(self._plans, tuple(self._ops))
        self._plans += 1
        self._ops = []
        return plan

    # ---- ops (recorded, then applied) ------------------------------------------------

    def new_cache(self, request_id: str, adapter: str | None = None) -> LayerCaches:
        self._ops.append(NewCache(request_id, adapter))
        cache = self._own[request_id] = self.runner.new_cache()
        if adapter is None:
            self._adapter_of.pop(request_id, None)
        else:
            self._adapter_of[request_id] = adapter
        self._applied()
        return cache

    def restored(self, op: Restore) -> None:
        """The deciding side's prefix cache has filled the request's fresh cache (it
        holds the blocks in this process); only the record is made here."""
        self._ops.append(op)
        self._applied()

    def record(self, op: PlanOp) -> None:
        """An op the deciding side's prefix cache applies itself (it holds the blocks in
        this process: `PrefixCaching.record`); only the record is made here."""
        self._ops.append(op)

    def prefill(
        self, request_id: str, start: int, tokens: list[int], vision: VisionInput | None = None
    ) -> None:
        self._ops.append(Prefill(request_id, start, tuple(tokens), False, vision is not None))
        self._forward_next()
        cache, rows = self._cache(request_id), self._row_adapter(request_id)
        self.runner.prefill(cache, tokens, vision, start, **rows)  # evaluated
        if self.before_forward is not None:
            self._forward_done()
        self._applied()

    def last_logits(
        self, request_id: str, start: int, tokens: list[int], vision: VisionInput | None = None
    ) -> mx.array:
        """`prefill` that returns the last position's (lazy) logits, `[1, vocab]`."""
        self._ops.append(Prefill(request_id, start, tuple(tokens), True, vision is not None))
        self._forward_next()
        cache, rows = self._cache(request_id), self._row_adapter(request_id)
        logits = self._ran(self.runner.last_logits(cache, tokens, vision, start, **rows))
        self._applied()
        return logits

    def prefill_together(
        self, request_ids: list[str], token_lists: list[list[int]]
    ) -> tuple[mx.array, Callable[[], None]]:
        """Batched prefill of several requests' remaining prompts: their logits, and a
        commit that installs the new caches and records the op. Without the commit (the
        planner prefills them one by one instead) nothing happened here."""
        caches = [self._cache(request_id) for request_id in request_ids]
        rows = self._adapters(request_ids)
        logits, own = self.runner.last_logits_together(caches, token_lists, **rows)

        def commit() -> None:
            self._ops.append(
                PrefillTogether(tuple(request_ids), tuple(tuple(t) for t in token_lists))
            )
            self._own.update(zip(request_ids, own, strict=True))
            self._applied()

        return logits, commit

    def decode(
        self, request_ids: list[str], tokens: list[int], rope_deltas: Sequence[int] = ()
    ) -> mx.array:
        self._check_rows(request_ids)
        self._ops.append(Decode(tuple(request_ids), tuple(tokens), tuple(rope_deltas)))
        self._forward_next()
        deltas = (list(rope_deltas),) if rope_deltas else ()
        adapters = self._adapters(request_ids)
        logits = self._ran(self.runner.decode_logits(self.batch.cache, tokens, *deltas, **adapters))
        self._applied()
        return logits

    def verify(
        self, request_ids: list[str], rows: list[list[int]], rope_deltas: Sequence[int] = ()
    ) -> mx.array:
        self._check_rows(request_ids)
        self._ops.append(Verify(tuple(request_ids), tuple(map(tuple, rows)), tuple(rope_deltas)))
        self._forward_next()
        deltas = (list(rope_deltas),) if rope_deltas else ()
        adapters = self._adapters(request_ids)
        cache = self.batch.cache
        verified = VerifyPass.before(cache, rows, self.runner.model_type in PADDING_MASKED)
        logits = self.runner.verify_logits(cache, rows, *deltas, **adapters)
        verified.after_forward(cache)
        self._verified = (verified, list(request_ids), list(rope_deltas))
        logits = self._ran(logits)
        self._applied()
        return logits

    def rollback(self, positions: list[int]) -> None:
        """Drop each row's rejected positions of the verify pass just run; rows whose
        recurrent state saw rejected tokens get it rebuilt (engine/verify_rollback.py)."""
        self._ops.append(Rollback(tuple(positions)))
        last, self._verified = self._verified, None
        verified = None
        if last is not None:
            verified, request_ids, rope_deltas = last

            def forward(cache: LayerCaches, rows: list[int], tokens: list[list[int]]) -> None:
                # A re-feed is a forward: the other ranks get the rollback (they run the same
                # re-feed, in the same order) before this rank runs its collectives.
                self._forward_next()
                deltas = ([rope_deltas[i] for i in rows],) if rope_deltas else ()
                adapters = self._adapters([request_ids[i] for i in rows])
                self.runner.verify_logits(cache, tokens, *deltas, **adapters)  # logits unused
                if self.before_forward is not None:
                    mx.eval([layer.state for layer in cache])
                    self._forward_done()

            verified.refeed(self.batch.cache, positions, forward)
        self.batch.rollback(positions, verified)
        self._applied()

    def join(self, request_ids: list[str]) -> None:
        """Move these requests' own caches into the batch (their caches leave even if
        merging fails: the caller then clears the batch)."""
        self._ops.append(Join(tuple(request_ids)))
        joining = [(request_id, self._own.pop(request_id)) for request_id in request_ids]
        self.batch.add(joining)
        self._applied()

    def drop(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        self._ops.append(Drop(tuple(request_ids)))
        for request_id in request_ids:
            self._own.pop(request_id, None)
            self._adapter_of.pop(request_id, None)
        gone = set(request_ids)
        self.batch.retain(r for r in self.batch.ids if r not in gone)
        self._applied()

    def clear_batch(self) -> None:
        self._ops.append(ClearBatch())
        self._verified = None
        for request_id in self.batch.ids:
            self._adapter_of.pop(request_id, None)
        self.batch.clear()
        self._applied()

    # ---- a follower ----------------------------------------------------------------------

    def apply(self, plan: StepPlan, prefix: ShardPrefix | None = None) -> list[mx.array]:
        """Run a recorded plan's ops here; the logits of its forwards (decode, verify,
        last prefill chunks, batched prefills), evaluated, in order. `prefix` holds this
        rank's shard of the prefix cache (its ops and restores go there)."""
        if plan.step != self._plans:
            raise PlanError(f"plan {plan.step} arrived, expected plan {self._plans}")
        outputs: list[mx.array] = []
        for op in plan.ops:
            logits = self._apply_op(op, prefix)
            if logits is not None:
                mx.eval(logits)
                outputs.append(logits)
        self._ops = []  # a follower keeps no record of its own
        self._plans += 1
        return outputs

    def _apply_op(self, op: PlanOp, prefix: ShardPrefix | None) -> mx.array | None:
        if isinstance(op, Prefill | Restore) and op.request_id not in self._own:
            raise PlanError(f"{op.kind} for {op.request_id}, which has no cache here")
        if isinstance(op, (Restore, *PREFIX_OPS)):
            if prefix is None:
                raise PlanError(f"{op.kind}: this follower has no prefix cache")
            prefix.apply(op, self)  # type: ignore[arg-type]
            return None
        match op:
            case NewCache():
                self.new_cache(op.request_id, op.adapter)
            case Prefill(vision=True):
                raise PlanError(f"{op.request_id}: the plan has no image inputs")
            case Prefill(logits=True):
                return self.last_logits(op.request_id, op.start, list(op.tokens))
            case Prefill():
                self.prefill(op.request_id, op.start, list(op.tokens))
            case PrefillTogether():
                logits, commit = self.prefill_together(
                    list(op.request_ids), [list(t) for t in op.token_lists]
                )
                commit()
                return logits
            case Decode():
                return self.decode(list(op.request_ids), list(op.tokens), op.rope_deltas)
            case Verify():
                rows = [list(row) for row in op.rows]
                return self.verify(list(op.request_ids), rows, op.rope_deltas)
            case Rollback():
                self.rollback(list(op.positions))
            case Join():
                self.join(list(op.request_ids))
            case Drop():
                self.drop(list(op.request_ids))
            case ClearBatch():
                self.clear_batch()
        return None

    # ---- helpers -----------------------------------------------------------------------

    def _applied(self) -> None:
        """The op just recorded has been applied: tell the observers."""
        if self.observers:
            op = self._ops[-1]
            for observer in self.observers:
                observer(op)

    def _forward_next(self) -> None:
        if self.before_forward is not None:
            self.before_forward()
            self._forward_started = time.perf_counter()

    def _ran(self, logits: mx.array) -> mx.array:
        if self.before_forward is not None:
            mx.eval(logits)
            self._forward_done()
        return logits

    def _forward_done(self) -> None:
        self.forwards += 1
        self.forward_seconds += time.perf_counter() - self._forward_started

    def _cache(self, request_id: str) -> LayerCaches:
        cache = self._own.get(request_id)
        if cache is None:
            raise PlanError(f"{request_id} has no cache of its own")
        return cache

    # The runner's `adapters` argument is passed only when a row has an adapter: the
    # base model's calls stay exactly what they were (tests wrap those methods).

    def _adapters(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """`adapters=` with each row's adapter, when any row has one."""
        if not self._adapter_of:
            return {}
        adapters = [self._adapter_of.get(request_id) for request_id in request_ids]
        return {"adapters": adapters} if any(adapters) else {}

    def _row_adapter(self, request_id: str) -> dict[str, Any]:
        adapter = self._adapter_of.get(request_id)
        return {} if adapter is None else {"adapter": adapter}

    def _check_rows(self, request_ids: list[str]) -> None:
        if request_ids != self.batch.ids:
            raise PlanError(f"rows {request_ids} do not match the batch {self.batch.ids}")


def kv_arrays(cache: LayerCaches) -> list[Any]:
    """Every array and number of a cache's state, layer by layer (what replays
    compare)."""
    out: list[Any] = []
    for layer in cache:
        flat: list[tuple[str, Any]] = tree_flatten(layer.state)  # type: ignore[assignment]
        out.extend(value for _, value in flat)
    return out
