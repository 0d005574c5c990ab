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

Medians of 3 rounds with their spread.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _servers import BIN, Server, _spawn, _wait_ready, free_port, log
from compat_serve.models.embedded import embedded_model_path

REQUESTS_PER_CLIENT = 8
PROMPT = (
    "Here is a list of facts about the solar system. "
    + " ".join(f"Fact {i}: planet number {i % 8 + 1} orbits the sun." for i in range(18))
    + " Which planet is the largest?"
)


def start(models_dir: Path, cache: Path, logs: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [str(BIN / "compat-serve"), "--models-dir", str(models_dir), "--port", str(port),
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
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        for name in ("a", "b"):
            (models / f"{name}.gguf").symlink_to(embedded_model_path())
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
