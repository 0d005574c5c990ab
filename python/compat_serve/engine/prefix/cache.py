"""Prefix caching for the engine: the Rust `PrefixCache` bookkeeping plus the MLX
`PrefixStore`, driven at each point of a request's life (engine thread only).

- **admit**: the longest cached prefix (whole blocks, at least one token left to
  compute; on hybrid models only up to a block with a state snapshot) is held for the
  request, and the scheduler starts its prefill after it. The whole blocks that continue
  it on disk (`--cache-dir`) are read and promoted into RAM blocks of the request's table
  (as many as the RAM tier can hold; the rest are assembled straight from what was
  read). Then, on attention-only models, the
  request takes the longest common prefix of its next tokens with any child block or
  tail of the last matched block (RAM or disk): a block's first k positions are valid
  for any sequence sharing its first k tokens, so every shared token is read.
- **first prefill**: the held blocks are assembled into the request's fresh cache.
- **each computed chunk** and **finish**: what gets stored, in storing.py
  (`PrefixStoring`, the base class that owns the tiers).

Any fault in assembly falls back to recomputing the prefix: it is logged and counted,
never fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compat_serve.engine.prefix.disk import DiskEntry, parent_id
from compat_serve.engine.prefix.keys import Images, images_of, root_key, snapshot_key, starts_image
from compat_serve.engine.prefix.metrics import prefix_metrics
from compat_serve.engine.prefix.pins import expire_pins, pin_request
from compat_serve.engine.prefix.points import POINT_PARENT, StatePoint, longest_point
from compat_serve.engine.prefix.store import BlockKV, LayerCaches, joined_pieces, restore_states
from compat_serve.engine.prefix.storing import PrefixStoring
from compat_serve.engine.prefix.tails import common_prefix
from compat_serve.engine.step_plan import Hold, PutBlock, Source, Stage

if TYPE_CHECKING:
    from compat_serve.engine.sequence import Sequence

log = logging.getLogger("compat_serve.engine")


@dataclass(frozen=True)
class _Partial:
    kv: BlockKV
    length: int
    from_disk: bool
    source: Source


class PrefixCaching(PrefixStoring):
    """Admission and restore: the longest cached prefix of a request, read back from RAM
    and disk into its fresh cache (the storing side is `PrefixStoring`)."""

    def _disk_load(self, key: str) -> DiskEntry | None:
        """A disk entry, if this rank (and, distributed, every rank) has it."""
        assert self.disk is not None
        entry = self.disk.load(key)
        if entry is not None and self.record is not None:
            self.record(Stage((("disk", key),)))
            self._staged = True
            if self.vote is not None and not self.vote(True):
                return None
        return entry

    # ---- admission ------------------------------------------------------------------

    def admit(self, seq: Sequence) -> int:
        """Open the request's table; returns how many prompt tokens are cached."""
        prompt = list(seq.request.prompt_ids)
        salt = self._seq_salt(seq)
        images = images_of(seq)
        limit = len(prompt)
        point: StatePoint | None = None
        if self.hybrid:
            end, point = self._hybrid_read(prompt, salt, images, load=True)
            limit = end - (len(point.tokens) if point is not None else 0) + 1
        expire_pins(self.cache)
        admission = self.cache.admit(seq.request_id, prompt[:limit], salt, images)
        blocks = list(admission.block_ids)
        usable = next((i for i, b in enumerate(blocks) if not self.store.has_block(b)), None)
        if usable is not None:  # tensors missing: serve only what is really there
            self.faults += 1
            log.warning("%s: prefix cache block without tensors; recomputing", seq.request_id)
            self.cache.release(seq.request_id)
            admission = self.cache.admit(
                seq.request_id, prompt[: usable * self.block_size + 1], salt, images
            )
            blocks = list(admission.block_ids)
        cached = admission.cached_tokens
        pieces: list[tuple[BlockKV, int, Source]] = []  # assembled after `blocks`
        disk_tokens = 0
        self._staged = False
        if self.disk is not None:
            promoted, overflow, disk_tokens = self._from_disk(seq, prompt[:limit], cached)
            blocks += promoted
            pieces += [(kv, self.block_size, source) for kv, source in overflow]
            cached += (len(promoted) + len(overflow)) * self.block_size
        seq.cache_state = None
        if point is not None and cached == limit - 1:
            n = len(point.tokens)
            self.cache.append(seq.request_id, prompt[cached : cached + n])
            pieces.append((point.kv, n, ("point", "")))
            seq.cache_state = point.states
            cached += n
        if not self.hybrid:
            limit = len(prompt) - 1 - cached
            vision = seq.request.vision
            image_at = vision.first_image_at_or_after(cached) if vision is not None else None
            if image_at is not None:
                # Tails and child blocks match by token ids, and an image's placeholder
                # ids are the same for every image: never read into an image this way.
                limit = min(limit, image_at - cached)
            hit = self._partial(
                self._parent_key(prompt[:cached], salt, images), prompt[cached:], limit
            )
            if hit is not None:
                self.cache.append(seq.request_id, prompt[cached : cached + hit.length])
                pieces.append((hit.kv, hit.length, hit.source))
                self.partial_hit_tokens += hit.length
                disk_tokens += hit.length if hit.from_disk else 0
                cached += hit.length
        if self.disk is not None:
            self.disk.hit_tokens += disk_tokens
        seq.cache_tail = joined_pieces([(kv, n) for kv, n, _ in pieces])
        if pieces or self._staged:
            self._op(Hold(seq.request_id, tuple((*source, n) for _, n, source in pieces)))
        seq.cache_hit = "disk" if disk_tokens else "prefix"
        seq.cached_blocks = blocks
        seq.cached_tokens = cached
        seq.cache_appended = cached
        seq.cache_written = 0
        pin_request(self.cache, seq)  # a hit refreshes the request's pins
        return cached

    def _partial(self, parent: bytes, following: list[int], limit: int) -> _Partial | None:
        """The longest prefix (at most `limit` tokens) of `following` that a child block or
        a tail of `parent` holds, in RAM or on disk (RAM preferred)."""
        if limit <= 0 or not following:
            return None
        best: _Partial | None = None
        for block_id in self._children.get(parent, ()):
            length = min(common_prefix(self._meta[block_id].tokens, following), limit)
            if length > 0 and (best is None or length > best.length):
                kv = self.store.block_kv(block_id)
                best = _Partial(kv, length, False, ("block", str(block_id)))
        if self.tails is not None:
            tail = self.tails.match(parent, following, limit)
            if tail is not None and (best is None or tail.length > best.length):
                best = _Partial(tail.tail.kv, tail.length, False, ("tail", str(tail.tail.id)))
        if self.disk is not None:
            known = best.length if best is not None else 0
            for key, tokens in self.disk.children(parent_id(parent)):
                length = min(common_prefix(tokens, following), limit)
                if length <= known:
                    continue
                entry = self._disk_load(key)
                if entry is not None and entry.tokens == tokens:
                    best, known = _Partial(entry.kv, length, True, ("disk", key)), length
        return best

    def _from_disk(
        self, seq: Sequence, prompt: list[int], cached: int
    ) -> tuple[list[int], list[tuple[BlockKV, Source]], int]:
        """Read the whole blocks after the first `cached` tokens that are on disk (or in
        RAM out of the chain), up to the first missing one, leaving a token to compute.
        They are appended to the request's table: those the pool has room for become RAM
        blocks (their ids are returned), the rest come back as K/V to assemble. Also
        returns how many tokens came from disk."""
        assert self.disk is not None
        bs = self.block_size
        start, usable = cached // bs, (len(prompt) - 1) // bs
        if start >= usable:
            return [], [], 0
        hashes = self.cache.block_hashes(prompt[: usable * bs], self._seq_salt(seq), images_of(seq))
        found: list[BlockKV] = []
        sources: list[Source] = []
        from_disk = 0
        for i in range(start, usable):
            ram = self._by_hash.get(hashes[i])
            if ram is not None and self.store.has_block(ram):
                found.append(self.store.block_kv(ram))
                sources.append(("block", str(ram)))
                continue
            entry = self._disk_load(hashes[i].hex())
            if entry is None or entry.tokens != tuple(prompt[i * bs : (i + 1) * bs]):
                break
            found.append(entry.kv)
            sources.append(("disk", hashes[i].hex()))
            from_disk += bs
        if not found:
            return [], [], 0
        in_ram = tuple(source for source in sources if source[0] == "block")
        if in_ram:  # the append below may evict them
            self._op(Stage(in_ram))
            self._staged = True
        self.promoted_hit_tokens += len(found) * bs
        filled = self.cache.append(seq.request_id, prompt[start * bs : (start + len(found)) * bs])
        self._drop_evicted()
        stored = []
        for block in filled:
            i = block.start_token // bs
            if block.is_new:
                self.store.put_block(block.block_id, found[i - start])
                self._op(PutBlock(block.block_id, sources[i - start]))
                kv = found[i - start]
                meta = self._register(
                    block.block_id,
                    hashes,
                    i,
                    prompt,
                    self._seq_salt(seq),
                    kv,
                    image=starts_image(seq, i, bs),
                )
                stored.append(self._stored_event(block.block_id, meta, i))
        if self.events is not None and stored:
            self.events.stored(stored)
        overflow = list(zip(found, sources, strict=True))[len(filled) :]
        return [b.block_id for b in filled], overflow, from_disk

    def metrics(self) -> dict[str, float]:
        return prefix_metrics(self)

    def preview(
        self, prompt: Seq[int], salt: bytes | None, images: Images = None
    ) -> tuple[int, int]:
        """(read, creation) tokens a request would get now; safe from any thread."""
        tokens = list(prompt)
        salt = self._salt(salt)
        if self.hybrid:
            read, _ = self._hybrid_read(tokens, salt, images, load=False)
        else:
            read = self.cache.lookup(tokens, salt, images)
        full = len(tokens) // self.block_size * self.block_size
        return read, max(0, full - read)

    def _hybrid_read(
        self, prompt: list[int], salt: bytes | None, images: Images, *, load: bool
    ) -> tuple[int, StatePoint | None]:
        """Where a hybrid model can resume, leaving a token to compute: the end of the
        last block with a state snapshot or the end of a state point after a block,
        whichever is later, and the point (read from disk if `load`; None for a block,
        or when not loading)."""
        bs = self.block_size
        cap = len(prompt) - 1
        hashes = self.cache.block_hashes(prompt, salt, images)
        usable = min(len(hashes), cap // bs)
        disk = self.disk
        points = images is None  # points match by token ids: never across images
        for i in range(usable, -1, -1):
            parent = hashes[i - 1] if i > 0 else root_key(salt)
            if points and i * bs < cap:
                found = self._point(parent, prompt[i * bs : (i + 1) * bs], cap - i * bs, load)
                if found is not None:
                    return i * bs + found[0], found[1]
            if i > 0 and (
                self.store.has_snapshot(parent)
                or (disk is not None and disk.has(snapshot_key(parent)))
            ):
                return i * bs, None
        return 0, None

    def _point(
        self, parent: bytes, following: list[int], limit: int, load: bool
    ) -> tuple[int, StatePoint | None] | None:
        """The longest state point after `parent` that `following` starts with (RAM,
        else disk): its length, and the point itself if `load` (or found in RAM)."""
        assert self.points is not None
        point = self.points.match(parent, following, limit, touch=load)
        best: tuple[int, StatePoint | None] | None = None
        if point is not None:
            best = (len(point.tokens), point)
        if self.disk is None:
            return best
        known = best[0] if best is not None else 0
        on_disk = [
            (tokens, key)
            for key, tokens in self.disk.children(parent_id(POINT_PARENT + parent))
            if len(tokens) > known
        ]
        while on_disk:
            found = longest_point(on_disk, following, limit)
            if found is None:
                break
            if not load:
                return found[0], None
            entry = self._disk_load(found[1])
            if entry is not None and entry.snapshot is not None:
                loaded = StatePoint(entry.tokens, entry.kv, entry.snapshot)
                self.points.put(parent, loaded)
                self.disk.hit_tokens += len(entry.tokens)
                return len(entry.tokens), loaded
            on_disk = [(t, k) for t, k in on_disk if k != found[1]]
        return best

    def restore(self, seq: Sequence, cache: LayerCaches) -> None:
        """Assemble the held prefix into the request's fresh cache (may raise)."""
        self.store.assemble(seq.cached_blocks, cache, seq.cache_tail)
        seq.cache_tail = None
        if self.hybrid and seq.cache_state is not None:
            states, seq.cache_state = seq.cache_state, None
            restore_states(states, cache)
        elif self.hybrid and seq.cached_tokens:
            prompt = list(seq.request.prompt_ids[: seq.cached_tokens])
            last = self.cache.block_hashes(prompt, self._seq_salt(seq), images_of(seq))[-1]
            if not self.store.has_snapshot(last) and self.disk is not None:
                entry = self.disk.load(snapshot_key(last))
                if entry is not None and entry.snapshot is not None:
                    self.store.put_snapshot(last, entry.snapshot)
            self.store.restore_snapshot(last, cache)
