"""State points: hybrid and sliding-window models resumed between block boundaries.

A hybrid model's recurrent state (and a sliding-window layer's rotating window) cannot
be cut at an arbitrary token, so the block cache serves such a model only up to a block
with a state snapshot (store.py). A state point fills the gap after the last whole
block, at the positions a later request stops at:

- the prompt minus its last token (an exact repeat reads every token but the one whose
  logits it needs);
- the end of the reply (the next turn echoes prompt + reply and appends).

A point holds the tokens after its parent block (fewer than a block), the attention K/V
of those tokens, and every state layer's state after them (`PrefixStore` snapshot
layout). A request may take a point whose tokens are a prefix of its next tokens: unlike
an attention tail, never a part of one (the state is only valid at its end).

Points are kept least recently used first out within a byte budget, a few per parent.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from compat_serve.engine.kv_quant import is_batch_attention_layer
from compat_serve.engine.prefix.store import (
    BlockKV,
    LayerCaches,
    copy_tree,
)
from compat_serve.engine.prefix.store import kv_nbytes as _kv_nbytes
from compat_serve.engine.prefix.store import state_arrays as _state_arrays

# Points kept per parent block: the recent places conversations stop after it.
POINTS_PER_PARENT = 8

# Disk entries of points are filed under this prefix + their parent key, so a lookup of
# attention tails or child blocks never sees them.
POINT_PARENT = b"state:"

States = list[Any]  # per layer: None (attention) or (cache class, state tree, meta state)


@dataclass(frozen=True)
class StatePoint:
    tokens: tuple[int, ...]  # after the parent block, fewer than a block
    kv: BlockKV  # attention K/V of `tokens`: per layer [1, kv_heads, n, head_dim] or None
    states: States

    @property
    def nbytes(self) -> int:
        return _kv_nbytes(self.kv) + sum(
            a.nbytes for saved in self.states if saved is not None for a in _state_arrays(saved[1])
        )


def row_states(batch_cache: LayerCaches, row: int) -> States | None:
    """The state layers of row `row` of the decode batch's cache, as a request's own
    cache would hold them (mlx-lm's `extract`); None if a layer cannot be extracted."""
    states: States = []
    for layer in batch_cache:
        if is_batch_attention_layer(layer):
            states.append(None)
            continue
        extract = getattr(layer, "extract", None)
        if extract is None:
            return None
        own = extract(row)
        states.append((type(own), copy_tree(own.state), getattr(own, "meta_state", None)))
    mx.eval([a for saved in states if saved is not None for a in _state_arrays(saved[1])])
    return states


def longest_point(
    candidates: Sequence[tuple[Sequence[int], Any]], following: Sequence[int], limit: int
) -> tuple[int, Any] | None:
    """The candidate with the longest tokens that are a prefix of `following`, at most
    `limit` long: (its length, its value)."""
    best: tuple[int, Any] | None = None
    for tokens, value in candidates:
        n = len(tokens)
        longer = best is None or n > best[0]
        if longer and 0 < n <= limit and tuple(following[:n]) == tuple(tokens):
            best = (n, value)
    return best


class PointStore:
    """State points by (parent key, tokens), least recently used dropped past the budget."""

    def __init__(self, budget_bytes: int) -> None:
        self._points: collections.OrderedDict[tuple[bytes, tuple[int, ...]], StatePoint] = (
            collections.OrderedDict()
        )
        self._by_parent: dict[bytes, dict[tuple[int, ...], None]] = {}
        self._budget = budget_bytes
        self.bytes_in_use = 0

    def __len__(self) -> int:
        return len(self._points)

    def has(self, parent: bytes, tokens: Sequence[int]) -> bool:
        return (parent, tuple(tokens)) in self._points

    def match(
        self, parent: bytes, following: Sequence[int], limit: int, *, touch: bool = True
    ) -> StatePoint | None:
        """The longest point under `parent` whose tokens start `following` (at most
        `limit` tokens); `touch`: mark it used (not from another thread)."""
        siblings = list(self._by_parent.get(parent, ()))
        found = longest_point([(tokens, tokens) for tokens in siblings], following, limit)
        if found is None:
            return None
        key = (parent, found[1])
        point = self._points.get(key)
        if point is not None and touch:
            self._points.move_to_end(key)
        return point

    def put(self, parent: bytes, point: StatePoint) -> None:
        key = (parent, point.tokens)
        self._drop(key)
        siblings = self._by_parent.setdefault(parent, {})
        while len(siblings) >= POINTS_PER_PARENT:
            self._drop((parent, next(iter(siblings))))
            siblings = self._by_parent.setdefault(parent, {})
        self._points[key] = point
        siblings[point.tokens] = None
        self.bytes_in_use += point.nbytes
        while self.bytes_in_use > self._budget and self._points:
            self._drop(next(iter(self._points)))

    def _drop(self, key: tuple[bytes, tuple[int, ...]]) -> None:
        point = self._points.pop(key, None)
        if point is None:
            return
        self.bytes_in_use -= point.nbytes
        siblings = self._by_parent.get(key[0])
        if siblings is not None:
            siblings.pop(key[1], None)
            if not siblings:
                del self._by_parent[key[0]]

    def clear(self) -> None:
        self._points.clear()
        self._by_parent.clear()
        self.bytes_in_use = 0
