"""A rank that hangs without closing its sockets (stopped, frozen) would block the others
inside a collective forever. Healthy ranks exchange a message at least every step and,
idle, every beat (transport.py), so a watchdog thread on each rank treats
`COMPAT_DISTRIBUTED_WATCHDOG_S` seconds (default 30) without one as a lost group. A
single step longer than that (a huge prefill chunk on a slow machine) would trip it too."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from compat_serve.distributed.transport import PlanLink

log = logging.getLogger("compat_serve")

WATCHDOG_ENV = "COMPAT_DISTRIBUTED_WATCHDOG_S"


def watchdog_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get(WATCHDOG_ENV, "30")))
    except ValueError:
        return 30.0


def start_watchdog(link: PlanLink, on_stuck: Callable[[float], None]) -> threading.Thread:
    """Calls `on_stuck(seconds)` once, from its own thread, when `link` has completed no
    message for the watchdog's time (counted from the first message on)."""
    limit = watchdog_seconds()

    def watch() -> None:
        while True:
            time.sleep(min(1.0, limit / 4))
            if not link.messages:
                continue  # armed by the first message: start-up has no beat yet
            quiet = time.monotonic() - link.last_progress
            if quiet > limit:
                on_stuck(quiet)
                return

    thread = threading.Thread(target=watch, name="compat-distributed-watchdog", daemon=True)
    thread.start()
    return thread
