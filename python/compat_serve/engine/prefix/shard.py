"""A follower's prefix cache: this rank's shard of every cached block, tail and disk
entry, under the ids rank 0's step plans name.

Rank 0 keeps the whole index (hashes, lookups, LRU and eviction decisions: cache.py,
storing.py) and records each K/V copy, drop, disk read and write as an op
(engine/step_plan.py). A follower applies them here in the same order, against its own
caches (`StepApplier`), so it holds the same blocks for its shard of the heads or
layers, and a `Restore` assembles what rank 0 assembled. It decides nothing: every id
comes from the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from compat_serve.engine.batch import DecodeBatch
from compat_serve.engine.prefix.disk import DiskStore
from compat_serve.engine.prefix.store import (
    AttentionKV,
    BlockKV,
    LayerCaches,
    PrefixStore,
    batch_row_kv,
    copy_positions,
    joined_pieces,
    request_kv,
)
from compat_serve.engine.step_plan import (
    DiskPut,
    DropBlocks,
    DropTails,
    Hold,
    PlanError,
    PrefixOp,
    PutBlock,
    Restore,
    Source,
    Stage,
    StoreBlock,
    StoreTail,
    Unhold,
)

log = logging.getLogger("compat_serve.engine")


class RankCaches(Protocol):
    """Where this rank's K/V lives (the follower's `StepApplier`, engine/applier.py):
    each prefilling request's own cache, and the decode batch."""

    @property
    def batch(self) -> DecodeBatch: ...

    def own_cache(self, request_id: str) -> LayerCaches | None: ...


class ShardPrefix:
    """Blocks by id, tails by id, the pieces each admitted request holds, and this rank's
    disk tier (its own namespace; None without `--cache-dir`)."""

    def __init__(
        self,
        block_size: int,
        disk: DiskStore | None = None,
        vote: Callable[[bool], bool] | None = None,
    ) -> None:
        # No budget of its own: rank 0 says what to drop.
        self.store = PrefixStore(block_size, snapshot_budget_bytes=0)
        self.tails: dict[int, BlockKV] = {}
        self.held: dict[str, tuple[BlockKV, int] | None] = {}
        self._staged: dict[Source, BlockKV] = {}
        self.disk = disk
        # Distributed: the collective after a disk `Stage` (every rank says if it found
        # the entries; rank 0 serves them only if all did).
        self.vote = vote
        self.faults = 0

    def apply(self, op: PrefixOp | Restore, applier: RankCaches) -> None:
        if isinstance(op, Restore):
            self._restore(op, applier)
            return
        try:
            self._apply(op, applier)
        except (PlanError, KeyError) as exc:
            raise PlanError(f"{op.kind}: {exc!r} (not the blocks rank 0 has)") from exc
        except (RuntimeError, ValueError) as exc:
            # A copy that fails here failed on rank 0 too (same shapes): it kept nothing
            # under that id either, and its index never serves it.
            self.faults += 1
            log.warning("prefix cache op %s failed (%s); skipped", op.kind, exc)

    def _apply(self, op: PrefixOp, applier: RankCaches) -> None:
        match op:
            case StoreBlock():
                kv, row = _request_kv(applier, op.request_id)
                self.store.put_block(op.block_id, copy_positions(kv, row, op.start, op.end))
            case PutBlock():
                self.store.put_block(op.block_id, self._source(op.source))
            case DropBlocks():
                self.store.drop_blocks(op.block_ids)
            case StoreTail():
                kv, row = _request_kv(applier, op.request_id)
                self.tails[op.tail_id] = copy_positions(kv, row, op.start, op.end)
            case DropTails():
                for tail_id in op.tail_ids:
                    self.tails.pop(tail_id, None)
            case Stage():
                self._stage(op)
            case Hold():
                pieces = [(self._source((kind, key)), n) for kind, key, n in op.pieces]
                self.held[op.request_id] = joined_pieces(pieces)
                self._staged.clear()
            case Unhold():
                self.held.pop(op.request_id, None)
            case DiskPut():
                self._disk_put(op, applier)

    def _stage(self, op: Stage) -> None:
        found = True
        for source in op.sources:
            kind, key = source
            if kind == "disk":
                entry = self.disk.load(key) if self.disk is not None else None
                if entry is None:
                    found = False
                    continue
                self._staged[source] = entry.kv
            else:
                self._staged[source] = self._source(source)
        if any(kind == "disk" for kind, _ in op.sources) and self.vote is not None:
            self.vote(found)

    def _source(self, source: Source) -> BlockKV:
        staged = self._staged.get(source)
        if staged is not None:
            return staged
        kind, key = source
        if kind == "block":
            return self.store.block_kv(int(key))
        if kind == "tail":
            return self.tails[int(key)]
        raise PlanError(f"source {source} was not staged")

    def _disk_put(self, op: DiskPut, applier: RankCaches) -> None:
        if self.disk is None:
            return
        if op.source[0] == "range":
            _, request_id, start, end = op.source
            kv, row = _request_kv(applier, str(request_id))
            pieces = copy_positions(kv, row, int(start), int(end))
        else:
            pieces = self._source((str(op.source[0]), str(op.source[1])))
        # Tokens stay with rank 0's index: a follower reads its files by key only.
        self.disk.put(op.key, op.parent, (), pieces)

    def _restore(self, op: Restore, applier: RankCaches) -> None:
        cache = applier.own_cache(op.request_id)
        if cache is None:
            raise PlanError(f"restore for {op.request_id}, which has no cache here")
        held = self.held.pop(op.request_id, None)
        if (held[1] if held is not None else 0) != op.tail_tokens:
            raise PlanError(f"{op.request_id}: holds {held and held[1]}, not {op.tail_tokens}")
        self.store.assemble(op.block_ids, cache, held)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def _request_kv(applier: RankCaches, request_id: str) -> tuple[AttentionKV, int]:
    """The request's K/V as rank 0 read it: its own cache while it prefills, else its
    row of the decode batch."""
    own: LayerCaches | None = applier.own_cache(request_id)
    if own is not None:
        return request_kv(own), 0
    batch = applier.batch
    if request_id not in batch:
        raise PlanError(f"{request_id} has no K/V here")
    row = batch.ids.index(request_id)
    return batch_row_kv(batch.cache, row), row
