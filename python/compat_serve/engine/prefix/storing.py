"""The storing side of the prefix cache (`PrefixStoring`, the base of `PrefixCaching` in
cache.py): the tiers it owns, and what goes into them as a request runs (engine thread
only).

- **each computed chunk**: the blocks it filled are registered and their K/V copied, so
  a request aborted mid-prefill leaves its finished blocks cached; on hybrid models the
  state is snapshotted where a chunk ends on a block boundary.
- **finish**: blocks filled by generated tokens are stored too (a reply the client
  echoes back next turn is already cached), and the partial block after them (a tail),
  then the request's references are released.

Every block and tail stored in RAM is also queued for the disk tier, if on (written by a
background thread), so eviction from RAM or a restart loses nothing on disk. Stored and
evicted blocks are announced to the KV event publisher the engine hands in (`events`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compat_serve._native import NewBlock, PrefixCache
from compat_serve.engine.kv_events import KVEventPublisher, StoredBlock
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.prefix.disk import DiskStore, parent_id, point_key, tail_key
from compat_serve.engine.prefix.keys import (
    IMAGE_PARENT,
    SNAPSHOTS,
    Images,
    count_written,
    images_of,
    root_key,
    snapshot_key,
    starts_image,
)
from compat_serve.engine.prefix.pins import DEFAULT_PIN_FRACTION, disk_pins, pin_request
from compat_serve.engine.prefix.points import (
    POINT_PARENT,
    PointStore,
    StatePoint,
    States,
    row_states,
)
from compat_serve.engine.prefix.store import (
    AttentionKV,
    BlockKV,
    LayerCaches,
    PrefixStore,
    batch_row_kv,
    cache_states,
    copy_positions,
    request_kv,
)
from compat_serve.engine.prefix.tails import TailStore
from compat_serve.engine.step_plan import (
    DiskPut,
    DropBlocks,
    DropTails,
    PlanOp,
    StoreBlock,
    StoreTail,
    Unhold,
)

if TYPE_CHECKING:
    from compat_serve.engine.sequence import Sequence

log = logging.getLogger("compat_serve.engine")


@dataclass(frozen=True)
class _BlockMeta:
    hash: bytes
    parent: bytes  # the chained hash of the block before, or the root key
    tokens: tuple[int, ...]


class PrefixStoring:
    """The prefix cache's tiers and everything that writes into them; `PrefixCaching`
    (cache.py) adds reading them back."""

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        hybrid: bool,
        hash_kind: str = "xxh3",
        snapshot_budget_bytes: int,
        disk: DiskStore | None = None,
        kv_format: KVFormat | None = None,
        pin_fraction: float = DEFAULT_PIN_FRACTION,
        events: KVEventPublisher | None = None,
    ) -> None:
        self.block_size = block_size
        # Quantized KV (--kv-bits): the format goes into every block's chained hash (as a
        # salt prefix), so blocks of two formats can never match each other.
        kv_format = kv_format or KVFormat()
        self._format_salt = f"kv:{kv_format.tag}|".encode() if kv_format.quantized else None
        self.hybrid = hybrid
        self.cache = PrefixCache(block_size, num_blocks, hash_kind)
        self.cache.set_pin_fraction(pin_fraction)
        self.store = PrefixStore(block_size, snapshot_budget_bytes)
        # Partial last blocks (attention-only models; hybrid state resumes at snapshots).
        self.tails = None if hybrid else TailStore(snapshot_budget_bytes)
        # Hybrid models: state points between block boundaries (points.py), same budget.
        self.points = PointStore(snapshot_budget_bytes) if hybrid else None
        self.partial_hit_tokens = 0  # read from child blocks and tails
        self.faults = 0
        # The disk tier (blocks, tails, and state snapshots of hybrid models); it asks the
        # pin table which files to keep.
        self.disk = disk
        self._disk_pin_view: tuple[int, dict[str, float]] | None = None
        if disk is not None:
            disk.pinned = self._disk_pins
        # Python's view of the RAM blocks: content and place in the chain, for partial
        # matches inside child blocks and for promotion from disk.
        self._meta: dict[int, _BlockMeta] = {}
        self._children: dict[bytes, dict[int, None]] = {}
        self._by_hash: dict[bytes, int] = {}
        self.promoted_hit_tokens = 0  # whole blocks read after the RAM prefix
        # Store/evict notifications for cache-aware routers (--kv-events-endpoint).
        self.events = events
        # Each K/V copy, drop and disk read or write as a step-plan op (the executor
        # sets it: `StepApplier.record`), so other ranks keep their shard of every block.
        self.record: Callable[[PlanOp], None] | None = None
        # Distributed: whether every rank found what a `Stage` of a disk entry read.
        self.vote: Callable[[bool], bool] | None = None
        self._staged = False

    def _disk_pins(self) -> dict[str, float]:
        """The disk keys of the blocks live pins cover (and, on hybrid models, of their
        state snapshots) with their expiry, in the order to let go of them (any thread).
        Rebuilt only when the pin table changed or its earliest pin expired (else ~1 ms
        per disk write past the cap with 1.6k pinned blocks): a pin past its expiry holds
        nothing even before admission drops it from the table."""
        generation = self.cache.pin_generation()
        known = self._disk_pin_view
        earliest = next(iter(known[1].values()), None) if known is not None else None
        stale = earliest is not None and earliest <= time.time()
        if known is None or known[0] != generation or stale:
            known = (generation, disk_pins(self.cache.pinned_blocks(), hybrid=self.hybrid))
            self._disk_pin_view = known
        return known[1]

    def _op(self, op: PlanOp) -> None:
        if self.record is not None:
            self.record(op)

    def _parent_key(self, tokens: list[int], salt: bytes | None, images: Images = None) -> bytes:
        """What a tail or child block after `tokens` (whole blocks) is stored under."""
        if not tokens:
            return root_key(salt)
        hashes: list[bytes] = self.cache.block_hashes(tokens, salt, images)
        return hashes[-1]

    def _salt(self, salt: bytes | None) -> bytes | None:
        """The request's cache salt, prefixed with the KV format when it is quantized."""
        if self._format_salt is None:
            return salt
        return self._format_salt + (salt or b"")

    def _seq_salt(self, seq: Sequence) -> bytes | None:
        return self._salt(seq.request.cache_salt)

    def fault(self, seq: Sequence, exc: BaseException) -> None:
        """Assembly failed: the request recomputes its prefix; nothing is served."""
        self.faults += 1
        log.warning(
            "%s: prefix cache fault (%s: %s); recomputing %d tokens",
            seq.request_id,
            type(exc).__name__,
            exc,
            seq.cached_tokens,
        )

    # ---- as tokens get computed ------------------------------------------------------

    def computed(self, seq: Sequence, cache: LayerCaches, start: int, tokens: Seq[int]) -> None:
        """Tokens `[start, start + len(tokens))` now have K/V in `cache` (a batch-1 cache
        whose position 0 is token 0)."""
        if start != seq.cache_appended:
            raise RuntimeError(f"{seq.request_id}: caching from {start}, at {seq.cache_appended}")
        filled = self.cache.append(seq.request_id, list(tokens))
        seq.cache_appended += len(tokens)
        self._drop_evicted()
        end = start + len(tokens)
        self._store_filled(seq, filled, request_kv(cache), 0, (start, end))
        if self.hybrid and end % self.block_size == 0 and end > 0 and filled:
            known = seq.known_tokens(0, end)
            last = self.cache.block_hashes(known, self._seq_salt(seq), images_of(seq))[-1]
            if not self.store.has_snapshot(last):
                self.store.store_snapshot(last, cache)
                if self.disk is not None:
                    snapshot = self.store.snapshot_states(last)
                    self.disk.put(snapshot_key(last), SNAPSHOTS, (), [], snapshot)
        elif self.points is not None and end == seq.prompt_len - 1 and seq.request.vision is None:
            # An exact repeat of this prompt resumes here (it computes the last token).
            self._store_point(seq, end, request_kv(cache), 0, cache_states(cache))

    def finished(
        self,
        seq: Sequence,
        batch_cache: LayerCaches | None,
        row: int = 0,
        own_cache: LayerCaches | None = None,
    ) -> None:
        """The request ends: store the blocks its generated tokens filled (from row `row`
        of the decode batch's cache, if it was decoding) and the partial block after
        them (from the batch, or from `own_cache` if it ended before joining the batch),
        then release its references."""
        try:
            if self.points is not None and batch_cache is not None:
                self._store_reply_end(seq, batch_cache, row)
            if self.tails is not None:
                kv: AttentionKV | None = None
                if batch_cache is not None:
                    kv = batch_row_kv(batch_cache, row)
                    self._store_generated(seq, kv, row)
                elif own_cache is not None:
                    kv, row = request_kv(own_cache), 0
                if kv is not None:
                    self._store_tail(seq, kv, row)
        except Exception as exc:  # caching is an optimisation; never fail a request
            self.fault(seq, exc)
        self.release(seq)

    def _store_reply_end(self, seq: Sequence, batch_cache: LayerCaches, row: int) -> None:
        """Hybrid models: the blocks the reply filled, and a state point (or a block's
        snapshot) at its end, where the next turn that echoes it resumes."""
        if seq.request.vision is not None:
            return
        kv = batch_row_kv(batch_cache, row)
        self._store_generated(seq, kv, row)
        end = seq.prompt_len + len(seq.generated) - 1
        if end != seq.cache_appended or end < seq.prompt_len:
            return
        states = row_states(batch_cache, row)
        if states is not None:
            self._store_point(seq, end, kv, row, states)

    def _store_point(
        self, seq: Sequence, end: int, kv: AttentionKV, row: int, states: States
    ) -> None:
        """Keep the state after the first `end` tokens (whose whole blocks are cached):
        as the snapshot of the block ending there, or as a state point after the last
        whole block, with the attention K/V of the tokens after it."""
        assert self.points is not None
        bs = self.block_size
        full = end // bs * bs
        salt = self._seq_salt(seq)
        parent = self._parent_key(seq.known_tokens(0, full), salt, None)
        if end == full:
            if not self.store.has_snapshot(parent):
                self.store.put_snapshot(parent, states)
                if self.disk is not None:
                    self.disk.put(snapshot_key(parent), SNAPSHOTS, (), [], states)
            return
        tokens = seq.known_tokens(full, end)
        if self.points.has(parent, tokens):
            return
        point = StatePoint(tuple(tokens), copy_positions(kv, row, full, end), states)
        # Not counted as cache creation: its prompt tokens are when the block holding
        # them is stored (counting both would count them twice).
        self.points.put(parent, point)
        if self.disk is not None:
            key = point_key(parent, tokens)
            self.disk.put(key, parent_id(POINT_PARENT + parent), tokens, point.kv, states)

    def _store_generated(self, seq: Sequence, kv: AttentionKV, row: int) -> None:
        # K/V exists for every token but the last sampled one (never fed).
        with_kv = seq.prompt_len + len(seq.generated) - 1
        if with_kv <= seq.cache_appended:
            return
        start = seq.cache_appended
        filled = self.cache.append(seq.request_id, seq.known_tokens(start, with_kv))
        seq.cache_appended = with_kv
        self._drop_evicted()
        self._store_filled(seq, filled, kv, row, (start, with_kv))

    def _store_tail(self, seq: Sequence, kv: AttentionKV, row: int) -> None:
        """Keep the tokens after the last full block (they have K/V up to
        `cache_appended`); prompt tokens stored anew count as cache creation."""
        assert self.tails is not None
        end = seq.cache_appended
        full = end // self.block_size * self.block_size
        vision = seq.request.vision
        image_at = vision.first_image_at_or_after(full) if vision is not None else None
        if image_at is not None:  # a tail is matched by token ids: keep images out of it
            end = min(end, image_at)
        if end == full:
            return
        tokens = seq.known_tokens(full, end)
        parent = self._parent_key(seq.known_tokens(0, full), self._seq_salt(seq), images_of(seq))
        covered = self.tails.covered(parent, tokens)
        if covered >= len(tokens):
            return
        self._op(StoreTail(self.tails.next_id, seq.request_id, full, end))
        tail = self.tails.store(parent, tokens, kv, full, row)
        count_written(seq, full + covered, end)
        if self.disk is not None:
            key = tail_key(parent, tokens)
            self._op(DiskPut(key, parent_id(parent), ("tail", str(tail.id))))
            self.disk.put(key, parent_id(parent), tokens, tail.kv)
        removed = self.tails.take_removed()
        if removed:
            self._op(DropTails(tuple(removed)))

    def preempted(self, seq: Sequence) -> None:
        """Its cache is gone and it recomputes from 0: start a fresh table."""
        self._unhold(seq)
        self.cache.release(seq.request_id)
        self.cache.admit(
            seq.request_id,
            list(seq.request.prompt_ids[:1]),
            self._seq_salt(seq),
            images_of(seq),
        )
        seq.cached_blocks = []
        seq.cached_tokens = 0
        seq.cache_appended = 0
        seq.cache_tail = None
        seq.cache_state = None

    def release(self, seq: Sequence) -> None:
        self._unhold(seq)
        pin_request(self.cache, seq)  # the blocks it computed, up to its breakpoints
        self.cache.release(seq.request_id)
        self._drop_evicted()
        if self.events is not None:
            self.events.flush()

    # ---- stored and evicted blocks ----------------------------------------------------

    def _store_filled(
        self,
        seq: Sequence,
        filled: list[NewBlock],
        kv: AttentionKV,
        row: int,
        appended: tuple[int, int],
    ) -> None:
        """Tokens `appended` were added to the request's table and `append` filled
        `filled`: copy the K/V of the new ones, record their place in the chain (one hash
        pass over the request's tokens), queue them for the disk tier and tell KV event
        subscribers. Blocks completed but not filled (the RAM tier had no room: every
        block in use) go straight to disk."""
        bs = self.block_size
        new = [b for b in filled if b.is_new]
        done = {b.start_token // bs for b in filled}
        spill = []
        if self.disk is not None and self.disk.writing:
            spill = [i for i in range(appended[0] // bs, appended[1] // bs) if i not in done]
        if not new and not spill:
            if self.events is not None:
                self.events.flush()
            return
        salt = self._seq_salt(seq)
        last = max([b.start_token // bs for b in new] + spill)
        known = seq.known_tokens(0, (last + 1) * bs)
        hashes = self.cache.block_hashes(known, salt, images_of(seq))
        stored = []
        for block in new:
            start = block.start_token
            self._op(StoreBlock(block.block_id, seq.request_id, start, start + bs))
            self.store.store_block(block.block_id, kv, start, row)
            count_written(seq, start, start + bs)
            i = start // bs
            meta = self._register(
                block.block_id,
                hashes,
                i,
                known,
                salt,
                self.store.block_kv(block.block_id),
                image=starts_image(seq, i, bs),
            )
            stored.append(self._stored_event(block.block_id, meta, i))
        for i in spill:
            assert self.disk is not None
            parent = hashes[i - 1] if i > 0 else root_key(salt)
            if starts_image(seq, i, bs):
                parent = IMAGE_PARENT + parent
            key, spilled = hashes[i].hex(), ("range", seq.request_id, i * bs, (i + 1) * bs)
            self._op(DiskPut(key, parent_id(parent), spilled))
            pieces = copy_positions(kv, row, i * bs, (i + 1) * bs)
            self.disk.put(key, parent_id(parent), known[i * bs : (i + 1) * bs], pieces)
            count_written(seq, i * bs, (i + 1) * bs)
        if self.events is not None:
            self.events.stored(stored)
            self.events.flush()

    def _register(
        self,
        block_id: int,
        hashes: list[bytes],
        i: int,
        tokens: list[int],
        salt: bytes | None,
        kv: BlockKV,
        *,
        image: bool = False,
    ) -> _BlockMeta:
        """Block `i` of a sequence (`hashes` its chain, `tokens` its tokens) is now cached
        in RAM under `block_id`. `image`: an image starts in it (`_starts_image`): it is
        found by its hash only, never as a child matched by token ids."""
        bs = self.block_size
        parent = hashes[i - 1] if i > 0 else root_key(salt)
        meta = _BlockMeta(hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
        self._forget(block_id)
        self._meta[block_id] = meta
        if not image:
            self._children.setdefault(parent, {})[block_id] = None
        self._by_hash[meta.hash] = block_id
        if self.disk is not None:
            disk_parent = parent_id(IMAGE_PARENT + parent if image else parent)
            self._op(DiskPut(meta.hash.hex(), disk_parent, ("block", str(block_id))))
            self.disk.put(meta.hash.hex(), disk_parent, meta.tokens, kv)
        return meta

    def _forget(self, block_id: int) -> None:
        meta = self._meta.pop(block_id, None)
        if meta is None:
            return
        children = self._children.get(meta.parent)
        if children is not None:
            children.pop(block_id, None)
            if not children:
                del self._children[meta.parent]
        if self._by_hash.get(meta.hash) == block_id:
            del self._by_hash[meta.hash]

    def _stored_event(self, block_id: int, meta: _BlockMeta, i: int) -> StoredBlock:
        return StoredBlock(block_id, meta.hash, meta.parent if i > 0 else None, list(meta.tokens))

    def _unhold(self, seq: Sequence) -> None:
        """Pieces it took at admission and never restored are let go (see `Hold`)."""
        if seq.cache_tail is not None:
            self._op(Unhold(seq.request_id))
            seq.cache_tail = None

    def _drop_evicted(self) -> None:
        evicted = self.cache.take_evicted()
        if evicted:
            self._op(DropBlocks(tuple(evicted)))
        self.store.drop_blocks(evicted)
        for block_id in evicted:
            self._forget(block_id)
        if self.events is not None and evicted:
            self.events.removed(evicted)

    def close(self) -> None:
        """Finish queued disk writes (shutdown)."""
        if self.disk is not None:
            self.disk.close()
