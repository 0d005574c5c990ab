"""Pins in the disk tier (#44): past the disk cap, files of pinned blocks go only after
every unpinned one (or first while pins exceed `--cache-pin-fraction` of the cap, the
pin expiring first first), and a pinned prefix that RAM dropped is read back from disk
after traffic that evicts an unpinned one from both tiers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from compat_serve.engine.prefix.disk import DiskStore
from tests.python.test_prefix_cache import run
from tests.python.test_prefix_disk import disk_engine, prompt_of, tiny  # noqa: F401

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BLOCK = 16


def _put(store: DiskStore, key: str) -> None:
    kv = [(mx.zeros((1, 1, 4, 4)), mx.ones((1, 1, 4, 4)))]
    mx.eval(kv)  # the writer thread has no stream to evaluate on
    store.put(key, "p", [1, 2, 3, 4], kv)
    assert store.flush(timeout=5)


def _keys(store: DiskStore) -> list[str]:
    return [key for key in "abcdefghi" if store.has(key)]


def test_disk_eviction_skips_pins_until_none_is_unpinned_or_the_fraction_is_passed(
    tmp_path: Path,
) -> None:
    probe = DiskStore(tmp_path / "probe", "fp", None)
    _put(probe, "a")
    size = probe.bytes_in_use  # every file here has the same size
    probe.close()
    store = DiskStore(tmp_path, "fp", 4 * size, pin_fraction=0.5)  # pins: 2 files
    now = time.time()
    pins: dict[str, float] = {}
    store.pinned = lambda: pins
    for key in "abcd":
        _put(store, key)
    pins.update(a=now + 100, b=now + 50, c=now - 1)  # c's pin has expired
    _put(store, "e")  # the least recently used unpinned file goes: c (expired = unpinned)
    assert _keys(store) == ["a", "b", "d", "e"]
    _put(store, "f")
    _put(store, "g")
    assert _keys(store) == ["a", "b", "f", "g"]
    # Pins past the fraction (3 files > 2): the pin that expires first goes first.
    pins.update(f=now + 200)
    _put(store, "h")
    assert _keys(store) == ["a", "f", "g", "h"]
    # Nothing unpinned left (the fraction allows all): pinned files, earliest expiry first.
    store.pin_fraction = 1.0
    pins.update(g=now + 300, h=now + 400, i=now + 150)
    _put(store, "i")
    assert _keys(store) == ["f", "g", "h", "i"]
    assert store.bytes_in_use == 4 * size
    store.close()


def test_a_pinned_prefix_is_read_back_from_disk_after_a_flood(
    tiny: LoadedModel,  # noqa: F811
    tmp_path: Path,
) -> None:
    # RAM for 8 blocks (pins: 4), disk for 12 block files (pins: 6).
    engine = disk_engine(
        tiny, tmp_path, cache_memory_bytes=64 * 1024, cache_disk_bytes=12 * 8 * 1024 + 2048
    )
    try:
        prefix = engine.prefix
        assert prefix is not None and prefix.disk is not None and prefix.cache.num_blocks == 8
        pinned, plain = prompt_of(4 * BLOCK, seed=10), prompt_of(4 * BLOCK, seed=11)
        pin = ((4 * BLOCK, 3600),)
        run(engine, (*pinned, *prompt_of(5, seed=12)), max_tokens=1, pins=pin)
        first_expiry = prefix.cache.pins()[0][3]
        run(engine, (*plain, *prompt_of(5, seed=13)), max_tokens=1)
        # Unrelated prompts of 7 blocks each: RAM drops the pin to make room, and the
        # files written are worth three disk caps.
        for seed in range(20, 26):
            run(engine, prompt_of(7 * BLOCK, seed=seed), max_tokens=1)
        assert prefix.disk.flush()
        assert prefix.cache.lookup(list(pinned)) == 0  # out of RAM
        _, again = run(engine, (*pinned, *prompt_of(5, seed=14)), max_tokens=1, pins=pin)
        assert again.cached_tokens == 4 * BLOCK  # read back from disk
        (refreshed,) = prefix.cache.pins()
        assert refreshed[1] == 4 * BLOCK and refreshed[3] > first_expiry  # the hit refreshed it
        _, lost = run(engine, (*plain, *prompt_of(5, seed=15)), max_tokens=1)
        assert lost.cached_tokens == 0
    finally:
        engine.shutdown()
