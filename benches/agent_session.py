"""Prefix caching (issue #5): a scripted agent session, compat-serve vs mlx_lm.server.

1. A 10-turn agent session over the OpenAI chat API (streaming, temperature 0, small
   max_tokens): a system prompt and a task, then each turn appends the previous assistant
   reply exactly as the server streamed it plus a ~250-token tool result (command output as
   a user message: the embedded model's template has no tool role), so the context grows
   to ~3k tokens. Per turn: prompt tokens (usage), TTFT = time to the first streamed content
   chunk, and the cached tokens each server reports (`usage.prompt_tokens_details.
   cached_tokens`). With max_tokens this small, a turn's prefill time is its TTFT (prompt
   processing plus one decode step), so total session prefill time = the sum of TTFTs.
2. A ~4k-token prompt sent cold (its first message is unique, so nothing is cached), then
   again with a new ~50-token user message appended after the echoed reply (warm); TTFT of
   both and their ratio.

Both servers load the dense float32 directory `compat-serve convert-gguf --dtype float32`
writes from the embedded GGUF, with the same OpenBLAS loaded before mlx (checked in
/proc/PID/maps and printed), one after the other, never together, each with its own prompt
cache on (mlx_lm.server's default: 10 entries, no byte limit). Prefill chunk: compat-serve
`--prefill-chunk P` = mlx_lm.server `--prefill-step-size P` (default 512 for both).

Targets (issue #5): warm TTFT >= 20x faster than cold; total session prefill time below
mlx_lm.server's.

3. `--pins` (#44): 12 concurrent sessions with pinned ~2k-token system prompts and tools
   under a small cache, a burst of unrelated traffic between turns; the pinned prefix is
   read on every later turn with the breakpoints (24/24 turns) and on none without them
   (0/24), see benches/agent_session_pins.py.

Run: `.venv/bin/python benches/agent_session.py [--quick] [--turns 10]`: sections 1-2,
then 3 with its defaults (`--no-pins` leaves it out); `--pins [its flags]` runs 3 alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from _servers import (
    Server,
    StreamResult,
    TokenCounter,
    converted_model_dir,
    describe_blas,
    environment_lines,
    log,
    make_client,
    running,
    start_compat_serve,
    start_mlx_lm_server,
    stream_chat,
    tool_output,
)

MODEL = "default_model"  # mlx_lm.server resolves any other name on the hub

SYSTEM = """\
You are a coding agent working in a git repository on the user's machine. You can run shell \
commands and read files; the user pastes the output of each command you ask for. Work in \
small steps: say which command you want to run next and why, in one or two sentences, then \
wait for its output. Never invent file contents or command output you have not seen.

Rules:
- Prefer reading the code over guessing. Use grep to find definitions and callers.
- Run the failing test first, then the smallest set of tests that covers your change.
- Keep changes minimal and in the style of the surrounding code; do not reformat files.
- Never commit, push, or delete files unless the user asks you to.
- When a command fails, read the error carefully before trying something else.
- If you are unsure what the user wants, ask one precise question.

When the task is done, summarise what you changed, which tests you ran and their result, \
and anything the user should double-check. Be concise: the user reads every word. Use \
Markdown code blocks for commands and file excerpts, and name files with their path \
relative to the repository root.

Environment: Linux, Python 3.11, a virtualenv in .venv, tests run with pytest, formatting \
with ruff. The repository is a small inference server with a Rust core and a Python layer."""

TASK = (
    "The test tests/unit/test_scheduler.py::test_preempt_recomputes started failing after "
    "yesterday's refactor of the block pool. Find the cause and fix it. Start by looking "
    "around the repository."
)
COMMANDS = [
    "ls -la src", "grep -rn refcount src tests", "pytest -q tests/unit", "git log --oneline -8",
    "sed -n 1,60p src/engine/scheduler.py", "grep -rn evict src", "pytest -q -x tests",
    "git diff HEAD~1 --stat", "sed -n 80,140p src/engine/block_pool.py", "ls -la tests/unit",
]  # fmt: skip


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    ttft: float
    cached: int | None
    completion_tokens: int


@dataclass
class ColdWarm:
    cold: StreamResult
    warm: StreamResult


@dataclass
class Run:
    name: str
    blas: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    cold_warm: ColdWarm | None = None


def body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def checked(r: StreamResult, what: str) -> StreamResult:
    if r.status != 200:
        raise RuntimeError(f"{what}: HTTP {r.status}: {r.error}")
    return r


def run_session(
    client: httpx.Client, server: Server, counter: TokenCounter, args: argparse.Namespace
) -> list[Turn]:
    system = counter.truncate(SYSTEM, args.system_tokens)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
    turns: list[Turn] = []
    for n in range(1, args.turns + 1):
        if n > 1:
            command = COMMANDS[(n - 2) % len(COMMANDS)]
            output = tool_output(counter, args.tool_tokens, seed=n)
            messages.append({"role": "user", "content": f"$ {command}\n\n{output}"})
        r = checked(stream_chat(client, server.base_url, body(messages, args.max_tokens)), "turn")
        turns.append(Turn(n, r.prompt_tokens, r.ttft, r.cached_tokens, r.completion_tokens))
        log(
            f"  {server.name} turn {n}: {r.prompt_tokens} prompt tokens, TTFT {r.ttft:.2f}s, "
            f"cached {r.cached_tokens}, reply {r.text[:60]!r}"
        )
        messages.append({"role": "assistant", "content": r.text})  # echoed exactly
    return turns


def run_cold_warm(
    client: httpx.Client, server: Server, counter: TokenCounter, args: argparse.Namespace
) -> ColdWarm:
    # A first message no earlier request shares: the cold request cannot hit any cache.
    system = f"Review session {server.name}-{time.time_ns()}. You review source files."
    document = tool_output(counter, args.long_prompt - counter.count(system) - 20, seed=4242)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Here is the file to review:\n\n{document}"},
    ]
    cold = checked(stream_chat(client, server.base_url, body(messages, 8)), "cold")
    log(f"  {server.name} cold: {cold.prompt_tokens} prompt tokens, TTFT {cold.ttft:.2f}s")
    suffix = counter.truncate(
        "Thanks. Now focus on the error handling only: which of these functions can raise, "
        "what do the callers do when they do, and which call sites silently drop the error? "
        "List them with their line numbers, most serious first, and suggest a fix for each.",
        args.suffix_tokens,
    )
    messages += [
        {"role": "assistant", "content": cold.text},
        {"role": "user", "content": suffix},
    ]
    warm = checked(stream_chat(client, server.base_url, body(messages, 8)), "warm")
    log(
        f"  {server.name} warm: {warm.prompt_tokens} prompt tokens, TTFT {warm.ttft:.2f}s, "
        f"cached {warm.cached_tokens}"
    )
    return ColdWarm(cold, warm)


def bench_server(
    name: str, start: Callable[[Path], Server], counter: TokenCounter, args: argparse.Namespace
) -> Run:
    run = Run(name)
    log(f"== {name}: starting")
    with running(start) as server, make_client() as client:
        run.blas = describe_blas([server])
        log("\n".join(run.blas))
        warmup = [{"role": "user", "content": "Warm-up: say hello."}]
        checked(stream_chat(client, server.base_url, body(warmup, 4)), "warm-up")
        run.turns = run_session(client, server, counter, args)
        if not args.skip_cold_warm:
            run.cold_warm = run_cold_warm(client, server, counter, args)
    return run


def speedup(slow: float, fast: float) -> str:
    return f"{slow / fast:.2f}x" if fast > 0 else "n/a"


def show_cached(value: int | None) -> str:
    return "-" if value is None else str(value)


def print_session(runs: list[Run], args: argparse.Namespace) -> None:
    names = [r.name for r in runs]
    pair = len(runs) == 2
    print(
        f"\n== agent session: {args.turns} turns, ~{args.tool_tokens}-token tool result per "
        f"turn, max_tokens {args.max_tokens}, temperature 0 "
        "(TTFT = prefill time; ratio = mlx_lm TTFT / compat TTFT, > 1: compat faster)"
    )
    header = f"{'turn':>4}{'prompt tokens':>16}" + "".join(f"{n + ' TTFT':>20}" for n in names)
    if pair:
        header += f"{'ratio':>8}"
    header += "".join(f"{n + ' cached':>22}" for n in names)
    print(header)
    for i in range(args.turns):
        turns = [r.turns[i] for r in runs]
        prompts = "/".join(str(t.prompt_tokens) for t in turns)
        line = f"{i + 1:>4}{prompts:>16}" + "".join(f"{t.ttft:>19.2f}s" for t in turns)
        if pair:
            line += f"{speedup(turns[1].ttft, turns[0].ttft):>8}"
        line += "".join(f"{show_cached(t.cached):>22}" for t in turns)
        print(line)
    totals = [sum(t.ttft for t in r.turns) for r in runs]
    prompt_totals = "/".join(str(sum(t.prompt_tokens for t in r.turns)) for r in runs)
    line = f"{'all':>4}{prompt_totals:>16}" + "".join(f"{t:>19.2f}s" for t in totals)
    if pair:
        line += f"{speedup(totals[1], totals[0]):>8}"
    line += "".join(f"{sum(t.cached or 0 for t in r.turns):>22}" for r in runs)
    print(line)
    if pair and [t.prompt_tokens for t in runs[0].turns] != [
        t.prompt_tokens for t in runs[1].turns
    ]:
        print("  (prompt tokens differ between the servers: their replies, echoed back, differ)")


def print_cold_warm(runs: list[Run], args: argparse.Namespace) -> None:
    pairs = [(r.name, r.cold_warm) for r in runs if r.cold_warm is not None]
    if not pairs:
        return
    print(
        f"\n== ~{args.long_prompt}-token prompt cold, then warm: the same conversation plus its "
        f"reply and a new ~{args.suffix_tokens}-token user message (target: warm >= 20x faster)"
    )
    print(f"{'':34}" + "".join(f"{name:>16}" for name, _ in pairs))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:34}" + "".join(f"{v:>16}" for v in values))

    cws = [cw for _, cw in pairs]
    row("cold prompt tokens", [str(cw.cold.prompt_tokens) for cw in cws])
    row("cold cached tokens", [show_cached(cw.cold.cached_tokens) for cw in cws])
    row("cold TTFT", [f"{cw.cold.ttft:.2f}s" for cw in cws])
    row("warm prompt tokens", [str(cw.warm.prompt_tokens) for cw in cws])
    row("warm new tokens (warm - cold)",
        [str(cw.warm.prompt_tokens - cw.cold.prompt_tokens) for cw in cws])  # fmt: skip
    row("warm cached tokens", [show_cached(cw.warm.cached_tokens) for cw in cws])
    row("warm TTFT", [f"{cw.warm.ttft:.2f}s" for cw in cws])
    row("cold / warm", [speedup(cw.cold.ttft, cw.warm.ttft) for cw in cws])
    if len(cws) == 2:
        print(
            f"warm TTFT, mlx_lm / compat: {speedup(cws[1].warm.ttft, cws[0].warm.ttft)}; "
            f"cold TTFT, mlx_lm / compat: {speedup(cws[1].cold.ttft, cws[0].cold.ttft)}"
        )


def main() -> None:
    if "--pins" in sys.argv:
        # Cache breakpoints that hold (#44): with and without pins, in-process on a tiny
        # model (benches/agent_session_pins.py; its own flags follow `--pins`).
        import agent_session_pins

        sys.argv.remove("--pins")
        agent_session_pins.main()
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 3 turns, ~80-token tool results, a ~1024-token long prompt",
    )
    parser.add_argument("--turns", type=int, default=None, help="session turns (default 10)")
    parser.add_argument("--tool-tokens", type=int, default=None, help="per turn (default 250)")
    parser.add_argument(
        "--system-tokens", type=int, default=None, help="system prompt (default its ~300)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="per turn (default 24)")
    parser.add_argument(
        "--long-prompt", type=int, default=None, help="cold prompt tokens (default 4096)"
    )
    parser.add_argument("--suffix-tokens", type=int, default=50)
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="compat-serve --prefill-chunk and mlx_lm.server --prefill-step-size (default 512)",
    )
    parser.add_argument("--skip-cold-warm", action="store_true")
    parser.add_argument("--only", choices=("compat-serve", "mlx_lm.server"))
    parser.add_argument(
        "--no-pins", action="store_true", help="leave out section 3 (with and without pins)"
    )
    args = parser.parse_args()
    args.turns = args.turns or (3 if args.quick else 10)
    args.tool_tokens = args.tool_tokens or (80 if args.quick else 250)
    args.system_tokens = args.system_tokens or (100 if args.quick else 10_000)
    args.max_tokens = args.max_tokens or (12 if args.quick else 24)
    args.long_prompt = args.long_prompt or (1024 if args.quick else 4096)

    model_dir = converted_model_dir()
    counter = TokenCounter(model_dir)
    chunk = str(args.prefill_chunk)
    ours_args = ["--prefill-chunk", chunk]
    theirs_args = ["--prefill-step-size", chunk]
    servers: list[tuple[str, Callable[[Path], Server]]] = [
        ("compat-serve", lambda d: start_compat_serve(model_dir, ours_args, d)),
        ("mlx_lm.server", lambda d: start_mlx_lm_server(model_dir, theirs_args, d)),
    ]
    load_before = os.getloadavg()[0]
    runs = [
        bench_server(name, start, counter, args)
        for name, start in servers
        if args.only in (None, name)
    ]

    print("\n".join(environment_lines(model_dir)) + f" (at start: {load_before:.2f})")
    print(f"compat-serve args:  {' '.join(ours_args)}")
    print(f"mlx_lm.server args: {' '.join(theirs_args)} (prompt cache: its defaults)")
    print("BLAS mapped into each server process:")
    for r in runs:
        print("\n".join(r.blas))
    print_session(runs, args)
    print_cold_warm(runs, args)
    if not args.no_pins:
        run_pins_section()


def run_pins_section() -> None:
    """Section 3 with its own defaults: both figures, with and without pins (#44)."""
    import agent_session_pins

    print("\n== cache breakpoints (#44): with and without pins ==")
    sys.argv = sys.argv[:1]
    agent_session_pins.main()


if __name__ == "__main__":
    main()
