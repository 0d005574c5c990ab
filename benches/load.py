"""Load: many concurrent clients mixing both APIs, streams and aborts, for a fixed duration.

Starts compat-serve as a subprocess on 127.0.0.1 (the embedded default model unless
`--model`), or targets `--url`, and runs `--clients` (default 64) concurrent clients for
`--duration` seconds (default 180). Each client loops: it picks the OpenAI chat completions
or the Anthropic messages API, streamed or not, a short `max_tokens` (16-48, so a 2-core
CPU keeps up), and sometimes hangs up mid-request (a stream after a few content deltas, a
non-streamed request after a short wait): the server must abort those and keep serving.

Every accepted request must end with a terminal event: `message_stop` (Anthropic SSE),
a finish_reason then `data: [DONE]` (OpenAI SSE), or a complete JSON body with a stop or
finish reason. Each request has a deadline (`--request-timeout`); one that misses it is
counted as hung. 429 (OpenAI) / 529 (Anthropic) backpressure is allowed and counted apart.

Printed: requests sent / completed / aborted by the client / backpressured / failed by
kind, 5xx count, p50/p99 TTFT of streamed requests, p50/p99 latency, total generated
tokens/s (client usage and the server's own counter), the server's finished-request
outcomes, whether the server is idle afterwards (no leaked running or queued requests, no
reserved KV) and the server RSS before/after. Numbers only; no timing assertions.

Exit status 1 when any request was lost (connection ended without a terminal event), hung,
answered 5xx (other than 529 backpressure) or another unexpected status, carried an error
event, when the server did not return to idle, or when the server process died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from _servers import BIN, ROOT, Server, free_port, log, percentile

# Outcome kinds. The first three are fine; everything in FAILURES fails the run.
COMPLETED = "completed"  # terminal event / complete JSON body
ABORTED = "aborted"  # the client hung up on purpose before the end
BACKPRESSURE = "backpressure"  # 429 / 529 with the API's error body
HTTP_5XX = "http_5xx"  # any other 5xx
HTTP_OTHER = "http_other"  # an unexpected non-2xx below 500 (our requests are valid)
STREAM_ERROR = "stream_error"  # an `error` event / error chunk inside a 200 stream
BAD_BODY = "bad_body"  # 200 JSON without a stop/finish reason, or an abort/error finish
LOST = "lost"  # connection ended (or reset) before a terminal event
HUNG = "hung"  # no terminal event within --request-timeout
FAILURES = (HTTP_5XX, HTTP_OTHER, STREAM_ERROR, BAD_BODY, LOST, HUNG)

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "bench"}
OPENAI_HEADERS = {"authorization": "Bearer bench"}

SYSTEM_PROMPT = (
    "You are a concise assistant answering questions from a load test. Answer in one or "
    "two short sentences, plainly, without lists or code."
)
TOPICS = [
    "why the sky is blue",
    "how a bicycle stays upright",
    "what a hash table is",
    "how bread rises",
    "why cats purr",
    "how tides work",
    "what a compiler does",
    "how bees make honey",
    "why leaves change colour",
    "how a lighthouse works",
    "what recursion means",
    "how rain forms",
]


# ---------------------------------------------------------------------------------------------
# One request, either API, streamed or not


@dataclass
class Spec:
    api: str  # "openai" | "anthropic"
    stream: bool
    system: str
    messages: list[dict[str, str]]  # user/assistant turns, plain string content
    max_tokens: int
    temperature: float
    abort_after_deltas: int | None = None  # streams: hang up after this many content deltas
    abort_after_s: float | None = None  # non-streamed: hang up after this many seconds
    model: str = "bench"  # the request's model name (--model-names)


@dataclass
class Outcome:
    api: str
    stream: bool
    kind: str
    status: int = 0
    started: float = 0.0
    ended: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.ended - self.started


def request_body(spec: Spec) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(path, headers, JSON body) of a spec."""
    if spec.api == "openai":
        messages = [{"role": "system", "content": spec.system}, *spec.messages]
        body: dict[str, Any] = {
            "model": spec.model,
            "messages": messages,
            "max_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "stream": spec.stream,
        }
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", OPENAI_HEADERS, body
    body = {
        "model": spec.model,
        "system": spec.system,
        "messages": spec.messages,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": spec.stream,
    }
    return "/v1/messages", ANTHROPIC_HEADERS, body


def _status_kind(status: int) -> str:
    if status in (429, 529):
        return BACKPRESSURE
    if status >= 500:
        return HTTP_5XX
    return HTTP_OTHER


def _anthropic_usage(out: Outcome, usage: dict[str, Any]) -> None:
    if "output_tokens" in usage:
        out.output_tokens = int(usage["output_tokens"] or 0)
    if "input_tokens" in usage:
        read = int(usage.get("cache_read_input_tokens") or 0)
        created = int(usage.get("cache_creation_input_tokens") or 0)
        out.prompt_tokens = int(usage["input_tokens"] or 0) + read + created
        out.cached_tokens = read


def _openai_usage(out: Outcome, usage: dict[str, Any]) -> None:
    out.output_tokens = int(usage.get("completion_tokens") or 0)
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    out.cached_tokens = int(details.get("cached_tokens") or 0)


async def _stream_anthropic(response: httpx.Response, spec: Spec, out: Outcome) -> None:
    deltas = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # `event:` lines (the data repeats the type), blank lines, comments
        payload = json.loads(line[5:])
        kind = payload.get("type")
        if kind == "message_start":
            _anthropic_usage(out, (payload.get("message") or {}).get("usage") or {})
        elif kind == "content_block_delta":
            delta = payload.get("delta") or {}
            out.text += delta.get("text") or ""
            if out.ttft is None:
                out.ttft = time.perf_counter() - out.started
            deltas += 1
            if spec.abort_after_deltas is not None and deltas >= spec.abort_after_deltas:
                out.kind = ABORTED
                return  # leaving the `async with` closes the connection mid-stream
        elif kind == "message_delta":
            _anthropic_usage(out, payload.get("usage") or {})
        elif kind == "message_stop":
            out.kind = COMPLETED
            return
        elif kind == "error":
            error = payload.get("error") or {}
            overloaded = error.get("type") == "overloaded_error"
            out.kind = BACKPRESSURE if overloaded else STREAM_ERROR
            out.detail = json.dumps(error)[:300]
            return
    out.kind = LOST
    out.detail = f"stream ended without message_stop after {deltas} deltas"


async def _stream_openai(response: httpx.Response, spec: Spec, out: Outcome) -> None:
    deltas = 0
    finish: str | None = None
    error: dict[str, Any] | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if error is not None:
                overloaded = error.get("type") in ("overloaded_error", "rate_limit_exceeded")
                out.kind = BACKPRESSURE if overloaded else STREAM_ERROR
                out.detail = json.dumps(error)[:300]
            elif finish is None:
                out.kind = BAD_BODY
                out.detail = "[DONE] without a finish_reason"
            elif finish in ("abort", "error"):
                out.kind = BAD_BODY
                out.detail = f"finish_reason {finish}"
            else:
                out.kind = COMPLETED
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk}
            continue
        if chunk.get("usage"):
            _openai_usage(out, chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            if piece or delta.get("reasoning_content") or delta.get("tool_calls"):
                out.text += piece
                if out.ttft is None:
                    out.ttft = time.perf_counter() - out.started
                deltas += 1
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
        if spec.abort_after_deltas is not None and deltas >= spec.abort_after_deltas:
            out.kind = ABORTED
            return
    out.kind = LOST
    out.detail = f"stream ended without [DONE] after {deltas} deltas"


def _check_json(spec: Spec, out: Outcome, body: Any) -> None:
    if not isinstance(body, dict):
        out.kind, out.detail = BAD_BODY, f"not a JSON object: {str(body)[:200]}"
        return
    if spec.api == "anthropic":
        reason = body.get("stop_reason")
        _anthropic_usage(out, body.get("usage") or {})
        out.text = "".join(
            b.get("text") or "" for b in body.get("content") or [] if isinstance(b, dict)
        )
    else:
        choices = body.get("choices") or [{}]
        reason = choices[0].get("finish_reason")
        _openai_usage(out, body.get("usage") or {})
        out.text = (choices[0].get("message") or {}).get("content") or ""
    if reason in (None, "abort", "error"):
        out.kind, out.detail = BAD_BODY, f"stop/finish reason {reason!r}: {str(body)[:200]}"
    else:
        out.kind = COMPLETED


async def _run(client: httpx.AsyncClient, base: str, spec: Spec, out: Outcome) -> None:
    path, headers, body = request_body(spec)
    if not spec.stream:
        try:
            async with asyncio.timeout(spec.abort_after_s):
                response = await client.post(base + path, json=body, headers=headers)
        except TimeoutError:
            out.kind = ABORTED  # the cancelled request closes its connection
            return
        out.status = response.status_code
        if response.status_code != 200:
            out.kind, out.detail = _status_kind(response.status_code), response.text[:300]
            return
        try:
            parsed = response.json()
        except ValueError:
            out.kind, out.detail = BAD_BODY, f"invalid JSON: {response.text[:200]}"
            return
        _check_json(spec, out, parsed)
        return
    async with client.stream("POST", base + path, json=body, headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            out.kind, out.detail = _status_kind(response.status_code), text[:300]
            return
        if spec.api == "anthropic":
            await _stream_anthropic(response, spec, out)
        else:
            await _stream_openai(response, spec, out)


async def send(client: httpx.AsyncClient, base: str, spec: Spec, timeout: float) -> Outcome:
    """One request; never raises (except cancellation): every way it can end is an Outcome."""
    out = Outcome(spec.api, spec.stream, LOST, started=time.perf_counter())
    try:
        async with asyncio.timeout(timeout):
            await _run(client, base, spec, out)
    except TimeoutError:
        out.kind, out.detail = HUNG, f"no terminal event within {timeout:.0f}s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.kind, out.detail = LOST, f"{type(exc).__name__}: {exc}"[:300]
    out.ended = time.perf_counter()
    return out


def make_async_client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30),  # deadlines come from send()
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,
    )


# ---------------------------------------------------------------------------------------------
# The server: a subprocess (RSS from /proc, log scanned for tracebacks) or an existing URL


@contextmanager
def compat_server(model: str | None, extra: list[str]) -> Iterator[Server]:
    """compat-serve on a free loopback port, log in a temp dir; always stopped."""
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        port = free_port()
        model_args = ["--model", model] if model else []
        cmd = [str(BIN / "compat-serve"), "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *model_args, *extra]  # fmt: skip
        log_path = Path(tmp) / "compat-serve.log"
        log(f"starting: {shlex.join(cmd)}")
        with log_path.open("wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        server = Server("compat-serve", proc, port, log_path, cmd)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}:\n{server.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready after 300s:\n{server.log_tail()}")
                try:
                    if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield server
        finally:
            server.stop()
            problems = log_problems(log_path)
            if problems:
                log(f"--- {len(problems)} error/traceback lines in the server log:")
                log("\n".join(problems[:20]))


def log_problems(path: Path) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    pattern = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception")
    return [line for line in lines if pattern.search(line)]


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process, from /proc/PID/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (histogram buckets kept as they are)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


async def fetch_metrics(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    try:
        response = await client.get(base + "/metrics", headers=OPENAI_HEADERS, timeout=30)
        return parse_metrics(response.text) if response.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def wait_idle(client: httpx.AsyncClient, base: str, seconds: float) -> dict[str, Any]:
    """Poll /v1/status until nothing runs, waits or holds KV; the last status seen."""
    status: dict[str, Any] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            response = await client.get(base + "/v1/status", headers=OPENAI_HEADERS, timeout=30)
            status = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            status = {"error": str(exc)}
        if is_idle(status):
            break
        await asyncio.sleep(0.5)
    return status


def is_idle(status: dict[str, Any]) -> bool:
    keys = ("queue_depth", "running", "kv_tokens_reserved")
    models = status.get("models", [])  # several models: none has requests in flight
    if models and any(m.get("in_flight") for m in models):
        return False
    return all(status.get(k, 0) == 0 for k in keys) and not status.get("requests")


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def fmt_s(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}s"


# ---------------------------------------------------------------------------------------------
# The load


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    first_failures: list[str] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        self.outcomes.append(out)
        if out.kind in FAILURES and len(self.first_failures) < 10:
            self.first_failures.append(
                f"{out.kind} {out.api} stream={out.stream} status={out.status} "
                f"after {out.latency:.1f}s: {out.detail}"
            )


def make_spec(rng: random.Random, args: argparse.Namespace, cid: int, n: int) -> Spec:
    topic = rng.choice(TOPICS)
    messages = [{"role": "user", "content": f"Client {cid} question {n}: explain {topic}."}]
    if rng.random() < 0.3:  # a second turn now and then: longer prompt, a prefix to reuse
        messages += [
            {"role": "assistant", "content": f"Here is a short answer about {topic}."},
            {"role": "user", "content": "Now say it again in other words, more simply."},
        ]
    stream = rng.random() < args.stream_fraction
    spec = Spec(
        api=rng.choice(("openai", "anthropic")),
        stream=stream,
        system=SYSTEM_PROMPT,
        messages=messages,
        max_tokens=rng.randint(args.min_tokens, args.max_tokens),
        temperature=rng.choice((0.0, 0.7)),
        model=rng.choice(args.model_names.split(",")),
    )
    if rng.random() < args.abort_fraction:
        if stream:
            spec.abort_after_deltas = rng.randint(1, 6)
        else:
            spec.abort_after_s = rng.uniform(0.2, 4.0)
    return spec


async def client_loop(
    cid: int,
    client: httpx.AsyncClient,
    base: str,
    args: argparse.Namespace,
    deadline: float,
    stop: asyncio.Event,
    tally: Tally,
) -> None:
    rng = random.Random(args.seed * 1000 + cid)
    await asyncio.sleep(rng.uniform(0, 2))  # a ragged start, not one burst
    for n in range(args.max_requests_per_client):
        if time.monotonic() >= deadline or stop.is_set():
            return
        spec = make_spec(rng, args, cid, n)
        tally.in_flight += 1
        out = await send(client, base, spec, args.request_timeout)
        tally.in_flight -= 1
        tally.add(out)
        if out.kind == BACKPRESSURE:
            await asyncio.sleep(rng.uniform(0.5, 2.0))  # a bounded retry-after
        elif out.kind in FAILURES:
            await asyncio.sleep(0.5)  # never a hot loop against a broken server


async def watch(
    server: Server | None, tally: Tally, stop: asyncio.Event, deadline: float, every: float
) -> None:
    """Progress on stderr; stops the clients if the server process dies."""
    t0 = time.monotonic()
    while not stop.is_set():
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every)
        counts = Counter(o.kind for o in tally.outcomes)
        left = max(0.0, deadline - time.monotonic())
        log(
            f"  t={time.monotonic() - t0:5.0f}s ({left:.0f}s left): in flight {tally.in_flight}, "
            f"done {len(tally.outcomes)} {dict(counts)}"
        )
        if server is not None and server.proc.poll() is not None:
            log(f"!! server exited with {server.proc.returncode}")
            stop.set()


async def run_load(args: argparse.Namespace, base: str, server: Server | None) -> int:
    tally = Tally()
    stop = asyncio.Event()
    async with make_async_client(args.clients + 8) as client:
        before = await fetch_metrics(client, base)
        rss_before = rss_bytes(server.proc.pid) if server else None
        t0 = time.monotonic()
        deadline = t0 + args.duration
        watcher = asyncio.create_task(watch(server, tally, stop, deadline, args.progress_every))
        loops = [
            client_loop(cid, client, base, args, deadline, stop, tally)
            for cid in range(args.clients)
        ]
        await asyncio.gather(*loops)
        wall = time.monotonic() - t0
        stop.set()
        await watcher
        server_died = server is not None and server.proc.poll() is not None
        status = {} if server_died else await wait_idle(client, base, args.idle_wait)
        after = {} if server_died else await fetch_metrics(client, base)
        rss_after = rss_bytes(server.proc.pid) if server else None
    return report(args, tally, wall, before, after, status, rss_before, rss_after, server_died)


def report(
    args: argparse.Namespace,
    tally: Tally,
    wall: float,
    before: dict[str, float],
    after: dict[str, float],
    status: dict[str, Any],
    rss_before: int | None,
    rss_after: int | None,
    server_died: bool,
) -> int:
    outs = tally.outcomes
    counts = Counter(o.kind for o in outs)
    fails = sum(counts[k] for k in FAILURES)
    completed = [o for o in outs if o.kind == COMPLETED]
    ttfts = [o.ttft for o in completed if o.stream and o.ttft is not None]
    latencies = [o.latency for o in completed]
    tokens = sum(o.output_tokens for o in completed)
    aborted_streams = sum(1 for o in outs if o.kind == ABORTED and o.stream)
    print(
        f"== load: {args.clients} clients for {args.duration:.0f}s (wall {wall:.1f}s incl. "
        f"drain), max_tokens {args.min_tokens}-{args.max_tokens}, "
        f"{args.stream_fraction:.0%} streamed, {args.abort_fraction:.0%} planned aborts, "
        f"request timeout {args.request_timeout:.0f}s, {os.cpu_count()} CPUs"
    )
    print(f"requests sent                {len(outs)}")
    print(f"  completed                  {counts[COMPLETED]}")
    print(f"  aborted by the client      {counts[ABORTED]} ({aborted_streams} mid-stream)")
    print(f"  backpressure (429/529)     {counts[BACKPRESSURE]}")
    print(f"  5xx (not 529)              {counts[HTTP_5XX]}")
    print(f"  other unexpected status    {counts[HTTP_OTHER]}")
    print(f"  error event in a stream    {counts[STREAM_ERROR]}")
    print(f"  bad final body/finish      {counts[BAD_BODY]}")
    print(f"  lost (no terminal event)   {counts[LOST]}")
    print(f"  hung (> timeout)           {counts[HUNG]}")
    by_api = Counter((o.api, o.stream, o.kind) for o in outs)
    for api in ("openai", "anthropic"):
        for stream in (True, False):
            row = {k: v for (a, s, k), v in by_api.items() if a == api and s == stream}
            print(f"  {api:9} {'stream' if stream else 'json':6}   {dict(sorted(row.items()))}")
    print(
        f"TTFT (streamed, completed)   p50 {fmt_s(percentile(ttfts, 50))}  "
        f"p99 {fmt_s(percentile(ttfts, 99))}  max {fmt_s(max(ttfts, default=float('nan')))} "
        f"(n={len(ttfts)})"
    )
    print(
        f"latency (completed)          p50 {fmt_s(percentile(latencies, 50))}  "
        f"p99 {fmt_s(percentile(latencies, 99))}  max "
        f"{fmt_s(max(latencies, default=float('nan')))}"
    )
    gen = after.get("compat_generation_tokens_total", 0) - before.get(
        "compat_generation_tokens_total", 0
    )
    print(f"tokens (completed, usage)    {tokens} = {tokens / wall:.1f} tok/s")
    if after:
        print(f"tokens (server counter)      {gen:.0f} = {gen / wall:.1f} tok/s")
        finished = {
            key.split('"')[1]: after[key] - before.get(key, 0)
            for key in after
            if key.startswith("compat_requests_total{")
        }
        print(f"server finished by outcome   { ({k: int(v) for k, v in finished.items() if v}) }")
        pre = after.get("compat_preemptions_total", 0) - before.get("compat_preemptions_total", 0)
        print(f"server preemptions           {pre:.0f}")
    idle = is_idle(status)
    shown = {k: status.get(k) for k in ("queue_depth", "running", "kv_tokens_reserved")}
    print(f"server idle afterwards       {'yes' if idle else 'NO'} {shown}")
    if not idle and status.get("requests"):
        print(f"  leftover requests: {json.dumps(status.get('requests'))[:600]}")
    print(
        f"server RSS MiB before/after  {mib(rss_before)} / {mib(rss_after)} (prefix cache "
        f"{mib(after.get('compat_prefix_cache_bytes'))} MiB, live KV "
        f"{mib(after.get('compat_kv_cache_bytes'))} MiB after)"
    )
    if server_died:
        print("!! the server process died during the run")
    for line in tally.first_failures:
        print(f"  FAIL {line}")
    bad = fails > 0 or server_died or (not idle and not args.url)
    print(f"verdict: {'FAIL' if bad else 'ok'} ({fails} failed requests)")
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds (default 180)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (64)")
    parser.add_argument("--min-tokens", type=int, default=16, help="max_tokens low (16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens high (48)")
    parser.add_argument(
        "--stream-fraction", type=float, default=0.6, help="share of streamed requests (0.6)"
    )
    parser.add_argument(
        "--abort-fraction",
        type=float,
        default=0.15,
        help="share of requests the client hangs up on before the end (0.15)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds for a request to reach its terminal event, else hung (300)",
    )
    parser.add_argument(
        "--max-requests-per-client", type=int, default=10_000, help="hard bound per client"
    )
    parser.add_argument(
        "--idle-wait", type=float, default=30.0, help="seconds to wait for an idle server after"
    )
    parser.add_argument("--progress-every", type=float, default=15.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="compat-serve --model (default embedded)")
    parser.add_argument(
        "--model-names",
        default="bench",
        help="comma-separated model names requests pick from at random (a server with "
        "several models, e.g. --server-arg=--models-dir=DIR --model-names a,b)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra compat-serve argument, repeatable (e.g. --server-arg=--max-queue=32)",
    )
    parser.add_argument(
        "--url", default=None, help="target a running server (http://127.0.0.1:PORT) instead"
    )
    args = parser.parse_args()
    if args.url:
        host = httpx.URL(args.url).host
        if host not in ("127.0.0.1", "localhost", "::1"):
            parser.error("--url must be a loopback address")
        sys.exit(asyncio.run(run_load(args, args.url.rstrip("/"), None)))
    with compat_server(args.model, args.server_arg) as server:
        code = asyncio.run(run_load(args, server.base_url, server))
    sys.exit(code)


if __name__ == "__main__":
    main()
