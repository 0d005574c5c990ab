"""TailStore: partial last blocks kept per parent block, longest match, bounded bytes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from compat_serve.engine.prefix.store import AttentionKV, CacheFault
from compat_serve.engine.prefix.tails import TAILS_PER_PARENT, TailStore, common_prefix


def positions_kv(n: int, layers: int = 2) -> AttentionKV:
    """K/V whose value at position p is p (one kv head, head_dim 2); layer 1 is state."""
    pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, n, 2))
    return [(pos, pos + 1000) if i % 2 == 0 else None for i in range(layers)]


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_the_longest_match_is_served_within_the_limit() -> None:
    store = TailStore(1 << 20)
    kv = positions_kv(40)
    store.store(b"p", [5, 6, 7], kv, 32, 0)
    store.store(b"p", [5, 9, 9, 9], kv, 32, 0)
    hit = store.match(b"p", [5, 6, 7, 8], limit=10)
    assert hit is not None and hit.length == 3 and hit.tail.tokens == (5, 6, 7)
    # The stored K/V is positions 32.. of the source, state layers stay None.
    keys = hit.tail.kv[0]
    assert keys is not None and keys[0][0, 0, :, 0].tolist() == [32.0, 33.0, 34.0]
    assert hit.tail.kv[1] is None
    limited = store.match(b"p", [5, 6, 7, 8], limit=2)
    assert limited is not None and limited.length == 2
    assert store.match(b"p", [1, 2], limit=10) is None
    assert store.match(b"other", [5, 6, 7], limit=10) is None


def test_a_longer_tail_supersedes_its_prefix_and_parents_keep_a_few() -> None:
    store = TailStore(1 << 20)
    kv = positions_kv(16)
    store.store(b"p", [1, 2], kv, 0, 0)
    store.store(b"p", [1, 2, 3], kv, 0, 0)
    assert len(store) == 1 and store.covered(b"p", [1, 2, 3, 4]) == 3
    for i in range(TAILS_PER_PARENT + 2):
        store.store(b"p", [100 + i], kv, 0, 0)
    assert len(store) == TAILS_PER_PARENT
    assert store.covered(b"p", [100 + TAILS_PER_PARENT + 1]) == 1  # newest kept
    assert store.covered(b"p", [100]) == 0  # oldest dropped


def test_bytes_stay_within_the_budget_least_recently_used_first() -> None:
    kv = positions_kv(16)
    one_tail = 2 * 4 * 2 * 4  # K and V, 4 positions x 2 dims of float32
    store = TailStore(3 * one_tail)
    for parent in (b"a", b"b", b"c"):
        store.store(parent, [1, 2, 3, 4], kv, 0, 0)
    assert store.bytes_in_use == 3 * one_tail
    assert store.match(b"a", [1], limit=5) is not None  # "a" is now the most recent
    store.store(b"d", [1, 2, 3, 4], kv, 0, 0)
    assert store.bytes_in_use == 3 * one_tail
    assert store.match(b"b", [1], limit=5) is None  # evicted
    assert store.match(b"a", [1], limit=5) is not None
    store.clear()
    assert store.bytes_in_use == 0 and len(store) == 0


def test_a_tail_past_the_source_is_refused() -> None:
    store = TailStore(1 << 20)
    with pytest.raises(CacheFault):
        store.store(b"p", [1, 2, 3], positions_kv(4), 2, 0)
    assert len(store) == 0 and store.bytes_in_use == 0
