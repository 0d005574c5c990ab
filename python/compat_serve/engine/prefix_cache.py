"""Prefix caching for the engine: the Rust `PrefixCache` bookkeeping plus the MLX
`PrefixStore`, driven at each point of a request's life (engine thread only).

- **admit**: the longest cached prefix (whole blocks, at least one token left to
  compute; on hybrid models only up to a block with a state snapshot) is held for the
  request, and the scheduler starts its prefill after it.
- **first prefill**: the held blocks are assembled into the request's fresh cache.
- **each computed chunk**: the blocks it filled are registered and their K/V copied, so
  a request aborted mid-prefill leaves its finished blocks cached; on hybrid models the
  state is snapshotted where a chunk ends on a block boundary.
- **finish**: blocks filled by generated tokens are stored too (a reply the client
  echoes back next turn is already cached), then the request's references are released.

Any fault in assembly falls back to recomputing the prefix: it is logged and counted,
never fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from compat_serve._native import NewBlock, PrefixCache
from compat_serve.engine.kv_events import KVEventPublisher, StoredBlock
from compat_serve.engine.prefix_store import (
    AttentionKV,
    LayerCaches,
    PrefixStore,
    batch_row_kv,
    request_kv,
)
from compat_serve.engine.prefix_tails import TailStore

if TYPE_CHECKING:
    from compat_serve.engine.sequence import Sequence

log = logging.getLogger("compat_serve.engine")


class PrefixCaching:
    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        hybrid: bool,
        hash_kind: str = "xxh3",
        snapshot_budget_bytes: int,
    ) -> None:
        self.block_size = block_size
        self.hybrid = hybrid
        self.cache = PrefixCache(block_size, num_blocks, hash_kind)
        self.store = PrefixStore(block_size, snapshot_budget_bytes)
        # Partial last blocks (attention-only models; hybrid state resumes at snapshots).
        self.tails = None if hybrid else TailStore(snapshot_budget_bytes)
        self.tail_hit_tokens = 0
        self.faults = 0
        # Store/evict notifications for cache-aware routers (--kv-events-endpoint).
        self.events: KVEventPublisher | None = None

    # ---- admission ------------------------------------------------------------------

    def admit(self, seq: Sequence) -> int:
        """Open the request's table; returns how many prompt tokens are cached."""
        prompt = list(seq.request.prompt_ids)
        salt = seq.request.cache_salt
        limit = len(prompt)
        if self.hybrid:
            limit = self._last_snapshot_end(prompt, salt) + 1
        admission = self.cache.admit(seq.request_id, prompt[:limit], salt)
        blocks = list(admission.block_ids)
        usable = next((i for i, b in enumerate(blocks) if not self.store.has_block(b)), None)
        if usable is not None:  # tensors missing: serve only what is really there
            self.faults += 1
            log.warning("%s: prefix cache block without tensors; recomputing", seq.request_id)
            self.cache.release(seq.request_id)
            admission = self.cache.admit(
                seq.request_id, prompt[: usable * self.block_size + 1], salt
            )
            blocks = list(admission.block_ids)
        cached = admission.cached_tokens
        seq.cache_tail = None
        if self.tails is not None:
            parent = self._parent_key(prompt[:cached], salt)
            hit = self.tails.match(parent, prompt[cached:], len(prompt) - 1 - cached)
            if hit is not None:
                self.cache.append(seq.request_id, prompt[cached : cached + hit.length])
                seq.cache_tail = (hit.tail.kv, hit.length)
                self.tail_hit_tokens += hit.length
                cached += hit.length
        seq.cached_blocks = blocks
        seq.cached_tokens = cached
        seq.cache_appended = cached
        seq.cache_written = 0
        return cached

    def _parent_key(self, tokens: list[int], salt: bytes | None) -> bytes:
        """What a tail after `tokens` (whole blocks) is stored under."""
        if not tokens:
            return b"root:" + (salt or b"")
        hashes: list[bytes] = self.cache.block_hashes(tokens, salt)
        return hashes[-1]

    def metrics(self) -> dict[str, float]:
        stats = self.cache.stats()
        hits = stats.hit_tokens + self.tail_hit_tokens
        return {
            "blocks": stats.cached_blocks,
            "bytes": self.store.bytes_in_use,
            "capacity_blocks": stats.num_blocks,
            "query_tokens": stats.query_tokens,
            "hit_tokens": hits,
            "hit_ratio": hits / stats.query_tokens if stats.query_tokens else 0.0,
            "evictions": stats.evictions,
            "faults": self.faults,
        }

    def preview(self, prompt: Seq[int], salt: bytes | None) -> tuple[int, int]:
        """(read, creation) tokens a request would get now; safe from any thread."""
        tokens = list(prompt)
        if self.hybrid:
            read = self._last_snapshot_end(tokens, salt)
        else:
            read = self.cache.lookup(tokens, salt)
        full = len(tokens) // self.block_size * self.block_size
        return read, max(0, full - read)

    def _last_snapshot_end(self, prompt: list[int], salt: bytes | None) -> int:
        """End of the last block with a state snapshot, leaving a token to compute."""
        hashes = self.cache.block_hashes(prompt, salt)
        usable = min(len(hashes), (len(prompt) - 1) // self.block_size)
        for i in range(usable - 1, -1, -1):
            if self.store.has_snapshot(hashes[i]):
                return (i + 1) * self.block_size
        return 0

    def restore(self, seq: Sequence, cache: LayerCaches) -> None:
        """Assemble the held prefix into the request's fresh cache (may raise)."""
        self.store.assemble(seq.cached_blocks, cache, seq.cache_tail)
        seq.cache_tail = None
        if self.hybrid and seq.cached_blocks:
            prompt = list(seq.request.prompt_ids[: seq.cached_tokens])
            last = self.cache.block_hashes(prompt, seq.request.cache_salt)[-1]
            self.store.restore_snapshot(last, cache)

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
        kv = request_kv(cache)
        for block in filled:
            if not block.is_new:
                continue
            self.store.store_block(block.block_id, kv, block.start_token)
            _count_written(seq, block.start_token, block.start_token + self.block_size)
        self._announce(seq, filled)
        end = start + len(tokens)
        if self.hybrid and end % self.block_size == 0 and end > 0 and filled:
            known = seq.known_tokens(0, end)
            last = self.cache.block_hashes(known, seq.request.cache_salt)[-1]
            if not self.store.has_snapshot(last):
                self.store.store_snapshot(last, cache)

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

    def _store_generated(self, seq: Sequence, kv: AttentionKV, row: int) -> None:
        # K/V exists for every token but the last sampled one (never fed).
        with_kv = seq.prompt_len + len(seq.generated) - 1
        if with_kv <= seq.cache_appended:
            return
        fed = seq.known_tokens(seq.cache_appended, with_kv)
        filled = self.cache.append(seq.request_id, fed)
        seq.cache_appended = with_kv
        self._drop_evicted()
        for block in filled:
            if block.is_new:
                self.store.store_block(block.block_id, kv, block.start_token, row)
                _count_written(seq, block.start_token, block.start_token + self.block_size)
        self._announce(seq, filled)

    def _store_tail(self, seq: Sequence, kv: AttentionKV, row: int) -> None:
        """Keep the tokens after the last full block (they have K/V up to
        `cache_appended`); prompt tokens stored anew count as cache creation."""
        assert self.tails is not None
        end = seq.cache_appended
        full = end // self.block_size * self.block_size
        if end == full:
            return
        tokens = seq.known_tokens(full, end)
        parent = self._parent_key(seq.known_tokens(0, full), seq.request.cache_salt)
        covered = self.tails.covered(parent, tokens)
        if covered >= len(tokens):
            return
        self.tails.store(parent, tokens, kv, full, row)
        _count_written(seq, full + covered, end)

    def preempted(self, seq: Sequence) -> None:
        """Its cache is gone and it recomputes from 0: start a fresh table."""
        self.cache.release(seq.request_id)
        self.cache.admit(seq.request_id, list(seq.request.prompt_ids[:1]), seq.request.cache_salt)
        seq.cached_blocks = []
        seq.cached_tokens = 0
        seq.cache_appended = 0
        seq.cache_tail = None

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq.request_id)
        self._drop_evicted()
        if self.events is not None:
            self.events.flush()

    # ---- KV events ----------------------------------------------------------------------

    def _drop_evicted(self) -> None:
        evicted = self.cache.take_evicted()
        self.store.drop_blocks(evicted)
        if self.events is not None and evicted:
            self.events.removed(evicted)

    def _announce(self, seq: Sequence, filled: list[NewBlock]) -> None:
        """Tell KV event subscribers about the blocks just stored (one hash pass over
        the request's tokens, only when events are on)."""
        if self.events is None:
            return
        new = [b for b in filled if b.is_new]
        if not new:
            self.events.flush()
            return
        end = new[-1].start_token + self.block_size
        known = seq.known_tokens(0, end)
        hashes = self.cache.block_hashes(known, seq.request.cache_salt)
        blocks = []
        for b in new:
            i = b.start_token // self.block_size
            parent = hashes[i - 1] if i > 0 else None
            tokens = known[b.start_token : b.start_token + self.block_size]
            blocks.append(StoredBlock(b.block_id, hashes[i], parent, tokens))
        self.events.stored(blocks)
        self.events.flush()


def _count_written(seq: Sequence, start: int, end: int) -> None:
    """Positions `[start, end)` were newly stored: count its prompt tokens the request did
    not read from the cache as cache creation (so read + creation never exceeds the
    prompt)."""
    seq.cache_written += max(0, min(end, seq.prompt_len) - max(start, seq.cached_tokens))
