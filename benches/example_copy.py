"""Does the embedded model copy the envelope instructions' example? (#25 item 5)

Ten OpenCode-shaped chat requests (tests/http/opencode_shapes.py: OpenCode's ten tools
with `$schema` keys as the AI SDK sends them, a system prompt that differs only in its
working directory and date) ask the embedded SmolLM2-135M a plain question through
`/v1/chat/completions`. Its template renders no tools, so they are told in the system
prompt and the answer is the JSON envelope (chat/tool_injection.py). Prints each answer,
the prompt tokens, and how many of the ten answer without copying an example.
Target: >= 9 of 10.

Run: `.venv/bin/python benches/example_copy.py [--max-tokens N]` (a few minutes on a
2-core CPU: ~1k prompt tokens each).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.http.opencode_shapes import (  # noqa: E402
    TASK,
    Answer,
    answers_without_copying,
    ask,
    opencode_body,
)

from compat_serve.models.loader import load_model  # noqa: E402

PROMPTS = 10
TASK_MAX_TOKENS = 128


def timed(client: httpx.Client, i: int, body: dict[str, Any]) -> Answer:
    started = time.monotonic()
    answer = ask(client, body)
    seconds = time.monotonic() - started
    answered = answers_without_copying(answer.text)
    verdict = "ok" if answered else "calls" if answer.calls else "COPIED"
    print(
        f"{i}: {verdict:6} {seconds:5.1f}s prompt={answer.prompt_tokens} "
        f"finish={answer.finish_reason} calls={answer.calls} text={answer.text[:80]!r}",
        flush=True,
    )
    return answer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--skip-answers", action="store_true", help="only the tool task")
    args = parser.parse_args()
    server = start_server(load_model(None))
    clean = called = 0
    try:
        with httpx.Client(base_url=server.base_url, timeout=1800) as client:
            for i in range(0 if args.skip_answers else args.prompts):
                answer = timed(client, i, opencode_body(i, args.max_tokens))
                clean += answers_without_copying(answer.text)
            for i in range(args.prompts):
                answer = timed(client, i, opencode_body(i, TASK_MAX_TOKENS, ask=TASK))
                called += bool(answer.calls)
    finally:
        server.stop()
    if not args.skip_answers:
        print(f"answered without copying the example: {clean} of {args.prompts}")
    print(f"called a tool for {TASK!r}: {called} of {args.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
