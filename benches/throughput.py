"""Continuous batching (issue #4): compat-serve vs mlx_lm.server, same weights, same run.

1. Total generated tokens/s at concurrency 1, 4, 8, 16: N clients each stream one OpenAI chat
   completion (short distinct prompt, temperature 0, fixed max_tokens); tok/s = completion
   tokens (from each response's usage) / wall time from the first request sent to the last
   response done. EOS is suppressed on both servers so every request generates max_tokens:
   the same body goes to both, carrying `ignore_eos: true` (compat-serve's extension;
   mlx_lm.server ignores it) and `logit_bias: {eos: -1e9}` (mlx_lm.server's way; compat-serve
   ignores it). `--eos natural` sends neither; the token counts are actual counts either way.
2. Inter-token gaps: 4 streams run; once all 4 stream, one request with a ~2k-token prompt is
   sent. Printed: p50/p99/max gap between content chunks of the 4 streams while that prompt
   is prefilled (from sending it to its first token), next to the compute time of one
   prefill chunk measured on the same server alone (a chunk-sized prompt at position 0, the
   long prompt's mean chunk, and its last chunk = TTFT(L) - TTFT(L - chunk)).

Both servers load the dense float32 directory `compat-serve convert-gguf --dtype float32`
writes from the embedded GGUF, with the same OpenBLAS loaded before mlx (checked in
/proc/PID/maps and printed). They run one after the other, never together. Settings kept
comparable: compat-serve `--max-num-seqs S --prefill-chunk P` (token budget per step:
its default P + S); mlx_lm.server `--decode-concurrency S --prefill-step-size P` and its
default `--prompt-concurrency 8`.

Targets (issue #4): >= 1.5x mlx_lm.server at concurrency 8; no gap longer than one prefill
chunk's compute.

Run: `.venv/bin/python benches/throughput.py [--quick] [--concurrency 1,4,8,16]
[--max-tokens 64] [--prefill-chunk 512]`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import threading
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
    eos_token_ids,
    log,
    make_client,
    percentile,
    running,
    start_compat_serve,
    start_mlx_lm_server,
    stream_chat,
    tool_output,
)

TOPICS = [
    "a dragon who learns to bake bread", "a lighthouse keeper and a lost whale",
    "a robot that collects old maps", "two rival chess clubs in a small town",
    "a cat who runs a train station", "a storm that stops every clock in a city",
    "a librarian who finds a door in the archive", "a cook on a ship to the north pole",
    "a child who can talk to bridges", "a painter who paints only the night sky",
    "an astronaut growing tomatoes on the moon", "a detective who is afraid of the dark",
    "a village where it snows upward", "a violin that plays by itself",
    "a mail carrier on a mountain of glass", "a beekeeper and a queen who escaped",
    "a city built on the back of a turtle", "a clockmaker's apprentice and a stolen hour",
    "a gardener who grows lanterns", "a fox who opens a bookshop",
]  # fmt: skip
MODEL = "default_model"  # mlx_lm.server resolves any other name on the hub


@dataclass
class Level:
    concurrency: int
    wall: float
    tokens: int
    ttft_mean: float
    errors: list[str]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0


@dataclass
class Gaps:
    chunk: int
    alone_ttft: dict[int, float] = field(default_factory=dict)  # prompt tokens -> TTFT
    long_tokens: int = 0
    long_ttft_loaded: float = 0.0
    long_cached: int | None = None
    before: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    alive_at_end: int = 0
    streams: int = 0
    stream_tokens: list[int] = field(default_factory=list)


@dataclass
class Run:
    name: str
    blas: list[str] = field(default_factory=list)
    levels: dict[int, list[Level]] = field(default_factory=dict)  # one per repeat
    gaps: Gaps | None = None

    def tok_s(self, c: int) -> float:
        return statistics.median(level.tok_s for level in self.levels[c])

    def errors(self, c: int) -> list[str]:
        return [e for level in self.levels[c] for e in level.errors]


def body(
    messages: list[dict[str, str]], max_tokens: int, eos_bias: dict[str, float] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if eos_bias is not None:
        out["ignore_eos"] = True
        out["logit_bias"] = eos_bias
    return out


def story_prompt(tag: str, i: int) -> list[dict[str, str]]:
    """A ~55-token chat prompt; the tag comes first, so requests share only the template's
    own prefix (its default system prompt) and never each other's text."""
    topic = TOPICS[i % len(TOPICS)]
    return [
        {
            "role": "user",
            "content": f"Request {tag}-{i}: write a long, detailed story about {topic}. "
            "Describe every place, character and conversation in full.",
        }
    ]


def run_concurrent(client: httpx.Client, base: str, bodies: list[dict[str, Any]]) -> Level:
    results: list[StreamResult | None] = [None] * len(bodies)
    errors: list[str] = []
    barrier = threading.Barrier(len(bodies))

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream_chat(client, base, bodies[i])
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r is not None]
    errors += [f"HTTP {r.status}: {r.error}" for r in done if r.status != 200]
    ok = [r for r in done if r.status == 200]
    if not ok:
        return Level(len(bodies), 0.0, 0, 0.0, errors)
    wall = max(r.done for r in ok) - min(r.started for r in ok)
    ttft = sum(r.ttft for r in ok) / len(ok)
    return Level(len(bodies), wall, sum(r.completion_tokens for r in ok), ttft, errors)


def template_overhead(client: httpx.Client, base: str, counter: TokenCounter) -> int:
    """Prompt tokens the chat template adds around a system + user message."""
    system, user = "Overhead probe.", "Say hello."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    r = stream_chat(client, base, body(msgs, 1, None))
    if r.status != 200:
        raise RuntimeError(f"probe failed: HTTP {r.status} {r.error}")
    return r.prompt_tokens - counter.count(system) - counter.count(user)


def long_messages(
    counter: TokenCounter, n_tokens: int, overhead: int, tag: str, seed: int
) -> list[dict[str, str]]:
    """A prompt of about `n_tokens` tokens whose very first message is unique to `tag`, so
    no prefix cache can serve it from an earlier request."""
    system = f"Session {tag}. You review command output for a coding agent."
    n_user = max(n_tokens - overhead - counter.count(system), 16)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": tool_output(counter, n_user, seed)},
    ]


def gap_test(
    client: httpx.Client,
    server: Server,
    counter: TokenCounter,
    args: argparse.Namespace,
    eos_bias: dict[str, float] | None,
) -> Gaps:
    base = server.base_url
    chunk, long_len = args.prefill_chunk, args.long_prompt
    gaps = Gaps(chunk=chunk, streams=args.streams)
    overhead = template_overhead(client, base, counter)

    # The compute of one prefill chunk, on the idle server (distinct prompts: no cache hits).
    for n in sorted({chunk, long_len - chunk, long_len}):
        if n <= 0:
            continue
        tag = f"alone-{n}-{server.name}-{time.time_ns()}"
        msgs = long_messages(counter, n, overhead, tag, seed=n)
        r = stream_chat(client, base, body(msgs, 1, None))
        if r.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status} {r.error}")
        gaps.alone_ttft[n] = r.ttft
        log(
            f"  {server.name}: {r.prompt_tokens}-token prompt alone: TTFT {r.ttft:.2f}s "
            f"(cached {r.cached_tokens})"
        )

    # N streams; once all stream, the long prompt.
    stop = threading.Event()
    streaming = [threading.Event() for _ in range(args.streams)]
    results: list[StreamResult | None] = [None] * args.streams

    def on_chunk_for(i: int) -> Callable[[StreamResult], None]:
        def on_chunk(r: StreamResult) -> None:
            if len(r.chunk_times) >= 3:
                streaming[i].set()

        return on_chunk

    def worker(i: int) -> None:
        b = body(story_prompt("gap", 100 + i), args.gap_stream_tokens, eos_bias)
        try:
            results[i] = stream_chat(client, base, b, on_chunk=on_chunk_for(i), stop=stop)
        finally:
            streaming[i].set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for e in streaming:
        e.wait(600)
    tag = f"loaded-{server.name}-{time.time_ns()}"
    msgs = long_messages(counter, long_len, overhead, tag, seed=10_000 + long_len)
    sent = time.perf_counter()
    r = stream_chat(client, base, body(msgs, 1, None))
    first = r.first_token or r.done
    gaps.long_tokens = r.prompt_tokens
    gaps.long_ttft_loaded = first - sent
    gaps.long_cached = r.cached_tokens
    time.sleep(1.0)  # a few more tokens after the window, then hang up
    stop.set()
    for t in threads:
        t.join()
    for s in results:
        if s is None or s.status != 200:
            continue
        times = s.chunk_times
        gaps.stream_tokens.append(len(times))
        for a, b in itertools.pairwise(times):
            if b <= sent:
                gaps.before.append(b - a)
            elif a < first:
                gaps.during.append(b - a)
        if times and times[-1] >= first:
            gaps.alive_at_end += 1
    log(
        f"  {server.name}: {gaps.long_tokens}-token prompt under load: TTFT "
        f"{gaps.long_ttft_loaded:.2f}s, {len(gaps.during)} gaps in the window, max "
        f"{max(gaps.during, default=0):.3f}s"
    )
    return gaps


def bench_server(
    run: Run,
    start: Callable[[Path], Server],
    counter: TokenCounter,
    args: argparse.Namespace,
    eos_bias: dict[str, float] | None,
    *,
    rep: int,
    gaps: bool,
) -> None:
    name = run.name
    log(f"== {name}: starting")
    with running(start) as server, make_client() as client:
        run.blas = describe_blas([server])
        log("\n".join(run.blas))
        warm = [body(story_prompt(f"warmup{rep}", i), 8, eos_bias) for i in range(2)]
        run_concurrent(client, server.base_url, warm)
        for c in args.concurrency:
            bodies = [
                body(story_prompt(f"c{c}r{rep}", i), args.max_tokens, eos_bias) for i in range(c)
            ]
            level = run_concurrent(client, server.base_url, bodies)
            run.levels.setdefault(c, []).append(level)
            log(
                f"  {name}: concurrency {c}: {level.tokens} tokens in {level.wall:.2f}s = "
                f"{level.tok_s:.1f} tok/s (mean TTFT {level.ttft_mean:.2f}s)"
                + (f"  ERRORS: {level.errors[:3]}" if level.errors else "")
            )
        if gaps:
            run.gaps = gap_test(client, server, counter, args, eos_bias)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def print_gaps(runs: list[Run], long_len: int, chunk: int) -> None:
    gap_runs = [(r.name, r.gaps) for r in runs if r.gaps is not None]
    if not gap_runs:
        return
    g0 = gap_runs[0][1]
    print(
        f"\n== inter-token gaps of {g0.streams} streams while a ~{long_len}-token prompt is "
        f"admitted (prefill chunk / step {chunk} tokens)"
    )
    print(f"{'':44}" + "".join(f"{name:>16}" for name, _ in gap_runs))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:44}" + "".join(f"{v:>16}" for v in values))

    def ms(x: float) -> str:
        return f"{x * 1000:.0f} ms" if not math.isnan(x) else "n/a"

    row("long prompt tokens (usage)", [str(g.long_tokens) for _, g in gap_runs])
    row("long prompt cached tokens", [str(g.long_cached) for _, g in gap_runs])
    lengths = sorted(g0.alone_ttft)
    for n in lengths:
        row(f"TTFT alone, ~{n}-token prompt", [ms(g.alone_ttft.get(n, float("nan")))
                                               for _, g in gap_runs])  # fmt: skip
    row(
        "TTFT of the long prompt under load",
        [ms(g.long_ttft_loaded) for _, g in gap_runs],
    )

    def chunk_costs(g: Gaps) -> tuple[float, float, float]:
        first = g.alone_ttft.get(chunk, float("nan"))
        whole = g.alone_ttft.get(long_len, float("nan"))
        mean = whole / max(1, -(-long_len // chunk))
        last = whole - g.alone_ttft.get(long_len - chunk, float("nan"))
        return first, mean, last

    costs = [chunk_costs(g) for _, g in gap_runs]
    row(f"one chunk: {chunk} tokens at position 0", [ms(c[0]) for c in costs])
    row(f"one chunk: mean over the {long_len}-token prompt", [ms(c[1]) for c in costs])
    row("one chunk: last = TTFT(L) - TTFT(L - chunk)", [ms(c[2]) for c in costs])
    for label, series in (
        ("before", [g.before for _, g in gap_runs]),
        ("during prefill", [g.during for _, g in gap_runs]),
    ):
        row(f"gaps {label}: count", [str(len(v)) for v in series])
        for q in (50, 99):
            row(f"gaps {label}: p{q}", [ms(percentile(v, q)) for v in series])
        row(f"gaps {label}: max", [ms(max(v, default=float("nan"))) for v in series])
    row(
        "max gap during / slowest chunk alone",
        [
            ratio(max(g.during, default=0.0), max(c[0], c[1], c[2]))
            for (_, g), c in zip(gap_runs, costs, strict=True)
        ],
    )
    row(
        "streams still running when it got its token",
        [f"{g.alive_at_end}/{g.streams}" for _, g in gap_runs],
    )
    row("tokens per stream", [",".join(map(str, g.stream_tokens)) for _, g in gap_runs])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: concurrency 1,4, 16 output tokens, a 1024-token long prompt",
    )
    parser.add_argument("--concurrency", default=None, help="comma list (default 1,4,8,16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default 64)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="compat-serve --prefill-chunk and mlx_lm.server --prefill-step-size (default 512)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="compat-serve --max-num-seqs and mlx_lm.server --decode-concurrency (default 16)",
    )
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help="tokens of the prompt admitted during the gap test (default 2048)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="alternating runs per level (default 3)"
    )
    parser.add_argument("--streams", type=int, default=4, help="streams in the gap test")
    parser.add_argument(
        "--gap-stream-tokens",
        type=int,
        default=2048,
        help="max_tokens of the gap test's streams; they are closed once the long prompt "
        "has its first token",
    )
    parser.add_argument("--eos", choices=("suppress", "natural"), default="suppress")
    parser.add_argument("--skip-gaps", action="store_true")
    parser.add_argument("--only", choices=("compat-serve", "mlx_lm.server"))
    args = parser.parse_args()
    levels = args.concurrency or ("1,4" if args.quick else "1,4,8,16")
    args.concurrency = [int(x) for x in levels.split(",")]
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.long_prompt = args.long_prompt or (1024 if args.quick else 2048)
    args.repeats = args.repeats or (1 if args.quick else 3)

    model_dir = converted_model_dir()
    counter = TokenCounter(model_dir)
    eos_bias = {str(i): -1e9 for i in eos_token_ids(model_dir)} if args.eos == "suppress" else None
    chunk, seqs = args.prefill_chunk, args.max_num_seqs
    ours_args = ["--prefill-chunk", str(chunk), "--max-num-seqs", str(seqs)]
    theirs_args = ["--prefill-step-size", str(chunk), "--decode-concurrency", str(seqs)]
    servers: list[tuple[str, Callable[[Path], Server]]] = [
        ("compat-serve", lambda d: start_compat_serve(model_dir, ours_args, d)),
        ("mlx_lm.server", lambda d: start_mlx_lm_server(model_dir, theirs_args, d)),
    ]
    runs = [Run(name) for name, _ in servers if args.only in (None, name)]
    starts = dict(servers)
    load_before = os.getloadavg()[0]
    for rep in range(args.repeats):
        # Alternate the servers per repeat so drift on a shared machine hits both alike.
        for run in runs:
            log(f"-- repeat {rep + 1}/{args.repeats}")
            last = rep == args.repeats - 1
            gaps = last and not args.skip_gaps
            bench_server(run, starts[run.name], counter, args, eos_bias, rep=rep, gaps=gaps)

    print("\n".join(environment_lines(model_dir)) + f" (at start: {load_before:.2f})")
    print(f"compat-serve args:  {' '.join(ours_args)} (--max-num-batched-tokens default "
          f"{chunk + seqs})")  # fmt: skip
    print(f"mlx_lm.server args: {' '.join(theirs_args)} (--prompt-concurrency default 8)")
    print("BLAS mapped into each server process:")
    for r in runs:
        print("\n".join(r.blas))
    eos = "suppressed (ignore_eos / logit_bias)" if eos_bias else "natural"
    print(
        f"\n== total generated tokens/s (OpenAI chat, streaming, temperature 0, max_tokens "
        f"{args.max_tokens}, EOS {eos}; median of {args.repeats} alternating runs; "
        "ratio = compat / mlx_lm)"
    )
    names = [r.name for r in runs]
    header = f"{'concurrency':>11}" + "".join(f"{n + ' tok/s':>20}" for n in names)
    if len(runs) == 2:
        header += f"{'ratio':>8}"
    header += "".join(f"{n + ' tokens':>22}{'runs tok/s':>22}" for n in names)
    print(header)
    for c in args.concurrency:
        line = f"{c:>11}" + "".join(f"{r.tok_s(c):>20.1f}" for r in runs)
        if len(runs) == 2:
            line += f"{ratio(runs[0].tok_s(c), runs[1].tok_s(c)):>8}"
        for r in runs:
            tokens = "/".join(str(level.tokens) for level in r.levels[c])
            rates = ", ".join(f"{level.tok_s:.1f}" for level in r.levels[c])
            line += f"{tokens:>22}{rates:>22}"
        errors = [e for r in runs for e in r.errors(c)]
        print(line + (f"  ERRORS: {errors[:2]}" if errors else ""))
    print_gaps(runs, args.long_prompt, chunk)


if __name__ == "__main__":
    main()
