"""Shared helpers for the HTTP benches: the converted weights, both servers, a streaming client.

The comparison benches (`throughput.py`, `agent_session.py`) run compat-serve and
`mlx_lm.server` one after the other in the same run, on the same weights (the dense float32
directory `compat-serve convert-gguf --dtype float32` writes from the embedded GGUF), with the
same optimized BLAS loaded into both processes (verified from /proc/PID/maps).

This module never imports mlx: the bench process only speaks HTTP and counts tokens with
`tokenizers`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".bench-cache"
BIN = Path(sys.executable).parent

# mlx_lm.server gets the same BLAS as compat-serve: loaded with global symbols by the very
# function our CLI calls, before anything imports mlx.core. argv after `-c CODE` is the
# server's own command line.
MLX_LM_LAUNCHER = """\
import sys
from compat_serve.models.blas import ensure_fast_blas
status = ensure_fast_blas()
print("[bench launcher] " + status.describe(), file=sys.stderr, flush=True)
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
from mlx_lm.server import main
main()
"""


def log(message: str) -> None:
    """Progress goes to stderr; results go to stdout."""
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------------------------------------
# Weights


def converted_model_dir() -> Path:
    """The embedded GGUF as a dense float32 MLX directory (cached; shared with engine_speed)."""
    out = CACHE / "smollm2-float32"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from compat_serve.models.embedded import embedded_model_path

    src = embedded_model_path()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-float32.", dir=CACHE))
    shutil.rmtree(tmp)
    log(f"converting {src.name} to {out} (float32) ...")
    cmd = [str(BIN / "compat-serve"), "convert-gguf", str(src), str(tmp), "--dtype", "float32"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if (out / "config.json").exists():  # someone else converted meanwhile
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def model_dtype(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    quantized = "quantization" in config
    return f"{config.get('torch_dtype', '?')}{' (quantized)' if quantized else ''}"


def eos_token_ids(model_dir: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return sorted(ids)


class TokenCounter:
    """The model's own tokenizer (tokenizers, no mlx) to size prompts."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def truncate(self, text: str, n_tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return str(self._tok.decode(ids[:n_tokens]))


# ---------------------------------------------------------------------------------------------
# Realistic filler: what a coding agent's tool results look like.

_DIRS = ["src", "src/engine", "src/server", "tests", "tests/unit", "docs", "scripts", "lib"]
_STEMS = [
    "scheduler", "block_pool", "prefix_cache", "tokenizer", "adapter", "routes", "protocol",
    "config", "runner", "sampler", "metrics", "errors", "loader", "encoder", "stream", "cli",
    "hashing", "request", "session", "worker", "queue", "parser", "template", "utils",
]  # fmt: skip
_EXTS = [".py", ".rs", ".toml", ".md", ".json", ".yaml"]
_IDENTS = [
    "request_id", "prompt_tokens", "max_tokens", "block_size", "cache", "scheduler", "budget",
    "running", "waiting", "finished", "result", "payload", "handler", "response", "stream",
    "offset", "length", "tokens", "hashes", "parent", "refcount", "evict", "lookup", "insert",
]  # fmt: skip
_VERBS = ["fix", "add", "refactor", "remove", "rename", "test", "document", "speed up", "clean up"]
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]


def _path(rng: random.Random) -> str:
    return f"{rng.choice(_DIRS)}/{rng.choice(_STEMS)}{rng.choice(_EXTS)}"


def _ls_block(rng: random.Random) -> str:
    lines = [f"$ ls -la {rng.choice(_DIRS)}", f"total {rng.randint(40, 400)}"]
    for _ in range(rng.randint(6, 12)):
        lines.append(
            f"-rw-r--r-- 1 dev dev {rng.randint(120, 48000):>6} {rng.choice(_MONTHS)} "
            f"{rng.randint(1, 28):>2} {rng.randint(0, 23):02}:{rng.randint(0, 59):02} "
            f"{rng.choice(_STEMS)}_{rng.randint(0, 99)}{rng.choice(_EXTS)}"
        )
    return "\n".join(lines)


def _grep_block(rng: random.Random) -> str:
    ident = rng.choice(_IDENTS)
    lines = [f"$ grep -rn {ident} src tests"]
    for _ in range(rng.randint(5, 10)):
        other = rng.choice(_IDENTS)
        lines.append(
            f"{_path(rng)}:{rng.randint(1, 900)}:    {ident} = self.{other}"
            f"({rng.choice(_IDENTS)}, {rng.randint(0, 64)})"
        )
    return "\n".join(lines)


def _pytest_block(rng: random.Random) -> str:
    lines = [f"$ pytest -q {rng.choice(_DIRS)}"]
    for _ in range(rng.randint(3, 6)):
        mark = rng.choice(["PASSED", "PASSED", "PASSED", "FAILED"])
        lines.append(f"tests/test_{rng.choice(_STEMS)}.py::test_{rng.choice(_IDENTS)} {mark}")
    ident = rng.choice(_IDENTS)
    lines += [
        f"E   AssertionError: expected {ident} == {rng.randint(0, 512)}, got {rng.randint(0, 512)}",
        f"{_path(rng)}:{rng.randint(10, 600)}: AssertionError",
        f"{rng.randint(1, 3)} failed, {rng.randint(20, 300)} passed in {rng.uniform(0.5, 40):.2f}s",
    ]
    return "\n".join(lines)


def _git_block(rng: random.Random) -> str:
    lines = ["$ git log --oneline -8"]
    for _ in range(8):
        lines.append(
            f"{rng.getrandbits(28):07x} {rng.choice(_VERBS).capitalize()} "
            f"{rng.choice(_IDENTS)} handling in {rng.choice(_STEMS)}"
        )
    return "\n".join(lines)


def _code_block(rng: random.Random) -> str:
    name = rng.choice(_STEMS)
    lines = [f"$ sed -n {rng.randint(1, 300)},+14p {_path(rng)}", f"def {name}_step(self, plan):"]
    for _ in range(rng.randint(6, 12)):
        a, b, c = rng.choice(_IDENTS), rng.choice(_IDENTS), rng.choice(_IDENTS)
        lines.append(
            rng.choice(
                [
                    f"    {a} = plan.{b}.get({c!r}, {rng.randint(0, 16)})",
                    f"    if {a} > self.{b}:",
                    f"        self.{a}.append({b})",
                    f"    for {a} in self.{b}[{rng.randint(0, 8)}:]:",
                    f"        return self.{c}({a}, {b})",
                    f"    # {rng.choice(_VERBS)} {a} before {b}",
                ]
            )
        )
    return "\n".join(lines)


_BLOCKS: list[Callable[[random.Random], str]] = [
    _ls_block,
    _grep_block,
    _pytest_block,
    _git_block,
    _code_block,
]


def tool_output(counter: TokenCounter, n_tokens: int, seed: int) -> str:
    """Deterministic realistic command output of about `n_tokens` tokens."""
    rng = random.Random(seed)
    blocks: list[str] = []
    text = ""
    while counter.count(text) < n_tokens:
        blocks.append(rng.choice(_BLOCKS)(rng))
        text = "\n\n".join(blocks)
    return counter.truncate(text, n_tokens)


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    command: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def blas_libraries(self) -> list[str]:
        """Shared objects with 'blas' in their path mapped into the server process."""
        try:
            maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        except OSError:
            return []
        return sorted({line.split()[-1] for line in maps.splitlines() if "blas" in line.lower()})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _wait_ready(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}"
            )
        try:
            response = httpx.get(server.base_url + path, timeout=2, trust_env=False)
            if response.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s:\n{server.log_tail()}")


def _spawn(name: str, cmd: list[str], log_dir: Path, port: int) -> Server:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    return Server(name, proc, port, log_path, cmd)


def start_compat_serve(model_dir: Path, args: list[str], log_dir: Path) -> Server:
    port = free_port()
    cmd = [str(BIN / "compat-serve"), "--model", str(model_dir), "--port", str(port),
           "--log-level", "warning", *args]  # fmt: skip
    server = _spawn("compat-serve", cmd, log_dir, port)
    try:
        _wait_ready(server, "/health", 300)
    except BaseException:
        server.stop()
        raise
    return server


def start_mlx_lm_server(model_dir: Path, args: list[str], log_dir: Path) -> Server:
    """mlx_lm.server with our fast BLAS; ready on /health (its /v1/models raises without a
    Hugging Face cache directory). Requests must name `default_model` (any other name is
    looked up on the hub)."""
    port = free_port()
    cmd = [sys.executable, "-c", MLX_LM_LAUNCHER, "--model", str(model_dir), "--port",
           str(port), "--log-level", "WARNING", *args]  # fmt: skip
    server = _spawn("mlx_lm.server", cmd, log_dir, port)
    try:
        _wait_ready(server, "/health", 300)
    except BaseException:
        server.stop()
        raise
    return server


@contextmanager
def running(start: Callable[[Path], Server]) -> Iterator[Server]:
    """Start a server with its log in a temp dir; always stop it."""
    with tempfile.TemporaryDirectory(prefix="compat-bench-") as tmp:
        server = start(Path(tmp))
        try:
            yield server
        except BaseException:
            tail = server.log_tail()
            if tail:
                log(f"--- last lines of the {server.name} log ---\n{tail}")
            raise
        finally:
            server.stop()


def describe_blas(servers: list[Server]) -> list[str]:
    """Lines saying which BLAS each server process has mapped, and whether they match."""
    lines = []
    found = []
    for server in servers:
        libs = server.blas_libraries()
        fast = [lib for lib in libs if "openblas" in lib or "mkl" in lib or "blis" in lib]
        found.append(tuple(fast))
        lines.append(f"  {server.name} (pid {server.proc.pid}): {', '.join(libs) or 'none'}")
    if not found or not found[0] or len(set(found)) != 1:
        lines.append("  !!! WARNING: the servers do not have the same optimized BLAS mapped")
    return lines


# ---------------------------------------------------------------------------------------------
# Client


def make_client() -> httpx.Client:
    return httpx.Client(
        timeout=httpx.Timeout(1800, connect=30),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        trust_env=False,
    )


@dataclass
class StreamResult:
    status: int
    started: float
    done: float = 0.0
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str = ""

    @property
    def ttft(self) -> float:
        return (self.first_token or self.done) - self.started

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        """From usage; the number of content chunks when the server sent no usage."""
        value = self.usage.get("completion_tokens")
        return int(value) if value is not None else len(self.chunk_times)

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)


def stream_chat(
    client: httpx.Client,
    base_url: str,
    body: dict[str, Any],
    *,
    on_chunk: Callable[[StreamResult], None] | None = None,
    stop: threading.Event | None = None,
) -> StreamResult:
    """POST a streaming chat completion; time every chunk that carries generated output.

    `stop` set: close the connection after the next chunk (the server aborts the request).
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult(status=0, started=time.perf_counter())
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = response.read().decode(errors="replace")[:500]
            result.done = time.perf_counter()
            return result
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue  # blank lines, `: keepalive` comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or ""
                produced = bool(
                    piece
                    or delta.get("reasoning_content")
                    or delta.get("reasoning")
                    or delta.get("tool_calls")
                )
                if produced:
                    result.text += piece
                    result.chunk_times.append(now)
                    if result.first_token is None:
                        result.first_token = now
                    if on_chunk is not None:
                        on_chunk(result)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                    if result.first_token is None:  # stopped before any visible output
                        result.first_token = now
            if stop is not None and stop.is_set():
                break
    result.done = time.perf_counter()
    return result


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def environment_lines(model_dir: Path) -> list[str]:
    import importlib.metadata as md

    versions = []
    for dist in ("compat-serve", "mlx", "mlx-lm"):
        try:
            versions.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            versions.append(f"{dist} ?")
    load = os.getloadavg()
    return [
        f"weights: {model_dir} (dtype {model_dtype(model_dir)}), loaded by both servers",
        f"versions: {', '.join(versions)}; {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    ]
