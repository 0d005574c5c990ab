"""`cache_control` pins in the disk tier (#44): the disk tier deletes unpinned files first
(least recently used first), pinned ones only when no unpinned file is left or when they
alone take more than the pin fraction of the cap, and then the pin that expires first; a
pinned prefix that RAM and a flood of other prompts pushed out comes back from disk."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.prefix.cache import PrefixCaching
from compat_serve.engine.prefix.disk import DiskStore
from compat_serve.engine.prefix.pins import disk_pins
from compat_serve.engine.types import EngineRequest, SamplingParams, Usage
from tests.python.test_prefix_cache import started
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BLOCK = 16


def _kv() -> list[tuple[mx.array, mx.array]]:
    kv = (mx.zeros((1, 1, 4, 2)), mx.ones((1, 1, 4, 2)))
    mx.eval(kv)  # the writer thread only reads bytes (as the engine's stored blocks)
    return [kv]


def _store(tmp_path: Path, files: int, pin_fraction: float) -> DiskStore:
    """A store whose cap holds exactly `files` of the files `_write` writes."""
    probe = DiskStore(tmp_path, "probe", None)
    _write(probe, "k0")
    size = probe.bytes_in_use
    probe.close()
    return DiskStore(tmp_path, f"fp{files}-{pin_fraction}", size * files, pin_fraction)


def _write(store: DiskStore, *keys: str) -> None:
    """Writes `keys` in order (same-size files: keys of equal length)."""
    for key in keys:
        store.put(key, "p", [1, 2, 3, 4], _kv())
        assert store.flush()


def _kept(store: DiskStore) -> set[str]:
    return {key for key in ("k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7") if store.has(key)}


def test_unpinned_files_go_first_least_recently_used_first(tmp_path: Path) -> None:
    store = _store(tmp_path, files=4, pin_fraction=0.5)
    store.pinned = lambda: {"k0": 200.0, "k1": 100.0}
    _write(store, "k0", "k1", "k2", "k3")
    assert store.load("k2") is not None  # k2 is now used after k3
    _write(store, "k4")
    assert _kept(store) == {"k0", "k1", "k2", "k4"}  # k3, the LRU unpinned file
    _write(store, "k5")
    assert _kept(store) == {"k0", "k1", "k4", "k5"}
    # Unpinned (a restart: no pin table yet), the oldest go first again.
    store.pinned = None
    _write(store, "k6")
    assert _kept(store) == {"k1", "k4", "k5", "k6"}
    store.close()


def test_pins_past_the_fraction_go_earliest_expiry_first(tmp_path: Path) -> None:
    # Pinned files may take 2 of the 4 files' room.
    store = _store(tmp_path, files=4, pin_fraction=0.5)
    store.pinned = lambda: {"k1": 300.0, "k0": 100.0, "k2": 200.0}
    _write(store, "k0", "k1", "k2", "k3")
    _write(store, "k4")
    # 3 pinned files are over the fraction: the earliest expiry (k0) goes, not k3.
    assert _kept(store) == {"k1", "k2", "k3", "k4"}
    _write(store, "k5")
    # 2 pinned files are within it: the LRU unpinned file goes.
    assert _kept(store) == {"k1", "k2", "k4", "k5"}
    store.close()


def test_with_only_pinned_files_left_the_first_to_expire_goes(tmp_path: Path) -> None:
    store = _store(tmp_path, files=4, pin_fraction=1.0)
    # k1 and k2 expire together (one pin): the order given (the chain's last block
    # first) breaks the tie, not recency.
    pins = {"k0": 300.0, "k2": 100.0, "k1": 100.0, "k3": 200.0, "k4": 400.0}
    store.pinned = lambda: pins
    _write(store, "k0", "k1", "k2", "k3", "k4")
    assert _kept(store) == {"k0", "k1", "k3", "k4"}
    # An unpinned file goes before any pinned one, even the newest file.
    _write(store, "k5")
    assert _kept(store) == {"k0", "k1", "k3", "k4"}
    # The pin table is asked at each eviction: k3's pin has gone (expired), so k3 is
    # the least recently used unpinned file.
    del pins["k3"]
    _write(store, "k6")
    assert _kept(store) == {"k0", "k1", "k4", "k6"}
    store.close()


def test_the_pin_tables_blocks_as_disk_keys() -> None:
    blocks = [(b"\x0b", 50.0), (b"\x0a", 150.0), (b"\x0c", 150.0)]
    # Expired pins (not dropped until the next admission) hold nothing; order is kept.
    assert list(disk_pins(blocks, hybrid=False, now=100.0).items()) == [
        ("0a", 150.0),
        ("0c", 150.0),
    ]
    # A hybrid model's hit at a block needs its state snapshot too.
    assert disk_pins(blocks[:1], hybrid=True, now=0.0) == {"0b": 50.0, "s0b": 50.0}


class _PinTable:
    """Stands for the native pin table's two calls the disk view makes (one generation:
    no pin made, refreshed or dropped)."""

    def __init__(self, blocks: list[tuple[bytes, float]]) -> None:
        self.blocks = blocks

    def pin_generation(self) -> int:
        return 1

    def pinned_blocks(self) -> list[tuple[bytes, float]]:
        return self.blocks


def test_the_disk_view_of_the_pins_lets_go_of_a_pin_once_it_expires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = PrefixCaching(block_size=BLOCK, num_blocks=8, hybrid=False, snapshot_budget_bytes=0)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    prefix.cache = _PinTable([(b"\x0a", 1010.0), (b"\x0b", 4600.0)])  # type: ignore[assignment]
    assert prefix._disk_pins() == {"0a": 1010.0, "0b": 4600.0}
    # Past the first expiry, before any admission drops it from the table (the same
    # generation): the view is rebuilt, and the expired pin holds nothing on disk.
    clock[0] = 1011.0
    assert prefix._disk_pins() == {"0b": 4600.0}


@pytest.fixture(scope="module")
def tiny(embedded_model: LoadedModel) -> LoadedModel:
    """2 layers, 2 KV heads of 16: 512 bytes of K/V per token, 8 KiB per block."""
    model = tiny_llama(vocab_size=embedded_model.tokenizer.vocab_size, seed=3)
    return dataclasses.replace(
        embedded_model, model=model, name="tiny-llama", source="random-init", extra={}
    )


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 40000) for _ in range(length))


_ids = iter(range(10**9))


def _run(engine: Engine, prompt: tuple[int, ...], pins: tuple[tuple[int, int], ...]) -> Usage:
    async def go() -> Usage:
        request = EngineRequest(
            f"pin{next(_ids)}",
            prompt,
            SamplingParams(max_tokens=1, temperature=0),
            cache_pins=pins,
        )
        events = [e async for e in engine.submit(request)]
        assert events[-1].usage is not None, events[-1].error
        return events[-1].usage

    return asyncio.run(go())


SYSTEM = _prompt(4 * BLOCK + 5, seed=10)  # 4 full blocks, then part of a fifth
ONE_HOUR = ((len(SYSTEM), 3600),)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_a_pinned_prefix_pushed_out_of_ram_is_read_back_from_disk(
    tiny: LoadedModel, tmp_path: Path, pinned: bool
) -> None:
    # RAM for 8 blocks (at most 4 pinned), disk for about 20 block files.
    engine = started(
        tiny,
        cache_dir=str(tmp_path),
        cache_memory_bytes=8 * 8 * 1024,
        cache_disk_bytes=20 * 8 * 1024,
    )
    pins = ONE_HOUR if pinned else ()
    try:
        prefix = engine.prefix
        assert prefix is not None and prefix.cache.num_blocks == 8
        first = _run(engine, (*SYSTEM, *_prompt(20, seed=11)), pins)
        assert first.cached_tokens == 0
        # Unrelated prompts of 10 blocks each: more than RAM's unpinned blocks (RAM lets
        # go of the pin) and, together, several times the disk cap.
        for seed in range(4):
            _run(engine, _prompt(10 * BLOCK + 3, seed=100 + seed), ())
        assert prefix.disk is not None and prefix.disk.flush()
        assert prefix.cache.lookup([*SYSTEM, 1]) == 0  # gone from RAM either way
        held = prefix.cache.pinned_blocks()
        assert len(held) == (4 if pinned else 0)
        assert prefix.cache.pins() == []
        again = _run(engine, (*SYSTEM, *_prompt(20, seed=12)), pins)
        if pinned:
            assert again.cached_tokens == 4 * BLOCK  # its full blocks, from disk
            # The hit refreshed the pin, and RAM holds it again.
            (pin,) = prefix.cache.pins()
            assert pin[1] == 4 * BLOCK and pin[3] > held[0][1]
        else:
            assert again.cached_tokens == 0
    finally:
        engine.shutdown()
