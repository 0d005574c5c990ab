"""How fast a prompt longer than the served window is refused, idle and while streams decode.

Issue #26: a prompt over the window gets the API's own 400 "within 100 ms of the request
arriving, whatever else the server is doing". The server runs the embedded model with
`--kv-memory 24MiB --context-length auto --kv-bits 8` (a window under 2,000 tokens); the
prompt is 2,500 words. For each of Anthropic Messages, OpenAI chat and Responses (streamed:
the time to its `response.failed` event) the bench times `--tries` refusals, alternating
the APIs, first idle and then while `--streams` requests decode (each restarts when it
ends), and prints the median and the min-max spread in milliseconds.

Run: `.venv/bin/python benches/refusal_latency.py [--tries 9] [--streams 4]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _servers import BIN, _spawn, _wait_ready, free_port, log

LONG_TEXT = "word " * 2500
STORY = "Write a long story about a fox who learns to count."
HEADERS = {"anthropic-version": "2023-06-01"}


def anthropic(client: httpx.Client) -> None:
    body = {"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": LONG_TEXT}]}
    response = client.post("/v1/messages", json=body, headers=HEADERS)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("prompt is too long:")


def openai_chat(client: httpx.Client) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": LONG_TEXT}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"


def responses(client: httpx.Client) -> None:
    body = {"model": "m", "input": LONG_TEXT, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("event: response.failed"):
                return
    raise AssertionError("no response.failed event")


APIS = {"anthropic": anthropic, "openai chat": openai_chat, "responses": responses}


def timed_round(client: httpx.Client, tries: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in APIS}
    for _ in range(tries):
        for name, call in APIS.items():
            start = time.perf_counter()
            call(client)
            times[name].append((time.perf_counter() - start) * 1000)
            time.sleep(0.2)
    return times


def decode_forever(base_url: str, stop: threading.Event, tokens: list[int]) -> None:
    body = {"model": "m", "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": STORY}]}  # fmt: skip
    with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
        while not stop.is_set():
            with client.stream("POST", "/v1/messages", json=body, headers=HEADERS) as response:
                for line in response.iter_lines():
                    if line.startswith("event: content_block_delta"):
                        tokens[0] += 1
                    if stop.is_set():
                        break


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=9)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    cmd = [str(BIN / "compat-serve"), "--port", str(port), "--log-level", "warning",
           "--kv-memory", "24MiB", "--context-length", "auto", "--kv-bits", "8"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        server = _spawn("compat-serve", cmd, Path(tmp), port)
        try:
            _wait_ready(server, "/health", 300)
            log(f"load average before: {os.getloadavg()[0]:.2f}")
            with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
                idle = timed_round(client, args.tries)
                stop = threading.Event()
                tokens = [0]
                threads = [
                    threading.Thread(target=decode_forever, args=(server.base_url, stop, tokens))
                    for _ in range(args.streams)
                ]
                for thread in threads:
                    thread.start()
                time.sleep(5)  # every stream past its prefill
                before = tokens[0]
                loaded_start = time.perf_counter()
                busy = timed_round(client, args.tries)
                rate = (tokens[0] - before) / (time.perf_counter() - loaded_start)
                stop.set()
                for thread in threads:
                    thread.join(60)
            log(f"load average after: {os.getloadavg()[0]:.2f}")
        finally:
            server.stop()
    print(f"refusal latency, ms: median (min-max) of {args.tries}; 2,500 words, window < 2,000")
    print(f"| API | idle | {args.streams} streams decoding ({rate:.1f} tok/s in all) |")
    print("|---|---|---|")
    for name in APIS:
        print(f"| {name} | {spread(idle[name])} | {spread(busy[name])} |")


if __name__ == "__main__":
    main()
