"""A Claude Code session with background calls (#27): does the main model keep its prefix
reads when the background calls go to another model?

Replays the captured session `../shared/claude_code/recipe_final.jsonl` (5 growing turns,
model `local-model`, streamed as captured), each turn followed by a background call like
Claude Code's (a title request of ~900 tokens under a `claude-haiku-4-5-*` name). Every
model has a 64 MB prefix cache (about 1,400 tokens of this model's KV), which the
session's prompt overflows, 512 MB of live KV and `--max-output-tokens 16`. Three
servers per round, each fresh:

1. two models (`--models`: main, and fast with alias `claude-*haiku*`), session alone;
2. the same, with the background calls (they go to fast);
3. reference: one model, with the background calls (they go to the same model).

Printed per configuration: the main session's prompt tokens read from cache (summed
over its turns), medians of 3 rounds with their spread, and (2) as a share of (1).
Target (#27): (2) keeps >= 95% of (1).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from _servers import BIN, ROOT, Server, _spawn, _wait_ready, free_port, log
from compat_serve.models.embedded import embedded_model_path

SHARED = Path(os.environ.get("COMPAT_SHARED_DIR", ROOT.parent / "shared"))
DROP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
SMALL = ["--kv-memory", "512MB", "--cache-memory", "64MB", "--max-output-tokens", "16"]
BACKGROUND = (
    "Summarize this coding session in a title of at most six words. Session so far: "
    + " ".join(f"step {i}: the agent read file module_{i}.py and ran the tests." for i in range(60))
)


def start(args: list[str], logs: Path) -> Server:
    port = free_port()
    cmd = [str(BIN / "compat-serve"), "--port", str(port), "--log-level", "warning", *args]
    server = _spawn("compat-serve", cmd, logs, port)
    _wait_ready(server, "/health", 120)
    return server


def replay_turn(base: str, captured: dict[str, Any]) -> dict[str, int]:
    """One captured request as sent; its usage (message_start + message_delta)."""
    headers = {k: v for k, v in captured["headers"].items() if k.lower() not in DROP}
    usage: dict[str, int] = {}
    with httpx.stream(
        "POST",
        f"{base}{captured['path']}",
        content=captured["raw_body"].encode(),
        headers=headers,
        timeout=900,
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if data.get("type") == "message_start":
                usage.update(data["message"]["usage"])
            elif data.get("type") == "message_delta":
                usage.update(data["usage"])
    return usage


def background_call(base: str) -> None:
    reply = httpx.post(
        f"{base}/v1/messages",
        json={
            "model": "claude-haiku-4-5-20251001",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": BACKGROUND}],
        },
        timeout=900,
    )
    reply.raise_for_status()


def session_reads(base: str, turns: list[dict[str, Any]], background: bool) -> int:
    reads = 0
    for captured in turns:
        reads += replay_turn(base, captured).get("cache_read_input_tokens", 0)
        if background:
            background_call(base)
    return reads


def main() -> None:
    turns = [
        json.loads(line)
        for line in (SHARED / "claude_code" / "recipe_final.jsonl").read_text().splitlines()
        if line
    ]
    results: dict[str, list[int]] = {"alone": [], "background": [], "one model": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models.yaml"
        path = embedded_model_path()
        models.write_text(
            f"models:\n  - id: main\n    path: {path}\n    default: true\n"
            f"  - id: fast\n    path: {path}\n    aliases: ['claude-*haiku*']\n"
        )
        for _ in range(3):
            for name, args, background in [
                ("alone", ["--models", str(models)], False),
                ("background", ["--models", str(models)], True),
                ("one model", [], True),
            ]:
                server = start([*args, *SMALL], root)
                try:
                    started = time.monotonic()
                    results[name].append(session_reads(server.base_url, turns, background))
                    seconds = time.monotonic() - started
                    log(f"{name}: {results[name][-1]} tokens read ({seconds:.0f} s)")
                finally:
                    server.stop()
    for name, reads in results.items():
        log(f"main session's cache reads, {name}: median {statistics.median(reads)} "
            f"(min {min(reads)}, max {max(reads)})")  # fmt: skip
    alone = statistics.median(results["alone"])
    for name in ("background", "one model"):
        share = statistics.median(results[name]) / alone if alone else float("nan")
        log(f"{name} / alone: {share:.1%} (target for 'background': >= 95%)")


if __name__ == "__main__":
    main()
