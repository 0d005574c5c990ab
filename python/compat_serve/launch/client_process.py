"""Running the client in the launcher's terminal, with the launcher's signals passed on.

The client inherits stdin, stdout, stderr and the process group, so it is the terminal's
foreground program: its full-screen window works and Ctrl-C reaches it straight from the
terminal. The launcher itself only waits: SIGINT does nothing to it (the client decides
what Ctrl-C means), SIGTERM and SIGHUP are passed on to the client, and the launcher
returns once the client has exited.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from types import FrameType
from typing import Any

FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def exit_code(returncode: int) -> int:
    """A shell's view of the code: 128 + N for a client killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_client(argv: list[str], env: dict[str, str]) -> int:
    started: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []  # signals that came before the client had started

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not started:
            pending.append(signum)
        elif started[0].poll() is None:
            started[0].send_signal(signum)

    def ignore(_signum: int, _frame: FrameType | None) -> None:
        pass

    # Python handlers, not SIG_IGN: exec resets them, so the client starts with the
    # default dispositions (an ignored SIGINT would be inherited).
    handlers: dict[int, Callable[[int, FrameType | None], Any]] = {
        signal.SIGINT: ignore,
        **dict.fromkeys(FORWARDED, forward),
    }
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        started.append(subprocess.Popen(argv, env=env))
        for signum in pending:
            started[0].send_signal(signum)
        return exit_code(started[0].wait())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
