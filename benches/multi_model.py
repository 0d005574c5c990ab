"""Several models in one server (#27): cold load, unload + reload from the disk tier, and
an alternating A/B workload under a budget that holds one model.

Two copies of the embedded model (symlinked GGUF files) under `--models-dir`, each with
a 64 MB KV and prefix-cache budget and its own disk tier under `--cache-dir`:

1. Cold vs warm: a one-token request to an unloaded model (the load included) and the
   same request once it is resident; then `POST /models/unload` and the repeated
   ~200-token prompt again: seconds and the share of its prompt read from cache.
2. Alternating A/B under `--memory-budget` of 1.5 models: 6 requests alternating between
   the two models: loads per request and the latency of each.

Medians of 3 rounds with their spread. Not measured yet: background TTFT while the main
model decodes (each model still has its own engine thread; #27 item 3).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx

from _servers import BIN, Server, _spawn, _wait_ready, free_port, log
from compat_serve.models.embedded import embedded_model_path

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

        budget = str(int(resident * 1.5))
        per_request, latencies = [], []
        for round_ in range(3):
            server = start(models, root / f"cache-ab{round_}", root, "--memory-budget", budget)
            try:
                base = server.base_url
                for i in range(6):
                    seconds, _ = ask(base, "ab"[i % 2], f"Request {i}: say hi.")
                    latencies.append(seconds)
                per_request.append(loads(base) / 6)
            finally:
                server.stop()
        log(f"alternating A/B, budget {int(budget) / 2**20:.0f} MiB: loads per request "
            f"{summary(per_request)}; latency s p50 {statistics.median(latencies):.2f}, "
            f"max {max(latencies):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
