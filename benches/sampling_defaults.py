"""How often the embedded model answers "What is the capital of France?" with "Paris", as
a new user gets it from `make serve`: no temperature in the request.

Starts `compat-serve` with no `--model` (the embedded SmolLM2-135M-Instruct, whose sampling
defaults are its model card's temperature 0.2 / top_p 0.9), then asks the question `--n`
times for each setting:

- `defaults`: no sampling fields (OpenAI chat, seeds 0..n-1);
- `claude-code`: no sampling fields and no seed, through `/v1/messages` (what Claude Code
  sends);
- `t=1.0`: temperature 1.0 and top_p 1.0 sent (the former default), seeds 0..n-1;
- `greedy`: temperature 0.

It prints the share of answers containing "Paris" and the first answers of each setting.

Run: `.venv/bin/python benches/sampling_defaults.py [--n 30] [--max-tokens 24]`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import httpx

from _servers import BIN, _spawn, _wait_ready, free_port, log

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ask_openai(base: str, max_tokens: int, **fields: Any) -> str:
    body = {"model": "m", "messages": QUESTION, "max_tokens": max_tokens, **fields}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


def ask_anthropic(base: str, max_tokens: int) -> str:
    body = {"model": "claude-sonnet", "messages": QUESTION, "max_tokens": max_tokens}
    response = httpx.post(f"{base}/v1/messages", json=body, timeout=300)
    response.raise_for_status()
    return "".join(b.get("text", "") for b in response.json()["content"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=30, help="answers per setting")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        port = free_port()
        cmd = [str(BIN / "compat-serve"), "--port", str(port), "--log-level", "warning"]
        server = _spawn("compat-serve", cmd, Path(tmp), port)
        try:
            _wait_ready(server, "/health", 300)
            base = server.base_url
            card = httpx.get(f"{base}/v1/models").json()["data"][0]
            print(f"sampling defaults: {card['sampling_defaults']}")
            settings = {
                "defaults": lambda s: ask_openai(base, args.max_tokens, seed=s),
                "claude-code": lambda s: ask_anthropic(base, args.max_tokens),
                "t=1.0": lambda s: ask_openai(
                    base, args.max_tokens, seed=s, temperature=1.0, top_p=1.0
                ),
                "greedy": lambda s: ask_openai(base, args.max_tokens, temperature=0),
            }
            for name, ask in settings.items():
                log(f"{name}: {args.n} answers")
                answers = [ask(seed) for seed in range(args.n)]
                hits = sum("Paris" in a for a in answers)
                print(f"{name:12s} Paris {hits}/{args.n} ({hits / args.n:.0%})")
                for answer in answers[:3]:
                    print(f"{'':12s} {answer!r}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
