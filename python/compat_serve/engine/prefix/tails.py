"""Partial last blocks ("tails") of finished requests, for attention-only models.

The block cache serves whole blocks only, so a turn that continues the previous one would
recompute up to `block_size - 1` tokens the previous request already computed: the part
of its prompt + reply after its last full block. A tail keeps the K/V of those tokens,
keyed by the chained hash of the block before them (or by the salt, for a sequence
shorter than one block). At admission, after the longest run of whole blocks, the
request may also take the longest common prefix of its next tokens with any tail stored
under that block: K/V of a position depends only on the tokens up to it, so any prefix of
a tail is valid.

Hybrid models do not use tails: their state can resume only at a snapshot.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from compat_serve.engine.prefix.store import AttentionKV, BlockKV, copy_positions, kv_nbytes

# Tails kept per parent block: the most recent few conversations branching there.
TAILS_PER_PARENT = 4


@dataclass(frozen=True)
class Tail:
    tokens: tuple[int, ...]
    kv: BlockKV  # per layer [1, kv_heads, len(tokens), head_dim], or None
    id: int = 0  # what the step plan calls it (ranks that mirror this store)

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.kv)


@dataclass(frozen=True)
class TailHit:
    tail: Tail
    length: int  # tokens of `tail` the request uses


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class TailStore:
    """Tails under their parent key, least recently used dropped first past the budget."""

    def __init__(self, budget_bytes: int) -> None:
        self._by_parent: collections.OrderedDict[bytes, list[Tail]] = collections.OrderedDict()
        self._budget = budget_bytes
        self.bytes_in_use = 0
        self.next_id = 1  # the id the next stored tail gets
        self._removed: list[int] = []  # ids superseded or evicted since `take_removed`

    def __len__(self) -> int:
        return sum(len(tails) for tails in self._by_parent.values())

    def match(self, parent: bytes, following: Sequence[int], limit: int) -> TailHit | None:
        """The longest prefix (at most `limit` tokens) of `following` some tail holds."""
        best: TailHit | None = None
        for tail in self._by_parent.get(parent, ()):
            length = min(common_prefix(tail.tokens, following), limit)
            if length > 0 and (best is None or length > best.length):
                best = TailHit(tail, length)
        if best is not None:
            self._by_parent.move_to_end(parent)
        return best

    def covered(self, parent: bytes, tokens: Sequence[int]) -> int:
        """How many of `tokens` some stored tail already holds."""
        tails = self._by_parent.get(parent, ())
        return max((common_prefix(t.tokens, tokens) for t in tails), default=0)

    def store(
        self, parent: bytes, tokens: Sequence[int], kv: AttentionKV, start: int, row: int
    ) -> Tail:
        """Copy positions `[start, start + len(tokens))` of batch row `row` of `kv`."""
        copied = copy_positions(kv, row, start, start + len(tokens))
        tail = Tail(tuple(tokens), copied, self.next_id)
        self.next_id += 1
        old = self._by_parent.pop(parent, [])
        self.bytes_in_use -= sum(t.nbytes for t in old)
        # A stored tail this one extends (or equals) is superseded.
        others = [t for t in old if common_prefix(t.tokens, tokens) < len(t.tokens)]
        kept = [tail, *others][:TAILS_PER_PARENT]
        kept_ids = {t.id for t in kept}
        self._removed += [t.id for t in old if t.id not in kept_ids]
        self._by_parent[parent] = kept
        self.bytes_in_use += sum(t.nbytes for t in kept)
        self._evict()
        return tail

    def _evict(self) -> None:
        while self.bytes_in_use > self._budget and self._by_parent:
            _, tails = self._by_parent.popitem(last=False)
            self.bytes_in_use -= sum(t.nbytes for t in tails)
            self._removed += [t.id for t in tails]

    def take_removed(self) -> list[int]:
        """Ids of the tails dropped since the last call."""
        removed, self._removed = self._removed, []
        return removed

    def clear(self) -> None:
        self._by_parent.clear()
        self.bytes_in_use = 0
