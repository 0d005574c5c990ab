"""The prefix cache's disk tier (`--cache-dir`): a restarted engine reads the prompt from
disk, blocks evicted from a small RAM budget come back from disk, files of another
configuration are ignored, and faults (corrupted or truncated files, a full disk,
kill -9 mid-write) never fail a request or serve bad data."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.prefix import disk as prefix_disk
from compat_serve.engine.prefix.disk import DiskStore, decode, encode
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_prefix_cache import check_usage, run, started
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.fixture(scope="module")
def tiny(embedded_model: LoadedModel) -> LoadedModel:
    """2 layers, 2 KV heads of 16: 512 bytes of K/V per token, 8 KiB per block."""
    model = tiny_llama(vocab_size=embedded_model.tokenizer.vocab_size, seed=3)
    return dataclasses.replace(
        embedded_model, model=model, name="tiny-llama", source="random-init", extra={}
    )


@pytest.fixture(scope="module")
def uncached(tiny: LoadedModel) -> Iterator[Engine]:
    engine = started(tiny, prefix_cache=False)
    yield engine
    engine.shutdown()


def prompt_of(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 40000) for _ in range(length))


def disk_engine(tiny: LoadedModel, cache_dir: Path, **config: Any) -> Engine:
    return started(tiny, cache_dir=str(cache_dir), **config)


def files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*/*.kv"))


def block_file(engine: Engine, cache_dir: Path, prompt: tuple[int, ...], index: int) -> Path:
    assert engine.prefix is not None
    key = engine.prefix.cache.block_hashes(list(prompt))[index].hex()
    (path,) = cache_dir.glob(f"*/*_{key}.kv")
    return path


def test_a_block_file_round_trips_any_dtype() -> None:
    kv = [
        (mx.arange(24, dtype=mx.bfloat16).reshape(1, 2, 3, 4), mx.ones((1, 2, 3, 4))),
        None,
        (mx.zeros((1, 1, 3, 2), dtype=mx.float16), mx.full((1, 1, 3, 2), 7, dtype=mx.float16)),
    ]
    entry = decode(b"".join(encode("k", "p", [1, 2, 3], kv)))
    assert (entry.key, entry.parent, entry.tokens) == ("k", "p", (1, 2, 3))
    for got, want in zip(entry.kv, kv, strict=True):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert mx.array_equal(a, b).item()


def test_a_restarted_engine_reads_the_prompt_from_disk(
    tiny: LoadedModel, uncached: Engine, tmp_path: Path
) -> None:
    prompt = prompt_of(300, seed=1)
    first = disk_engine(tiny, tmp_path)
    try:
        tokens, usage = run(first, prompt)
        assert usage.cached_tokens == 0
    finally:
        first.shutdown()  # finishes queued writes
    # 18 whole blocks (prompt and reply) and the partial block after them.
    assert len(files(tmp_path)) == (300 + 8 - 1) // 16 + 1

    second = disk_engine(tiny, tmp_path)
    hits: list[str] = []
    update = second.status.update

    def record(request_id: str, **fields: Any) -> None:
        if "cache_hit" in fields:
            hits.append(fields["cache_hit"])
        update(request_id, **fields)

    second.status.update = record  # type: ignore[method-assign]
    try:
        again, usage = run(second, prompt)
        assert usage.cached_tokens == len(prompt) - 1
        # The last prompt token's block comes back into RAM with the reply: stored anew.
        assert usage.cache_creation_tokens == 1
        # Read from disk vs computed, and computed with the cache vs without it.
        assert_same_or_near_tie(tiny, prompt, tokens, again)
        assert_same_or_near_tie(tiny, prompt, run(uncached, prompt)[0], tokens)
        assert hits == ["disk"]
        assert second.prefix is not None
        metrics = second.prefix.metrics()
        assert metrics["disk_hit_tokens"] == len(prompt) - 1
        assert metrics["hit_tokens"] == len(prompt) - 1
        assert metrics["disk_faults"] == 0
        check_usage(usage)
    finally:
        second.shutdown()

    # Another hash function is another fingerprint: its own directory, nothing read.
    other = disk_engine(tiny, tmp_path, cache_hash="sha256")
    try:
        assert run(other, prompt)[1].cached_tokens == 0
    finally:
        other.shutdown()
    assert len(list(tmp_path.iterdir())) == 2


def test_blocks_evicted_from_a_small_ram_budget_come_back_from_disk(
    tiny: LoadedModel, uncached: Engine, tmp_path: Path
) -> None:
    # RAM for 8 blocks: a 400-token session does not even fit; the rest is assembled
    # straight from what was read from disk.
    engine = disk_engine(tiny, tmp_path, cache_memory_bytes=64 * 1024)
    try:
        prefix = engine.prefix
        assert prefix is not None and prefix.cache.num_blocks == 8
        session_a = prompt_of(400, seed=2)
        reply_a, _ = run(engine, session_a)
        run(engine, prompt_of(400, seed=3))  # session B pushes A out of RAM
        assert prefix.cache.lookup(list(session_a)) == 0
        before = prefix.metrics()["disk_hit_tokens"]
        continued = (*session_a, *reply_a, *prompt_of(20, seed=4))
        tokens, usage = run(engine, continued)
        from_disk = prefix.metrics()["disk_hit_tokens"] - before
        assert from_disk >= 0.9 * len(session_a)
        assert usage.cached_tokens == len(session_a) + len(reply_a) - 1
        assert_same_or_near_tie(tiny, continued, run(uncached, continued)[0], tokens)
        check_usage(usage)
    finally:
        engine.shutdown()


def test_corrupted_truncated_and_unreadable_files_are_skipped(
    tiny: LoadedModel, uncached: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompt_of(200, seed=5)
    first = disk_engine(tiny, tmp_path)
    try:
        run(first, prompt, max_tokens=0)
        bad = [block_file(first, tmp_path, prompt, i) for i in (4, 7, 9)]
    finally:
        first.shutdown()
    data = bytearray(bad[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the K/V
    bad[0].write_bytes(bytes(data))
    bad[1].write_bytes(bad[1].read_bytes()[:1000])  # truncated
    bad[2].write_bytes(b"garbage")

    # Each restart reads up to the first bad file, skips it (logged, deleted), computes
    # the rest and writes it back: the next restart gets one bad file further.
    for stop, message in ((4, "checksum mismatch"), (7, "checksum mismatch"), (9, "truncated")):
        engine = disk_engine(tiny, tmp_path)
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="compat_serve.engine"):
                tokens, usage = run(engine, prompt)
            assert usage.cached_tokens == stop * 16
            assert_same_or_near_tie(tiny, prompt, run(uncached, prompt)[0], tokens)
            assert engine.prefix is not None and engine.prefix.disk is not None
            assert engine.prefix.disk.faults == 1
            assert message in caplog.text
            check_usage(usage)
        finally:
            engine.shutdown()
    assert all(decode(path.read_bytes()) for path in bad)  # rewritten whole
    last = disk_engine(tiny, tmp_path)
    try:
        tokens, usage = run(last, prompt)
        assert usage.cached_tokens == len(prompt) - 1
        assert last.prefix is not None and last.prefix.disk is not None
        assert last.prefix.disk.faults == 0
    finally:
        last.shutdown()

    # A file whose tail was cut off under its final name (a crash of the disk itself):
    # skipped on read, the request recomputes.
    path = files(tmp_path)[0]
    path.write_bytes(path.read_bytes()[:-10])
    store = DiskStore(tmp_path, path.parent.name, None)
    try:
        assert store.load(path.name.split("_")[1].removesuffix(".kv")) is None
        assert store.faults == 1 and not path.exists()
    finally:
        store.close()


def test_a_full_disk_stops_writes_with_a_warning(
    tiny: LoadedModel,
    uncached: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # /dev/full: every write fails with ENOSPC, as on a full disk.
    monkeypatch.setattr(prefix_disk, "open_temp", lambda _path: open("/dev/full", "wb"))  # noqa: SIM115
    engine = disk_engine(tiny, tmp_path)
    try:
        prompt = prompt_of(120, seed=6)
        with caplog.at_level(logging.WARNING, logger="compat_serve.engine"):
            tokens, _ = run(engine, prompt)
            assert engine.prefix is not None and engine.prefix.disk is not None
            assert engine.prefix.disk.flush()
        assert engine.prefix.disk.writing is False
        assert "disk writes stop" in caplog.text
        assert caplog.text.count("disk writes stop") == 1
        assert_same_or_near_tie(tiny, prompt, run(uncached, prompt)[0], tokens)
        # Still served from RAM; nothing on disk; later requests fine.
        assert run(engine, prompt)[1].cached_tokens == len(prompt) - 1
        assert files(tmp_path) == []
        assert engine.prefix.metrics()["disk_writing"] == 0
    finally:
        engine.shutdown()


WRITER = """
import sys
import mlx.core as mx
from compat_serve.engine.prefix.disk import DiskStore
store = DiskStore(sys.argv[1], "fp", None)
kv = [(mx.random.normal((1, 8, 16, 4096)), mx.random.normal((1, 8, 16, 4096)))] * 2
mx.eval(kv)
for i in range(10_000):
    store.put(f"{i:032x}", "p", list(range(16)), kv)
    if i == 0:
        store.flush()
        print("ready", flush=True)
    store.flush()
"""


def test_kill_9_during_writes_leaves_nothing_read_as_valid(tmp_path: Path) -> None:
    for attempt in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.05 + 0.1 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        # Whether or not the kill landed inside a write, leave one cut-short write too.
        done = files(tmp_path)[0]
        cut = done.with_name(done.name + f".{attempt}.tmp")
        cut.write_bytes(done.read_bytes()[:5000])
        store = DiskStore(tmp_path, "fp", None)
        try:
            assert len(store) >= 1
            assert not cut.exists()  # cut-short writes are deleted, never indexed
            assert not list((tmp_path / "fp").glob("*.tmp"))
            keys = [p.name.split("_")[1].removesuffix(".kv") for p in files(tmp_path)]
            assert all(store.load(key) is not None for key in keys)
            assert store.faults == 0
        finally:
            store.close()


def test_a_hybrid_model_resumes_from_a_snapshot_on_disk_after_a_restart(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    from tests.tiny_models import tiny_model

    hybrid = tiny_model("lfm2", embedded_model)
    prompt = prompt_of(150, seed=7)
    first = disk_engine(hybrid, tmp_path)
    try:
        assert first.prefix is not None and first.prefix.hybrid
        tokens, usage = run(first, prompt)
        assert usage.cached_tokens == 0
    finally:
        first.shutdown()
    assert list(tmp_path.glob("*/snapshots_s*.kv"))  # the prompt's last full block
    assert len(list(tmp_path.glob("*/*_p*.kv"))) == 2  # points: before its last token, reply end
    second = disk_engine(hybrid, tmp_path)
    uncached = started(hybrid, prefix_cache=False)
    try:
        again, usage = run(second, prompt)
        # Blocks and the state point before the prompt's last token, from disk.
        assert usage.cached_tokens == len(prompt) - 1
        assert second.prefix is not None
        assert second.prefix.metrics()["disk_hit_tokens"] == usage.cached_tokens
        assert second.prefix.faults == 0
        assert_same_or_near_tie(hybrid, prompt, tokens, again)
        assert_same_or_near_tie(hybrid, prompt, run(uncached, prompt)[0], tokens)
    finally:
        second.shutdown()
        uncached.shutdown()


def test_the_disk_size_flag_is_bytes_or_a_share_of_free_space(tmp_path: Path) -> None:
    from compat_serve.bootstrap import ServeOptions, _disk_size

    free = shutil.disk_usage(tmp_path).free
    share = _disk_size(ServeOptions(cache_dir=str(tmp_path / "c"), cache_disk_size="10%"))
    assert share is not None and abs(share - free / 10) < free / 100
    assert _disk_size(ServeOptions(cache_dir=str(tmp_path), cache_disk_size="2GiB")) == 2 * 2**30
    assert _disk_size(ServeOptions()) is None
