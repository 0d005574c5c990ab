"""The server process a launch starts: a free port, its log, waiting until it answers, stop.

The server runs in its own session (so the terminal's Ctrl-C goes to the client, not to
it), writes its log to a file (the client owns the terminal), and reads its stdin from a
pipe the launcher holds (`child.py`: EOF stops it).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from compat_serve.launch.client_process import exit_code

LOG_TAIL_LINES = 20
STOP_TIMEOUT_S = 30.0


class ServerFailed(Exception):
    """The server exited or never answered; the message carries its last log lines."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to `bind_host`."""
    if bind_host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    def __init__(self, process: subprocess.Popen[bytes], log_path: Path, base_url: str) -> None:
        self.process = process
        self.log_path = log_path
        self.base_url = base_url

    @classmethod
    def start(cls, serve_args: list[str], base_url: str, log_path: Path) -> ServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 (the child keeps it)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "compat_serve.launch.child", *serve_args],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        return cls(process, log_path, base_url)

    def wait_ready(self, api_key: str | None, timeout_s: float) -> None:
        """Returns once `/health` answers 200; raises ServerFailed if the server exits first."""
        deadline = time.monotonic() + timeout_s
        request = urllib.request.Request(self.base_url + "/health")
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        while True:
            if self.process.poll() is not None:
                returncode = exit_code(self.process.returncode)
                raise ServerFailed(
                    f"the server exited with code {returncode} before it was ready; "
                    f"its last log lines:\n{log_tail(self.log_path)}",
                    returncode,
                )
            try:
                with urllib.request.urlopen(request, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerFailed(
                    f"the server did not answer {self.base_url}/health within {timeout_s:.0f}s; "
                    f"its last log lines:\n{log_tail(self.log_path)}",
                    1,
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (the server drains), SIGKILL after `timeout_s`; returns its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return int(self.process.returncode)
