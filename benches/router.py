"""Two instances behind SMG (Shepherd Model Gateway): cache-aware vs round-robin routing.

Starts compat-serve on 127.0.0.2 and 127.0.0.3 and, for each policy, `smg launch` in
front of them; replays two interleaved multi-turn sessions through SMG, one over
`/v1/chat/completions`, one over `/v1/messages` (the Anthropic one under a client-facing
alias, as Claude Code would send it), and prints each turn's share of the prompt read from
cache, both policies side by side. Then it kills one instance mid-session and checks the
next turns still answer 200.

Acceptance (exit status 1 otherwise): under cache_aware every turn from the second on reads
at least 80% of its prompt from cache, and the turns after the kill answer 200.

    .venv/bin/python benches/router.py [--turns 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HOSTS = ("127.0.0.2", "127.0.0.3")
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "claude-sonnet-4-5"
# Sessions do not alternate strictly (an agent makes several calls in a row): with a
# strict A, B, A, B order round-robin would keep each session on one instance by luck.
ORDER = "ABBAABBAAB"
VENV_BIN = Path(sys.executable).parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start(name: str, argv: list[str], logdir: Path) -> Proc:
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    return Proc(name, popen, log)


def start_instance(host: str, logdir: Path) -> tuple[Proc, str]:
    port = free_port(host)
    proc = start(
        f"compat-serve-{host}",
        [
            str(VENV_BIN / "compat-serve"),
            "--host",
            host,
            "--port",
            str(port),
            "--max-output-tokens",
            "24",
            "--default-temperature",
            "0",
            "--kv-memory",
            "1GiB",
            "--cache-memory",
            "512MiB",
            "--max-num-seqs",
            "4",
        ],
        logdir,
    )
    url = f"http://{host}:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120, url)
    return proc, url


def start_smg(policy: str, workers: list[str], logdir: Path) -> tuple[Proc, str]:
    port = free_port()
    proc = start(
        f"smg-{policy}",
        [
            str(VENV_BIN / "smg"),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            "--model-alias",
            f"{ALIAS}={MODEL}",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--log-level",
            "info",
        ],
        logdir,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        models = httpx.get(f"{url}/v1/models", timeout=2)
        return models.status_code == 200 and MODEL in models.text

    wait_until(ready, 60, f"smg {policy}")
    time.sleep(1.0)  # let every worker register, not just the first
    return proc, url


@dataclass
class Session:
    """One agent conversation: a long distinct system prompt, then short user turns."""

    label: str
    api: str  # "openai" or "anthropic"
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def turn(self, base: str, n: int) -> None:
        self.messages.append(
            {"role": "user", "content": f"Step {n}: list two more facts about item {n}."}
        )
        if self.api == "openai":
            response = httpx.post(
                f"{base}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 24,
                    "messages": [{"role": "system", "content": self.system}, *self.messages],
                },
                timeout=300,
            )
            self.statuses.append(response.status_code)
            if response.status_code != 200:
                self.messages.pop()
                return
            body = response.json()
            usage = body["usage"]
            read = usage["prompt_tokens_details"]["cached_tokens"]
            total = usage["prompt_tokens"]
            reply = body["choices"][0]["message"]["content"] or ""
        else:
            response = httpx.post(
                f"{base}/v1/messages",
                headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"},
                json={
                    "model": ALIAS,
                    "max_tokens": 24,
                    "system": self.system,
                    "messages": self.messages,
                },
                timeout=300,
            )
            self.statuses.append(response.status_code)
            if response.status_code != 200:
                self.messages.pop()
                return
            body = response.json()
            usage = body["usage"]
            read = usage.get("cache_read_input_tokens") or 0
            total = usage["input_tokens"] + read + (usage.get("cache_creation_input_tokens") or 0)
            reply = "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
        self.shares.append(read / total if total else 0.0)
        self.messages.append({"role": "assistant", "content": reply or "ok"})


def system_prompt(tag: str, topic: str) -> str:
    facts = " ".join(f"Fact {i} about {topic}: detail {tag}-{i}." for i in range(60))
    return f"[{tag}] You are a careful assistant for {topic}. {facts}"


def replay(base: str, policy: str, turns: int) -> dict[str, Session]:
    sessions = {
        "A": Session("A (chat.completions)", "openai", system_prompt(policy, "gardening")),
        "B": Session("B (messages)", "anthropic", system_prompt(policy, "astronomy")),
    }
    counts = {"A": 0, "B": 0}
    for key in (ORDER * turns)[: 2 * turns]:
        counts[key] += 1
        sessions[key].turn(base, counts[key])
    return sessions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    args = parser.parse_args()
    if shutil.which("smg", path=str(VENV_BIN)) is None:
        print("smg is not installed: .venv/bin/pip install smg==1.13.0 (the dev extra)")
        return 2
    logdir = Path(tempfile.mkdtemp(prefix="router-bench-"))
    procs: list[Proc] = []
    ok = True
    try:
        started = time.monotonic()
        workers = []
        for host in HOSTS:
            proc, url = start_instance(host, logdir)
            procs.append(proc)
            workers.append(url)
        print(f"instances {', '.join(workers)} up in {time.monotonic() - started:.1f}s")
        results: dict[str, dict[str, Session]] = {}
        for policy in ("round_robin", "cache_aware"):
            smg, base = start_smg(policy, workers, logdir)
            began = time.monotonic()
            results[policy] = replay(base, policy, args.turns)
            print(f"{policy}: {2 * args.turns} turns in {time.monotonic() - began:.1f}s")
            if policy == "cache_aware":
                ok &= kill_one_and_continue(base, procs, results[policy])
                text = procs[0].log.read_text()
                print(
                    f"SMG probed /version {text.count('GET /version')}x and polled the "
                    f"vllm: gauges at /metrics {text.count('GET /metrics')}x (vLLM-like worker)"
                )
            smg.stop()
        ok &= report(results, args.turns)
    finally:
        for proc in procs:
            proc.stop()
        print(f"logs in {logdir}")
    return 0 if ok else 1


def kill_one_and_continue(base: str, procs: list[Proc], sessions: dict[str, Session]) -> bool:
    victim = procs[1]
    victim.popen.kill()
    victim.popen.wait(10)
    print(f"killed {victim.name}")
    after = {}
    for key, session in sessions.items():
        session.turn(base, len(session.shares) + 1)
        after[key] = session.statuses[-1]
    print("after the kill, next turn:", ", ".join(f"{k} -> {v}" for k, v in after.items()))
    return all(v == 200 for v in after.values())


def report(results: dict[str, dict[str, Session]], turns: int) -> bool:
    print("\nshare of each turn's prompt read from cache (round_robin | cache_aware)")
    ok = True
    for key in ("A", "B"):
        rr, ca = results["round_robin"][key], results["cache_aware"][key]
        print(f"session {ca.label}")
        for t in range(turns):
            left = f"{rr.shares[t]:6.1%}" if t < len(rr.shares) else "  -   "
            right = f"{ca.shares[t]:6.1%}" if t < len(ca.shares) else "  -   "
            print(f"  turn {t + 1}: {left} | {right}")
            if t >= 1 and (t >= len(ca.shares) or ca.shares[t] < 0.8):
                ok = False
        if len(ca.shares) > turns:
            print(f"  after kill: {ca.shares[turns]:6.1%} (cold instance expected)")
    for policy, sessions in results.items():
        later = [s for session in sessions.values() for s in session.shares[1:turns]]
        print(f"{policy}: mean share from turn 2 = {sum(later) / len(later):.1%}")
    print("PASS" if ok else "FAIL: a cache_aware turn from turn 2 read < 80% from cache")
    return ok


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
