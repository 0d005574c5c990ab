"""Soak: many multi-turn sessions; the server's RSS and cache bytes must level off.

Starts compat-serve as a subprocess on 127.0.0.1 (the embedded default model unless
`--model`) and runs `--sessions` (default 300) sessions, `--concurrency` (default 4) at a
time. Each session has 2-4 turns and resends its growing history every turn, like an agent;
sessions alternate between the OpenAI chat completions and the Anthropic messages API, and
turns alternate between streamed and non-streamed. Every session shares one system prompt
(a prefix cache hit for all) and opens with its own ~150-token user message (new cache
blocks for each), so the prefix cache fills, then evicts.

Every `--sample-every` seconds the bench samples the server process's RSS (VmRSS from
/proc/PID/status) and `/metrics` (`compat_prefix_cache_bytes`, `compat_prefix_cache_blocks`,
`compat_kv_cache_bytes`). At the end it prints a small table of the samples (evenly
thinned to `--table-rows`) and a verdict.

The prefix cache is bounded with `--cache-memory` (default 128MB here rather than the
server's 20% of RAM, which 300 short sessions would never fill): memory must stop growing
once the cache is full, so warm-up ends well inside the run.

Verdict, "flat after warm-up": the samples are split by completed sessions into thirds
(the first third is warm-up). RSS is flat when the median RSS of the last third exceeds the
median of the middle third by at most max(`--rss-tolerance` percent of it, `--rss-slack`
MiB); defaults 5% and 48 MiB (allocator noise of a few pooled MLX buffers). The line fitted
to the RSS of the last two thirds is printed too (MiB per 100 sessions). The prefix cache
must stay within its capacity (`compat_prefix_cache_blocks` <= `..._capacity_blocks`), and
after the last session the server must be idle: no running or queued request, no reserved
KV tokens, `compat_kv_cache_bytes` 0.

Exit status 1 when a turn failed (5xx, error event, lost, hung; 429/529 are retried), when
the server is not idle at the end, the cache exceeds its capacity, or RSS is not flat.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from _servers import Server, log
from load import (
    BACKPRESSURE,
    COMPLETED,
    FAILURES,
    Outcome,
    Spec,
    compat_server,
    fetch_metrics,
    is_idle,
    make_async_client,
    rss_bytes,
    send,
    wait_idle,
)

SYSTEM_PROMPT = (
    "You are a patient assistant helping a developer who is working through a long list of "
    "small questions about their project. Keep every answer short: one or two sentences, "
    "no lists, no code blocks, no headings. If a question is unclear, make a reasonable "
    "assumption and say which one. Refer back to earlier turns of the conversation when "
    "that helps. Never repeat the question. Prefer plain words over jargon."
)
WORDS = [
    "module",
    "cache",
    "request",
    "buffer",
    "thread",
    "queue",
    "socket",
    "handler",
    "parser",
    "token",
    "block",
    "prefix",
    "session",
    "config",
    "record",
    "schema",
    "index",
    "batch",
    "stream",
    "window",
    "header",
    "payload",
    "client",
    "server",
    "worker",
    "signal",
    "timer",
    "budget",
    "memory",
    "layer",
    "kernel",
    "tensor",
    "vector",
    "matrix",
    "shard",
    "replica",
    "commit",
    "branch",
    "review",
    "release",
    "deploy",
    "rollback",
    "metric",
    "alert",
    "trace",
    "span",
    "sample",
]
FOLLOW_UPS = [
    "Can you say that more simply?",
    "What is the most common mistake there?",
    "How would I test that?",
    "Give me one concrete example.",
    "What should I check first?",
]
MIB = 2**20


@dataclass
class Sample:
    t: float
    sessions_done: int
    rss: int | None
    prefix_bytes: float | None
    prefix_blocks: float | None
    kv_bytes: float | None


@dataclass
class SoakState:
    sessions_done: int = 0
    turns: list[Outcome] = field(default_factory=list)
    backpressure: int = 0
    failures: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


def first_message(rng: random.Random, sid: int) -> str:
    notes = " ".join(rng.choice(WORDS) for _ in range(110))
    return f"Session {sid}. My notes so far: {notes}. What should I look at first?"


async def run_session(
    sid: int,
    client: httpx.AsyncClient,
    base: str,
    args: argparse.Namespace,
    state: SoakState,
) -> None:
    rng = random.Random(args.seed * 100_003 + sid)
    api = "openai" if sid % 2 == 0 else "anthropic"
    history = [{"role": "user", "content": first_message(rng, sid)}]
    for turn in range(rng.randint(args.min_turns, args.max_turns)):
        if turn:
            history.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
        spec = Spec(
            api=api,
            stream=(sid + turn) % 2 == 0,
            system=SYSTEM_PROMPT,
            messages=list(history),
            max_tokens=args.max_tokens,
            temperature=0.0,
        )
        for _attempt in range(args.max_retries + 1):
            out = await send(client, base, spec, args.request_timeout)
            if out.kind != BACKPRESSURE:
                break
            state.backpressure += 1
            await asyncio.sleep(rng.uniform(0.5, 2.0))
        state.turns.append(out)
        if out.kind != COMPLETED:
            state.failures.append(
                f"session {sid} turn {turn} {api} stream={spec.stream}: {out.kind} "
                f"status={out.status} {out.detail}"
            )
            break  # the session cannot continue without the reply
        history.append({"role": "assistant", "content": out.text or "(no answer)"})
    state.sessions_done += 1


async def take_sample(
    client: httpx.AsyncClient, base: str, server: Server, state: SoakState, t0: float
) -> Sample:
    metrics = await fetch_metrics(client, base)
    sample = Sample(
        t=time.monotonic() - t0,
        sessions_done=state.sessions_done,
        rss=rss_bytes(server.proc.pid),
        prefix_bytes=metrics.get("compat_prefix_cache_bytes"),
        prefix_blocks=metrics.get("compat_prefix_cache_blocks"),
        kv_bytes=metrics.get("compat_kv_cache_bytes"),
    )
    state.samples.append(sample)
    return sample


async def sampler(
    client: httpx.AsyncClient,
    base: str,
    server: Server,
    state: SoakState,
    stop: asyncio.Event,
    args: argparse.Namespace,
    t0: float,
) -> None:
    last_log = 0.0
    while not stop.is_set():
        s = await take_sample(client, base, server, state, t0)
        if s.t - last_log >= args.progress_every:
            last_log = s.t
            log(
                f"  t={s.t:5.0f}s sessions {s.sessions_done}/{args.sessions} turns "
                f"{len(state.turns)} RSS {fmt_mib(s.rss)} MiB prefix cache "
                f"{fmt_mib(s.prefix_bytes)} MiB kv {fmt_mib(s.kv_bytes)} MiB"
            )
        if server.proc.poll() is not None:
            log(f"!! server exited with {server.proc.returncode}")
            stop.set()
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=args.sample_every)
        except TimeoutError:
            continue


def fmt_mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}"


async def run_soak(args: argparse.Namespace, server: Server) -> int:
    base = server.base_url
    state = SoakState()
    stop = asyncio.Event()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for sid in range(args.sessions):
        queue.put_nowait(sid)

    async def worker() -> None:
        while not stop.is_set():
            try:
                sid = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await run_session(sid, client, base, args, state)

    async with make_async_client(args.concurrency + 4) as client:
        t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(client, base, server, state, stop, args, t0))
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        died = server.proc.poll() is not None
        stop.set()
        await sampling
        status: dict[str, Any] = {}
        if not died:
            status = await wait_idle(client, base, 30)
            await take_sample(client, base, server, state, t0)  # the idle end state
            metrics = await fetch_metrics(client, base)
        else:
            metrics = {}
    return report(args, state, wall, status, metrics, died)


def thirds(samples: list[Sample], sessions: int) -> tuple[list[Sample], list[Sample]]:
    """Samples of the middle and last thirds of the run, by sessions completed."""
    middle = [s for s in samples if sessions / 3 <= s.sessions_done < 2 * sessions / 3]
    last = [s for s in samples if s.sessions_done >= 2 * sessions / 3]
    return middle, last


def slope_per_100(samples: list[Sample]) -> float:
    """Least-squares RSS growth in MiB per 100 sessions."""
    pts = [(s.sessions_done, s.rss / MIB) for s in samples if s.rss is not None]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return float("nan")
    return statistics.linear_regression([x for x, _ in pts], [y for _, y in pts]).slope * 100


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(
    args: argparse.Namespace,
    state: SoakState,
    wall: float,
    status: dict[str, Any],
    metrics: dict[str, float],
    died: bool,
) -> int:
    turns = state.turns
    kinds = Counter(t.kind for t in turns)
    failed = sum(kinds[k] for k in FAILURES)
    ok = [t for t in turns if t.kind == COMPLETED]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    gen = sum(t.output_tokens for t in ok)
    print(
        f"== soak: {args.sessions} sessions ({args.min_turns}-{args.max_turns} turns, "
        f"{args.concurrency} at a time, max_tokens {args.max_tokens}), "
        f"--cache-memory {args.cache_memory or 'server default'}, wall {wall:.0f}s"
    )
    print(
        f"sessions done {state.sessions_done}, turns {len(turns)}: {dict(kinds)}; "
        f"backpressure retries {state.backpressure}"
    )
    print(
        f"prompt tokens {prompt} ({cached} from cache = {cached / max(prompt, 1):.0%}), "
        f"generated {gen} ({gen / wall:.1f} tok/s)"
    )

    samples = state.samples
    rows = samples
    if len(samples) > args.table_rows:
        step = (len(samples) - 1) / (args.table_rows - 1)
        rows = [samples[round(i * step)] for i in range(args.table_rows)]
    print(
        f"\n{'t (s)':>7}{'sessions':>10}{'RSS MiB':>10}{'prefix MiB':>12}{'blocks':>8}{'kv MiB':>9}"
    )
    for s in rows:
        blocks = "n/a" if s.prefix_blocks is None else f"{s.prefix_blocks:.0f}"
        print(
            f"{s.t:>7.0f}{s.sessions_done:>10}{fmt_mib(s.rss):>10}{fmt_mib(s.prefix_bytes):>12}"
            f"{blocks:>8}{fmt_mib(s.kv_bytes):>9}"
        )
    print(f"({len(samples)} samples every {args.sample_every:.0f}s; {len(rows)} shown)\n")

    middle, last = thirds(samples, args.sessions)
    rss_mid = median_of([s.rss for s in middle])
    rss_last = median_of([s.rss for s in last])
    rss_max = max((s.rss for s in samples if s.rss is not None), default=None)
    flat = False
    if rss_mid is not None and rss_last is not None:
        allowed = max(rss_mid * args.rss_tolerance / 100, args.rss_slack * MIB)
        growth = rss_last - rss_mid
        flat = growth <= allowed
        print(
            f"RSS median: middle third {fmt_mib(rss_mid)} MiB, last third {fmt_mib(rss_last)} "
            f"MiB, growth {growth / MIB:+.1f} MiB (allowed {allowed / MIB:.1f}); max "
            f"{fmt_mib(rss_max)} MiB; slope over the last two thirds "
            f"{slope_per_100(middle + last):+.1f} MiB/100 sessions"
        )
    else:
        print("RSS: not enough samples in the middle and last thirds (run more sessions)")
    pc_mid = median_of([s.prefix_bytes for s in middle])
    pc_last = median_of([s.prefix_bytes for s in last])
    pc_max = max((s.prefix_bytes or 0 for s in samples), default=0)
    capacity = metrics.get("compat_prefix_cache_capacity_blocks")
    max_blocks = max((s.prefix_blocks or 0 for s in samples), default=0)
    bounded = capacity is None or max_blocks <= capacity
    print(
        f"prefix cache bytes median: middle {fmt_mib(pc_mid)} MiB, last {fmt_mib(pc_last)} "
        f"MiB, max {fmt_mib(pc_max)} MiB; blocks max {max_blocks:.0f} of capacity "
        f"{'n/a' if capacity is None else f'{capacity:.0f}'}; evictions "
        f"{metrics.get('compat_prefix_cache_evictions', float('nan')):.0f}, hit ratio "
        f"{metrics.get('compat_prefix_cache_hit_ratio', float('nan')):.2f}"
    )
    kv_end = metrics.get("compat_kv_cache_bytes")
    idle = is_idle(status) and kv_end == 0
    shown = {k: status.get(k) for k in ("queue_depth", "running", "kv_tokens_reserved")}
    print(f"server idle at the end: {'yes' if idle else 'NO'} {shown}, kv_cache_bytes {kv_end}")
    if died:
        print("!! the server process died during the run")
    for line in state.failures[:10]:
        print(f"  FAIL {line}")
    verdicts = {
        "turns ok": failed == 0 and not died,
        "RSS flat after warm-up": flat,
        "prefix cache within capacity": bounded,
        "idle at the end": idle,
    }
    print("verdict: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in verdicts.items()))
    return 0 if all(verdicts.values()) else 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=300, help="sessions (300)")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions at a time (4)")
    parser.add_argument("--min-turns", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="per turn (24)")
    parser.add_argument(
        "--cache-memory",
        default="128MB",
        help="compat-serve --cache-memory (128MB; '' = the server's default)",
    )
    parser.add_argument("--sample-every", type=float, default=3.0, help="seconds (3)")
    parser.add_argument("--table-rows", type=int, default=16, help="rows of the table (16)")
    parser.add_argument(
        "--rss-tolerance", type=float, default=5.0, help="percent of the middle third (5)"
    )
    parser.add_argument("--rss-slack", type=float, default=48.0, help="MiB always allowed (48)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds (300)")
    parser.add_argument("--max-retries", type=int, default=5, help="on 429/529 (5)")
    parser.add_argument("--progress-every", type=float, default=30.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="compat-serve --model (default embedded)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra compat-serve argument"
    )
    args = parser.parse_args()
    if args.table_rows < 2:
        parser.error("--table-rows must be at least 2")
    extra = [*(["--cache-memory", args.cache_memory] if args.cache_memory else []),
             *args.server_arg]  # fmt: skip
    with compat_server(args.model, extra) as server:
        code = asyncio.run(run_soak(args, server))
    sys.exit(code)


if __name__ == "__main__":
    main()
