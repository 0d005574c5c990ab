"""Several models in one server (#27): cold load, unload + reload from the disk tier, and
an alternating A/B workload under a budget that holds one model.

Two copies of the embedded model (symlinked GGUF files) under `--models-dir`, each with
a 64 MB KV and prefix-cache budget and its own disk tier under `--cache-dir`:

1. Cold vs warm: a one-token request to an unloaded model (the load included) and the
   same request once it is resident; then `POST /models/unload` and the repeated
   ~200-token prompt again: seconds and the share of its prompt read from cache.
2. Background TTFT: the first token of a short request to model b, alone and while
   model a decodes 4 streams (one engine thread steps both; #27's target: at most
   2 x solo + 250 ms).
3. A/B under `--memory-budget` of 1.5 models: two clients, one per model, each sending
   8 requests back to back: all answered, loads per 100 requests, p50/p99 latency.
4. Decode during a load: model a streams a long greedy reply while `POST /models/load`
   loads model b; a's tokens per second and its p99 gap between tokens inside the load
   window, and the load's seconds, against a's decode with nothing loading. With
   `--reference BIN` (another build's `compat-serve`, e.g. main's before the load moved
   onto the engine thread) the rounds alternate between the two builds.
   `--only-load` runs just this part.

Medians of 3 rounds with their spread.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _servers import BIN, Server, _spawn, _wait_ready, free_port, log, percentile
from compat_serve.models.embedded import embedded_model_path

REQUESTS_PER_CLIENT = 8
PROMPT = (
    "Here is a list of facts about the solar system. "
    + " ".join(f"Fact {i}: planet number {i % 8 + 1} orbits the sun." for i in range(18))
    + " Which planet is the largest?"
)


def start(
    models_dir: Path, cache: Path, logs: Path, *extra: str, binary: Path | None = None
) -> Server:
    port = free_port()
    exe = str(binary or BIN / "compat-serve")
    cmd = [exe, "--models-dir", str(models_dir), "--port", str(port),
           "--cache-dir", str(cache), "--kv-memory", "64MB", "--cache-memory", "64MB",
           "--log-level", "warning", *extra]  # fmt: skip
    server = _spawn("compat-serve", cmd, logs, port)
    _wait_ready(server, "/health", 120)
    return server


def ask(base: str, model: str, text: str) -> tuple[float, dict[str, int]]:
    started = time.monotonic()
    reply = httpx.post(
        f"{base}/v1/messages",
        json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
        timeout=300,
    )
    reply.raise_for_status()
    return time.monotonic() - started, reply.json()["usage"]


def loads(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("compat_model_loads_total{")
    )


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reference", type=Path, help="another build's compat-serve")
    parser.add_argument("--only-load", action="store_true", help="just part 4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        for name in ("a", "b"):
            (models / f"{name}.gguf").symlink_to(embedded_model_path())
        if args.only_load:
            decode_during_load(models, root, args.reference)
            return
        cold, warm, reload_s, shares, resident = [], [], [], [], 0
        server = start(models, root / "cache", root)
        try:
            base = server.base_url
            for round_ in range(3):
                seconds, _ = ask(base, "a", f"Round {round_}. {PROMPT}")
                cold.append(seconds)
                seconds, _ = ask(base, "a", f"Round {round_}. {PROMPT}")
                warm.append(seconds)
                status = httpx.get(f"{base}/v1/status").json()
                resident = next(m["resident_bytes"] for m in status["models"] if m["id"] == "a")
                httpx.post(f"{base}/models/unload", json={"model": "a"}, timeout=60)
                seconds, usage = ask(base, "a", f"Round {round_}. {PROMPT}")
                reload_s.append(seconds)
                total = sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens",
                                               "cache_creation_input_tokens"))  # fmt: skip
                shares.append(usage["cache_read_input_tokens"] / total)
                httpx.post(f"{base}/models/unload", json={"model": "a"}, timeout=60)
        finally:
            server.stop()
        log(f"resident bytes of one model: {resident / 2**20:.0f} MiB")
        log(f"cold request (load + prompt), s: {summary(cold)}")
        log(f"warm request (prompt from RAM cache), s: {summary(warm)}")
        log(f"after unload (load + prompt from disk), s: {summary(reload_s)}")
        log(f"share of the prompt read from cache after unload: {summary(shares)}")

        background_ttft(models, root)

        budget = str(int(resident * 1.5))
        per_request, latencies, statuses = [], [], []
        for round_ in range(3):
            server = start(models, root / f"cache-ab{round_}", root, "--memory-budget", budget)
            try:
                base = server.base_url

                def client(model: str, base: str = base, round_: int = round_) -> None:
                    for i in range(REQUESTS_PER_CLIENT):
                        seconds, _ = ask(base, model, f"{model} {round_}.{i}: say hi.")
                        latencies.append(seconds)
                        statuses.append(200)

                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    list(pool.map(client, ["a", "b"]))
                per_request.append(loads(base) / (2 * REQUESTS_PER_CLIENT))
            finally:
                server.stop()
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        log(
            f"A/B clients together, {REQUESTS_PER_CLIENT} requests each, budget "
            f"{int(budget) / 2**20:.0f} MiB (one model): {len(statuses)} answered 200; "
            f"loads per 100 requests {100 * statistics.median(per_request):.0f} "
            f"(min {100 * min(per_request):.0f}, max {100 * max(per_request):.0f}); "
            f"latency s p50 {statistics.median(latencies):.2f}, p99 {p99:.2f}"
        )
        decode_during_load(models, root, args.reference)


def token_times(base: str, model: str, text: str, max_tokens: int, out: list[float]) -> None:
    """Stream a greedy reply, appending each text delta's arrival time to `out`."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text_delta"' in line:
                out.append(time.monotonic())


def rate_and_gap(times: list[float], start: float, end: float) -> tuple[float, float]:
    """Tokens per second and the p99 gap between tokens inside [start, end]."""
    inside = [t for t in times if start <= t <= end]
    gaps = [b - a for a, b in zip([start, *inside], [*inside, end], strict=True)]
    return len(inside) / (end - start), percentile(gaps, 99)


def one_load_round(models: Path, root: Path, tag: str, binary: Path | None) -> dict[str, float]:
    """Model a decodes alone for a while, then while model b loads: the numbers."""
    server = start(models, root / f"cache-load-{tag}", root, binary=binary)
    try:
        base = server.base_url
        ask(base, "a", "warm up")
        times: list[float] = []
        reader = threading.Thread(
            target=token_times, args=(base, "a", "Tell a very long story.", 1200, times)
        )
        reader.start()
        while len(times) < 4:
            time.sleep(0.01)
        alone_start = time.monotonic()
        time.sleep(3.0)
        alone_end = load_start = time.monotonic()
        reply = httpx.post(f"{base}/models/load", json={"model": "b"}, timeout=300)
        load_end = time.monotonic()
        reply.raise_for_status()
        assert json.loads(reply.text).get("success") is True, reply.text
        still_decoding = len(times)
        reader.join()
        assert times[-1] > load_end and still_decoding < len(times), "a stopped before b loaded"
    finally:
        server.stop()
    alone_rate, alone_gap = rate_and_gap(times, alone_start, alone_end)
    load_rate, load_gap = rate_and_gap(times, load_start, load_end)
    return {
        "alone_tok_s": alone_rate,
        "alone_gap_p99": alone_gap,
        "load_tok_s": load_rate,
        "load_gap_p99": load_gap,
        "load_s": load_end - load_start,
    }


def decode_during_load(models: Path, root: Path, reference: Path | None) -> None:
    builds: list[tuple[str, Path | None]] = [("this build", None)]
    if reference is not None:
        builds.insert(0, (f"reference {reference}", reference))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in builds}
    for round_ in range(3):
        for name, binary in builds:  # alternating, the reference first in each round
            results[name].append(
                one_load_round(models, root, f"{round_}{len(results[name])}{name[0]}", binary)
            )
    for name, rounds in results.items():

        def column(key: str, rounds: list[dict[str, float]] = rounds) -> str:
            return summary([r[key] for r in rounds])

        log(
            f"{name}: model a decoding alone: {column('alone_tok_s')} tok/s, gap p99 "
            f"{column('alone_gap_p99')} s; while model b loads: {column('load_tok_s')} "
            f"tok/s, gap p99 {column('load_gap_p99')} s; the load took {column('load_s')} s"
        )


def first_token_s(base: str, model: str, text: str) -> float:
    """Seconds to the first text delta of a streamed message."""
    body = {
        "model": model,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": text}],
    }
    started = time.monotonic()
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text_delta"' in line:
                return time.monotonic() - started
    raise RuntimeError("no text")


def background_ttft(models: Path, root: Path) -> None:
    """Background model's TTFT alone, and while the main model decodes 4 streams."""
    server = start(models, root / "cache-ttft", root)
    try:
        base = server.base_url
        ask(base, "a", "warm up")
        ask(base, "b", "warm up")
        solo = [
            first_token_s(base, "b", f"Title for task {i}: fix the login bug.") for i in range(3)
        ]
        stop = threading.Event()

        def decode(i: int) -> None:
            while not stop.is_set():
                httpx.post(
                    f"{base}/v1/messages",
                    json={
                        "model": "a",
                        "max_tokens": 64,
                        "messages": [{"role": "user", "content": f"Tell story {i}."}],
                    },
                    timeout=300,
                )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for i in range(4):
                pool.submit(decode, i)
            time.sleep(2.0)
            busy = [
                first_token_s(base, "b", f"Title for task {i}: fix the login bug.")
                for i in range(3, 6)
            ]
            stop.set()
    finally:
        server.stop()
    limit = 2 * statistics.median(solo) + 0.25
    log(f"background TTFT alone, s: {summary(solo)}")
    log(
        f"background TTFT while the main model decodes 4 streams, s: {summary(busy)} "
        f"(target <= 2 x solo + 0.25 = {limit:.2f})"
    )


if __name__ == "__main__":
    main()
