"""Does `response_format: {"type": "json_object"}` end when the model ends the object?
(#25 item 7)

Ten default-body chat requests (max_tokens 1024, no temperature: what an SDK sends)
ask the embedded SmolLM2-135M for a small JSON object, all at once (one batched
generation). Prints each reply's finish reason, completion tokens and start, and how many
of the ten end by themselves (finish_reason "stop") rather than at max_tokens; each
reply is checked to be one JSON object.

Run: `.venv/bin/python benches/json_object_ends.py` (a few minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from tests.conftest import start_server  # noqa: E402

from compat_serve.models.loader import load_model  # noqa: E402

PROMPTS = [
    "Give me a JSON object describing a cat with its name and age.",
    "Return JSON with the keys city and country for the capital of France.",
    "Describe a book (title, author, year) as JSON.",
    "Reply in JSON: is 7 a prime number?",
    "Make a JSON object for a user named Ana who is 31.",
    "List three colors in a JSON object under the key colors.",
    "Give the weather in Paris as JSON (temperature and sky).",
    "Output a JSON object with a greeting message.",
    "Summarize this in JSON with a title field: the meeting moved to Monday.",
    "Return a JSON object counting the words in 'hello big world'.",
]


async def ask(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "response_format": {"type": "json_object"},
        "max_tokens": max_tokens,
    }
    reply = await client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    return reply.json()  # type: ignore[no-any-return]


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


async def run(base_url: str, max_tokens: int) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        replies = await asyncio.gather(*(ask(client, p, max_tokens) for p in PROMPTS))
    ended = 0
    for i, reply in enumerate(replies):
        choice = reply["choices"][0]
        text = choice["message"]["content"] or ""
        stopped = choice["finish_reason"] == "stop"
        ended += stopped
        valid = "object" if is_object(text) else "NOT AN OBJECT" if stopped else "cut"
        tokens = reply["usage"]["completion_tokens"]
        print(f"{i}: {choice['finish_reason']:6} {tokens:5} tokens {valid:13} {text[:70]!r}")
    return ended


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=1024)
    args = parser.parse_args()
    server = start_server(load_model(None))
    try:
        started = time.monotonic()
        ended = asyncio.run(run(server.base_url, args.max_tokens))
        seconds = time.monotonic() - started
    finally:
        server.stop()
    print(f"ended by the model (finish_reason stop): {ended} of {len(PROMPTS)} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
