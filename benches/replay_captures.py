"""Replay every captured Claude Code request at the model's full context, with timings.

Starts `compat-serve` (embedded model, output capped so prefill dominates), sends each
request of ../shared/claude_code/*.jsonl with its captured headers and raw body, and
prints per request: HTTP status, prompt tokens (from usage), cached tokens, time to the
first content event, total time, and prompt tokens/s. The baseline for prefix caching:
today every turn pays its full prompt.

Run: `.venv/bin/python benches/replay_captures.py [--files recipe_final tool_default]`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COMPAT_SHARED_DIR", ROOT.parent / "shared"))
DROP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(port: int, max_output: int) -> subprocess.Popen[bytes]:
    serve = Path(sys.executable).with_name("compat-serve")
    cmd = [str(serve), "--port", str(port), "--max-output-tokens", str(max_output)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("compat-serve did not start")


def _headers(captured: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in captured["headers"].items() if k.lower() not in DROP}


def count_tokens(base: str, captured: dict[str, Any]) -> int | None:
    response = httpx.post(
        f"{base}/v1/messages/count_tokens",
        content=captured["raw_body"].encode(),
        headers=_headers(captured),
        timeout=300,
    )
    return response.json()["input_tokens"] if response.status_code == 200 else None


def replay(base: str, captured: dict[str, Any]) -> dict[str, Any]:
    headers = _headers(captured)
    query = "&".join(f"{k}={v}" for k, vs in (captured.get("query") or {}).items() for v in vs)
    url = f"{base}{captured['path']}" + (f"?{query}" if query else "")
    started = time.perf_counter()
    first = None
    usage: dict[str, int] = {}
    with httpx.stream(
        "POST", url, content=captured["raw_body"].encode(), headers=headers, timeout=900
    ) as response:
        status = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            kind = data.get("type")
            if kind == "message_start":
                usage.update(data["message"]["usage"])
            elif kind in ("content_block_start", "message_delta") and first is None:
                first = time.perf_counter() - started
            if kind == "message_delta":
                usage.update(data["usage"])
    total = time.perf_counter() - started
    prompt = sum(usage.get(k, 0) for k in ("input_tokens", "cache_read_input_tokens",
                                            "cache_creation_input_tokens"))  # fmt: skip
    return {
        "status": status,
        "prompt": prompt,
        "cached": usage.get("cache_read_input_tokens", 0),
        "ttft": first,
        "total": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", nargs="*", help="capture names (default: all)")
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--passes", type=int, default=1, help="replay the sessions N times")
    parser.add_argument("--count", action="store_true", help="compare with count_tokens")
    args = parser.parse_args()
    paths = sorted((SHARED / "claude_code").glob("*.jsonl"))
    if args.files:
        paths = [p for p in paths if p.stem in args.files]
    port = free_port()
    server = start_server(port, args.max_output_tokens)
    print(f"{'request':28}{'status':>7}{'prompt':>8}{'cached':>8}{'counted':>9}{'ttft s':>9}"
          f"{'total s':>9}{'prompt tok/s':>14}")  # fmt: skip
    total_prompt = total_time = 0.0
    agree = compared = full_repeats = repeats = 0
    base = f"http://127.0.0.1:{port}"
    try:
        for n in range(args.passes):
            for path in paths:
                for i, line in enumerate(path.read_text().splitlines()):
                    captured = json.loads(line)
                    r = replay(base, captured)
                    counted = count_tokens(base, captured) if args.count else None
                    ttft = r["ttft"] or 0.0
                    rate = r["prompt"] / ttft if ttft else 0.0
                    if r["status"] == 200:
                        total_prompt += r["prompt"]
                        total_time += ttft
                        if counted is not None:
                            compared += 1
                            agree += counted == r["prompt"]
                        if n > 0:
                            repeats += 1
                            full_repeats += r["cached"] >= r["prompt"] - 1
                    name = f"{path.stem}[{i}]" + (f" #{n + 1}" if args.passes > 1 else "")
                    shown = "" if counted is None else str(counted)
                    print(f"{name:28}{r['status']:>7}{r['prompt']:>8}{r['cached']:>8}{shown:>9}"
                          f"{ttft:>9.2f}{r['total']:>9.2f}{rate:>14.1f}", flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)
    if compared:
        print(f"\nusage == count_tokens: {agree} of {compared} responses")
    if repeats:
        print(f"repeats reading prompt - 1 or more from cache: {full_repeats} of {repeats}")
    if total_time:
        print(f"\nall 200s: {total_prompt:.0f} prompt tokens, {total_time:.1f} s to first "
              f"token in total ({total_prompt / total_time:.1f} tok/s)")  # fmt: skip


if __name__ == "__main__":
    main()
