"""Two names for one model under `--memory-budget` (#34, defect 1), on the real CLI.

A models dir with `main.gguf` and `fast.gguf`, both symlinks to the embedded GGUF, served
by `compat-serve --models-dir D --kv-memory 64MiB --cache-memory 32MiB` and:

1. `--memory-budget 150MiB` (neither fits: float32 would not, so auto keeps the 94 MiB as
   stored, + 16 MiB of tokenizer + 96):
   each name asked twice, alternating; status and seconds of each answer.
2. `--memory-budget 700MiB` (fits one): `--swaps` requests alternating main / fast, each
   a load that evicts the other; the server process's RSS (`/proc/PID/status` VmRSS)
   sampled every 5 ms, before the first request (idle: no model resident) and at its
   peak, against the budget.

Run: `.venv/bin/python benches/twin_budget.py [--swaps 4]`.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _servers import BIN, Server, _spawn, _wait_ready, free_port, log
from compat_serve.models.embedded import embedded_model_path

MIB = 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def ask(base: str, model: str) -> tuple[int, float, str]:
    started = time.monotonic()
    reply = httpx.post(
        f"{base}/v1/messages",
        json={
            "model": model,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        timeout=300,
    )
    body = reply.json()
    text = body["content"][0]["text"] if reply.status_code == 200 else body["error"]["message"]
    return reply.status_code, time.monotonic() - started, text


def serve(models: Path, budget: str, logs: Path) -> tuple[str, Server]:
    port = free_port()
    cmd = [str(BIN / "compat-serve"), "--models-dir", str(models), "--port", str(port)]
    cmd += ["--memory-budget", budget, "--kv-memory", "64MiB", "--cache-memory", "32MiB"]
    server = _spawn(f"twins-{budget}", cmd, logs, port)
    _wait_ready(server, "/health", 300)
    return server.base_url, server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models, logs = Path(tmp, "models"), Path(tmp)
        models.mkdir()
        for name in ("main", "fast"):
            (models / f"{name}.gguf").symlink_to(embedded_model_path())

        base, server = serve(models, "150MiB", logs)
        try:
            print("budget 150MiB (neither fits):")
            for model in ("main", "fast", "main", "fast"):
                status, seconds, text = ask(base, model)
                print(f"  {model:>4}: {status} in {seconds:.2f} s  {text}")
        finally:
            server.stop()

        base, server = serve(models, "700MiB", logs)
        pid = server.proc.pid
        try:
            idle = peak = rss(pid)
            done = threading.Event()

            def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss(pid))
                    done.wait(0.005)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            print("budget 700MiB (fits one):")
            for i in range(args.swaps):
                model = ("main", "fast")[i % 2]
                status, seconds, text = ask(base, model)
                resident = [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
                print(f"  {model:>4}: {status} in {seconds:.2f} s, resident {resident}  {text!r}")
            done.set()
            sampler.join()
            budget = 700 * MIB
            print(
                f"  RSS: idle {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB = budget 700 MiB "
                f"{'+' if peak >= budget else '-'} {abs(peak - budget) / MIB:.0f} MiB "
                f"(peak - idle = {(peak - idle) / MIB:.0f} MiB)"
            )
        finally:
            server.stop()
    log("done")


if __name__ == "__main__":
    main()
