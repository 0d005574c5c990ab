"""The Rust prefix cache through its Python binding (`compat_serve._native.PrefixCache`)."""

from __future__ import annotations

import hashlib
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve._native import (
    Admission,
    NewBlock,
    PrefixCache,
    PrefixCacheStats,
    SchedulerError,
)

BS = 4


def run(c: PrefixCache, rid: str, tokens: list[int], extra: bytes | None = None) -> list[NewBlock]:
    """Admits `tokens` and appends what was not cached, like the engine's prefill."""
    a = c.admit(rid, tokens, extra)
    return c.append(rid, tokens[a.cached_tokens :])


def test_a_shared_prefix_hits() -> None:
    c = PrefixCache(BS, 16)
    filled = run(c, "a", list(range(10)))
    assert [(b.block_id, b.index, b.start_token, b.is_new) for b in filled] == [
        (0, 0, 0, True),
        (1, 1, 4, True),
    ]
    assert c.release("a")
    a = c.admit("b", [*range(9), 99, 98, 97])
    assert isinstance(a, Admission)
    assert (a.cached_tokens, a.block_ids) == (8, [0, 1])
    assert [b.block_id for b in c.append("b", [8, 99, 98, 97])] == [2]
    assert c.num_tokens("b") == 12
    s = c.stats()
    assert isinstance(s, PrefixCacheStats)
    assert (s.query_tokens, s.hit_tokens, s.stored_blocks) == (22, 8, 3)
    assert (s.cached_blocks, s.in_use_blocks, s.free_blocks, s.num_requests) == (3, 3, 13, 1)
    assert s.hit_rate == pytest.approx(8 / 22)
    c.check_invariants()


def test_the_hit_leaves_at_least_one_token_to_compute() -> None:
    c = PrefixCache(BS, 16)
    run(c, "a", list(range(8)))
    c.release("a")
    assert c.lookup(list(range(8))) == 4  # all 8 cached, the last block is dropped
    assert c.lookup(list(range(9))) == 8
    assert c.lookup([]) == 0
    a = c.admit("b", list(range(8)))
    assert a.cached_tokens == 4
    # Recomputing the dropped block finds it cached: nothing to store.
    [block] = c.append("b", [4, 5, 6, 7])
    assert (block.block_id, block.is_new) == (1, False)


def test_lookup_acquires_nothing() -> None:
    c = PrefixCache(BS, 4)
    run(c, "a", list(range(9)))
    c.release("a")
    before = repr(c.stats())
    assert c.lookup(list(range(9))) == 8
    assert repr(c.stats()) == before


def test_concurrent_fills_are_deduplicated() -> None:
    c = PrefixCache(BS, 8)
    c.admit("a", list(range(9)))
    c.admit("b", list(range(9)))
    fa = c.append("a", list(range(9)))
    fb = c.append("b", list(range(9)))
    assert [b.is_new for b in fa] == [True, True]
    assert [b.is_new for b in fb] == [False, False]
    assert [b.block_id for b in fa] == [b.block_id for b in fb]
    assert c.stats().deduplicated_blocks == 2


def test_eviction_is_reported_oldest_free_first() -> None:
    c = PrefixCache(BS, 4)
    run(c, "a", list(range(8)))  # blocks 0, 1
    run(c, "b", list(range(100, 108)))  # blocks 2, 3
    c.release("a")
    c.release("b")
    assert c.take_evicted() == []
    filled = run(c, "c", list(range(200, 212)))
    # Each chain's tail goes first, `a` before `b`.
    assert [b.block_id for b in filled] == [1, 0, 3]
    assert c.take_evicted() == [1, 0, 3]
    assert c.take_evicted() == []
    assert c.stats().evictions == 3
    assert c.lookup(list(range(9))) == 0
    assert c.lookup(list(range(100, 109))) == 4


def test_a_full_pool_stops_caching_without_failing() -> None:
    c = PrefixCache(BS, 2)
    run(c, "a", list(range(8)))
    assert run(c, "b", list(range(50, 62))) == []
    assert c.stats().uncached_blocks == 1


def test_an_aborted_prefill_keeps_its_finished_blocks() -> None:
    c = PrefixCache(BS, 8)
    prompt = list(range(20))
    c.admit("a", prompt)
    c.append("a", prompt[:10])
    assert c.release("a")
    assert c.lookup(prompt) == 8


def test_a_salt_isolates() -> None:
    c = PrefixCache(BS, 8)
    run(c, "a", list(range(9)), b"key-1")
    c.release("a")
    assert c.lookup(list(range(9)), b"key-1") == 8
    assert c.lookup(list(range(9)), b"key-2") == 0
    assert c.lookup(list(range(9))) == 0
    assert all(b.is_new for b in run(c, "b", list(range(9)), b"key-2"))


def test_clear_evicts_free_blocks_only() -> None:
    c = PrefixCache(BS, 8)
    run(c, "a", list(range(5)))
    run(c, "b", list(range(10, 15)))
    c.release("a")
    c.clear()
    assert c.take_evicted() == [0]
    assert c.lookup(list(range(10, 15))) == 4
    assert c.stats().cached_blocks == 1


@pytest.mark.parametrize("kind", ["xxh3", "sha256"])
def test_block_hashes_chain_over_the_documented_layout(kind: str) -> None:
    c = PrefixCache(BS, 8, kind)
    assert c.hash_kind == kind
    tokens = [1, 2, 3, 4, 5, 6, 7, 0xDEADBEEF, 9]
    hashes = c.block_hashes(tokens, b"salt")
    assert len(hashes) == 2
    assert {len(h) for h in hashes} == {16 if kind == "xxh3" else 32}
    assert c.block_hashes(tokens[:4], b"salt") == hashes[:1]
    assert c.block_hashes(tokens, b"other")[0] != hashes[0]
    if kind == "sha256":

        def layout(parent: bytes, toks: list[int], extra: bytes) -> bytes:
            n = len(toks)
            return parent + struct.pack(f"<I{n}I", n, *toks) + struct.pack("<I", len(extra)) + extra

        first = hashlib.sha256(layout(bytes(32), tokens[:4], b"salt")).digest()
        second = hashlib.sha256(layout(first, tokens[4:8], b"")).digest()
        assert hashes == [first, second]


def test_misuse_raises() -> None:
    with pytest.raises(ValueError, match="unknown block hash"):
        PrefixCache(BS, 8, "md5")
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(0, 8)
    with pytest.raises(OverflowError):
        PrefixCache(BS, -1)
    c = PrefixCache(BS, 8)
    c.admit("a", [1, 2, 3])
    with pytest.raises(SchedulerError, match="duplicate"):
        c.admit("a", [1])
    with pytest.raises(SchedulerError, match="unknown request"):
        c.append("nope", [1])
    with pytest.raises(OverflowError):
        c.append("a", [-1])
    with pytest.raises(OverflowError):
        c.lookup([2**32])
    with pytest.raises(TypeError):
        c.lookup("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        c.admit("b", [1], "salt")  # type: ignore[arg-type]
    assert not c.release("nope")
    assert c.release("a")
    assert not c.release("a")
    c.check_invariants()


def test_a_long_prompt_hashes_without_the_gil_while_others_call_in() -> None:
    c = PrefixCache(16, 20_000)
    prompt = [i * 7 % 50_000 for i in range(128 * 1024)]
    run(c, "warm", prompt)
    c.release("warm")
    errors: list[BaseException] = []

    def preview() -> None:
        try:
            for _ in range(20):
                c.lookup(prompt)
                c.stats()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=preview) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(10):
        a = c.admit(f"r{i}", prompt)
        assert a.cached_tokens == len(prompt) - 16
        c.release(f"r{i}")
    for t in threads:
        t.join()
    assert errors == []
    c.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),  # request slot
            st.integers(0, 1),  # stem
            st.integers(0, 20),  # stem tokens
            st.lists(st.integers(0, 2), max_size=5),  # tail
        ),
        max_size=30,
    )
)
def test_hits_serve_the_kv_that_was_stored(ops: list[tuple[int, int, int, list[int]]]) -> None:
    """An engine-like loop with a K/V store keyed by block id: every hit must find the
    tokens it claims, through evictions in a small pool."""
    c = PrefixCache(BS, 6)
    store: dict[int, tuple[int, ...]] = {}
    open_ids: dict[int, str] = {}
    for n, (slot, stem, stem_len, tail) in enumerate(ops):
        if slot in open_ids:
            c.release(open_ids.pop(slot))
            continue
        prompt = [i % 5 if i < 3 or stem == 0 else 10 + i for i in range(stem_len)] + tail
        rid = open_ids[slot] = f"r{n}"
        a = c.admit(rid, prompt)
        for i, block in enumerate(a.block_ids):
            assert store[block] == tuple(prompt[: (i + 1) * BS])
        filled = c.append(rid, prompt[a.cached_tokens :])
        for block in c.take_evicted():
            store.pop(block, None)
        for b in filled:
            content = tuple(prompt[: b.start_token + BS])
            if b.is_new:
                store[b.block_id] = content
            else:
                assert store[b.block_id] == content
        c.check_invariants()
