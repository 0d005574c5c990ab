"""Cache breakpoints that hold (#44): 12 concurrent agent sessions under a small
`--cache-memory`, each with its own ~2k-token system prompt and tools marked
`cache_control` (1h), then turns that append tool output. With the breakpoints, every
turn after the first reads the pinned prefix from cache while unpinned history is
evicted; the same run without them (the breakpoints stripped) shows the misses.

The figures are token counts from `usage` (`cache_read_input_tokens`), which depend on the
prompt's tokens and the cache, not on what the model says: the server runs a tiny random
llama with the embedded model's tokenizer and ChatML template (tests/tiny_models.py),
in-process, so the run takes seconds to minutes on a CPU. `benches/agent_session.py --pins`
runs this.

Run: `.venv/bin/python benches/agent_session_pins.py [--sessions 12] [--turns 3]`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = 16


def system_prompt(session: int, words: int) -> str:
    rules = " ".join(
        f"Rule {session}.{i}: check the output of command {i} twice." for i in range(words // 8)
    )
    return f"You are coding agent number {session}. {rules}"


def tools(session: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"run_{session}_{i}",
            "description": f"Runs shell command family {i} for session {session}.",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        }
        for i in range(4)
    ]


def burst(url: str, n: int) -> None:
    """Unrelated one-off prompts (other clients, subagents): ~3k new tokens each."""
    with httpx.Client(timeout=600) as client:
        for i in range(n):
            text = " ".join(f"doc {i}.{j} says nothing new" for j in range(400))
            body = {"model": "m", "max_tokens": 1,
                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            client.post(f"{url}/v1/messages", json=body).raise_for_status()


def session_run(
    url: str, session: int, *, turns: int, pinned: bool, words: int, between: threading.Barrier
) -> list[dict[str, int]]:
    control = {"type": "ephemeral", "ttl": "1h"}
    system: list[dict[str, Any]] = [{"type": "text", "text": system_prompt(session, words)}]
    tool_defs = tools(session)
    if pinned:
        system[0]["cache_control"] = control
        tool_defs[-1]["cache_control"] = control
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Task {session}: fix the build."}
    ]
    out = []
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            body = {"model": "m", "max_tokens": 1, "system": system, "tools": tool_defs,
                    "messages": messages}  # fmt: skip
            response = client.post(f"{url}/v1/messages", json=body)
            if response.status_code != 200:
                raise RuntimeError(response.text)
            usage = response.json()["usage"]
            out.append({"turn": turn, **{k: v for k, v in usage.items() if isinstance(v, int)}})
            output = " ".join(f"line {session}.{turn}.{j} ok" for j in range(100))
            between.wait()  # every session idles while other traffic runs
            messages = [
                *messages,
                {"role": "assistant", "content": f"Running step {turn}."},
                {"role": "user", "content": f"Output of step {turn}:\n{output}"},
            ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=900, help="~2k tokens")
    parser.add_argument("--cache-blocks", type=int, default=2200)
    parser.add_argument("--pin-fraction", type=float, default=0.8)
    parser.add_argument("--burst", type=int, default=12, help="one-off prompts between turns")
    parser.add_argument(
        "--max-seqs", type=int, default=2, help="requests running at once; the rest queue"
    )
    args = parser.parse_args()

    from tests.conftest import start_server
    from tests.tiny_models import tiny_model

    from compat_serve.models.loader import load_model

    tiny = tiny_model("llama", load_model(None))
    for pinned in (True, False):
        probe = start_server(tiny, max_output_tokens=1, block_size=BLOCK)
        per_token = probe.state.engine._kv_bytes_per_token  # type: ignore[attr-defined]
        probe.stop()
        server = start_server(
            tiny,
            max_output_tokens=1,
            block_size=BLOCK,
            cache_memory=str(per_token * BLOCK * args.cache_blocks),
            cache_pin_fraction=args.pin_fraction,
            max_num_seqs=args.max_seqs,
            context_length=8192,
        )
        began = time.monotonic()
        try:
            between = threading.Barrier(
                args.sessions, action=partial(burst, server.base_url, args.burst)
            )
            run = partial(
                session_run,
                server.base_url,
                turns=args.turns,
                pinned=pinned,
                words=args.system_words,
                between=between,
            )
            with ThreadPoolExecutor(args.sessions) as pool:
                runs = list(pool.map(run, range(args.sessions)))
            pins = httpx.get(f"{server.base_url}/v1/status").json()["cache_pins"]
        finally:
            server.stop()
        later = [turn for run in runs for turn in run[1:]]
        prompt = sum(t["input_tokens"] + t["cache_read_input_tokens"]
                     + t["cache_creation_input_tokens"] for t in later)  # fmt: skip
        read = sum(t["cache_read_input_tokens"] for t in later)
        system_hits = sum(t["cache_read_input_tokens"] >= 2 * args.system_words for t in later)
        label = "with pins   " if pinned else "without pins"
        print(
            f"{label}: turns 2+ read the ~2k-token prefix on {system_hits}/{len(later)} turns; "
            f"{read}/{prompt} prompt tokens read from cache; {len(pins)} live pins "
            f"({sum(p['tokens'] for p in pins)} tokens); "
            f"{time.monotonic() - began:.1f}s (noisy: shared CPU)"
        )


if __name__ == "__main__":
    main()
