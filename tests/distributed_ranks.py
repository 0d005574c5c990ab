"""Start a group of local ranks over MLX's ring backend on 127.0.0.1, each a subprocess
(what `mlx.launch --backend ring` does on one host): free ports for the hostfile, and
MLX_RANK / MLX_HOSTFILE in each rank's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from conftest import free_port

SERVE = [sys.executable, "-m", "compat_serve.cli"]


def write_hostfile(directory: Path, ranks: int) -> Path:
    path = directory / f"hosts-{free_port()}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    return path


@dataclass
class Ranks:
    processes: list[subprocess.Popen[str]]

    def wait(self, timeout: float = 60) -> list[tuple[int, str]]:
        """Each rank's exit status and its output (stdout and stderr)."""
        out = []
        for process in self.processes:
            text, _ = process.communicate(timeout=timeout)
            out.append((process.returncode, text))
        return out

    def kill(self) -> None:
        """Kill what still runs; close every rank's output pipe."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            if process.stdout is not None and not process.stdout.closed:
                process.communicate(timeout=30)


def start_ranks(
    directory: Path,
    args_per_rank: list[list[str]],
    command: list[str] = SERVE,
    env: dict[str, str] | None = None,
) -> Ranks:
    """One subprocess per entry of `args_per_rank`, rank = its index, joined in a ring."""
    hostfile = write_hostfile(directory, len(args_per_rank))
    processes = []
    for rank, args in enumerate(args_per_rank):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MLX_RANK": str(rank),
            "MLX_HOSTFILE": str(hostfile),
        }
        processes.append(
            subprocess.Popen(
                [*command, *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return Ranks(processes)


@dataclass
class DistributedServer:
    base_url: str
    ranks: Ranks

    def stop(self) -> list[tuple[int, str]]:
        """SIGTERM to rank 0 (it drains, then stops the others); every rank's exit."""
        self.ranks.processes[0].terminate()
        try:
            return self.ranks.wait(60)
        finally:
            self.ranks.kill()


def start_server(
    directory: Path, ranks: int, args: list[str], env: dict[str, str] | None = None
) -> DistributedServer:
    """A compat-serve group: rank 0 serves HTTP on a free port once its /health is up."""
    port = free_port()
    group = start_ranks(directory, [[*args, "--port", str(port)] for _ in range(ranks)], env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in group.processes):
            outputs = group.wait(30)
            raise RuntimeError(f"a rank exited during start: {outputs}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return DistributedServer(base_url, group)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    group.kill()
    raise RuntimeError("the distributed server did not start")
