"""Prefix cache disk tier (`--cache-dir`, #15): TTFT cold vs from RAM vs from disk after a
restart, disk read throughput, and the time to rebuild the index of 10k block files.

One run, one compat-serve binary, the dense float32 weights of the embedded model:

1. A server with a fresh `--cache-dir` answers a ~4k-token prompt (cold), then the same
   prompt again (RAM), then a ~1.5k-token prompt (cold) and again (RAM); one token each.
2. The server stops (SIGTERM: queued disk writes finish), the cache files are evicted from
   the page cache (`posix_fadvise(DONTNEED)`), and a new server starts on the same
   directory: both prompts again (disk). Disk read throughput = bytes read / seconds spent
   reading, from `/metrics` (`compat_prefix_cache_disk_read_{bytes,seconds}`).
3. Spill: a server with `--cache-memory 4MiB` (5 blocks of this model) runs session A
   (~1k tokens), session B (~1k), then A continued: the share of A's prompt read from disk.
4. Index rebuild: 10k block files are written by the disk store, then a fresh store
   opens the directory (median of 3).

Targets (#15): restart TTFT <= 1/5 of cold for the ~1.5k prompt; spill share >= 90%.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from _servers import (
    Server,
    TokenCounter,
    converted_model_dir,
    log,
    make_client,
    start_compat_serve,
    stream_chat,
    tool_output,
)


def body(text: str) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
    }


def ask(client: httpx.Client, server: Server, text: str) -> tuple[float, int, int]:
    result = stream_chat(client, server.base_url, body(text))
    if result.status != 200:
        raise RuntimeError(f"HTTP {result.status}: {result.error}")
    return result.ttft, result.prompt_tokens, result.cached_tokens or 0


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", trust_env=False, timeout=30).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def drop_page_cache(directory: Path) -> int:
    count = 0
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def ttft_rows(model_dir: Path, counter: TokenCounter, sizes: list[int], tmp: Path) -> None:
    cache_dir = tmp / "cache"
    prompts = {n: tool_output(counter, n, seed=n) for n in sizes}
    rows: dict[int, dict[str, tuple[float, int, int]]] = {n: {} for n in sizes}
    args = ["--cache-dir", str(cache_dir)]
    with make_client() as client:
        server = start_compat_serve(model_dir, args, tmp)
        try:
            for n in sizes:
                log(f"cold {n} ...")
                rows[n]["cold"] = ask(client, server, prompts[n])
                rows[n]["ram"] = ask(client, server, prompts[n])
        finally:
            server.stop()
        files = drop_page_cache(cache_dir)
        size = sum(p.stat().st_size for p in cache_dir.rglob("*.kv"))
        started = time.perf_counter()
        server = start_compat_serve(model_dir, args, tmp)
        restart_s = time.perf_counter() - started
        try:
            for n in sizes:
                log(f"disk {n} ...")
                rows[n]["disk"] = ask(client, server, prompts[n])
            read_bytes = metric(server, "compat_prefix_cache_disk_read_bytes")
            read_s = metric(server, "compat_prefix_cache_disk_read_seconds")
        finally:
            server.stop()
    print(f"cache dir after the first server: {files} files, {size / 2**20:.0f} MiB")
    print(f"restart (process start to /health 200): {restart_s:.1f} s")
    print()
    print("| prompt | cold TTFT | RAM TTFT | disk TTFT (restart) | cold/RAM | cold/disk | read |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        cold, ram, disk = rows[n]["cold"], rows[n]["ram"], rows[n]["disk"]
        print(
            f"| {cold[1]} | {cold[0]:.2f} s | {ram[0]:.2f} s | {disk[0]:.2f} s "
            f"| {cold[0] / ram[0]:.1f}x | {cold[0] / disk[0]:.1f}x "
            f"| RAM {ram[2]}, disk {disk[2]} of {disk[1]} |"
        )
    print()
    print(
        f"disk reads after the restart (page cache dropped): {read_bytes / 2**20:.0f} MiB in "
        f"{read_s:.2f} s = {read_bytes / read_s / 1e9:.2f} GB/s (read + checksum + decode)"
    )


def spill_row(model_dir: Path, counter: TokenCounter, tmp: Path) -> None:
    cache_dir = tmp / "spill"
    args = ["--cache-dir", str(cache_dir), "--cache-memory", "4MiB"]
    a = tool_output(counter, 1000, seed=101)
    b = tool_output(counter, 1000, seed=202)
    with make_client() as client:
        server = start_compat_serve(model_dir, args, tmp)
        try:
            first = stream_chat(client, server.base_url, {**body(a), "max_tokens": 8})
            ask(client, server, b)
            before = metric(server, "compat_prefix_cache_disk_hit_tokens")
            follow = {
                **body(a),
                "messages": [
                    {"role": "user", "content": a},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "Thanks. Now summarise the first file."},
                ],
            }
            result = stream_chat(client, server.base_url, follow)
            from_disk = metric(server, "compat_prefix_cache_disk_hit_tokens") - before
        finally:
            server.stop()
    share = from_disk / first.prompt_tokens
    print(
        f"spill (--cache-memory 4MiB): A {first.prompt_tokens} tokens, B, A continued "
        f"({result.prompt_tokens} tokens): {from_disk:.0f} read from disk = {share:.0%} of "
        f"A's prompt, {result.cached_tokens} cached in all"
    )


def rebuild_row(tmp: Path, blocks: int) -> None:
    import mlx.core as mx

    from compat_serve.engine.prefix.disk import DiskStore

    root = tmp / "rebuild"
    # Rebuilding reads names and sizes only, so small files (4 KiB of K/V) stand in for
    # this model's 720 KiB blocks and keep the bench off 7 GiB of writes.
    kv: list[Any] = [(mx.ones((1, 2, 16, 16)), mx.ones((1, 2, 16, 16)))]
    mx.eval(kv)
    store = DiskStore(root, "fp", None)
    started = time.perf_counter()
    for i in range(blocks):
        store.put(f"{i:032x}", f"{i // 4:032x}", list(range(16)), kv)
        if i % 256 == 255:
            store.flush()
    store.close()
    write_s = time.perf_counter() - started
    total = sum(p.stat().st_size for p in (root / "fp").iterdir())
    times = []
    for _ in range(3):
        fresh = DiskStore(root, "fp", None)
        assert len(fresh) == blocks
        times.append(fresh.rebuild_seconds)
        fresh.close()
    print(
        f"index rebuild, {blocks} files ({total / 2**30:.1f} GiB): median "
        f"{statistics.median(times) * 1000:.0f} ms (runs: "
        f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms); writing them took "
        f"{write_s:.1f} s = {total / write_s / 1e9:.2f} GB/s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4096,1536", help="prompt sizes in tokens")
    parser.add_argument("--rebuild-blocks", type=int, default=10_000)
    parser.add_argument("--skip-spill", action="store_true")
    ns = parser.parse_args()
    model_dir = converted_model_dir()
    counter = TokenCounter(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="compat-prefix-disk-", dir=os.environ.get("TMPDIR")))
    try:
        ttft_rows(model_dir, counter, [int(s) for s in ns.sizes.split(",")], tmp)
        print()
        if not ns.skip_spill:
            spill_row(model_dir, counter, tmp)
        rebuild_row(tmp, ns.rebuild_blocks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
