"""The server's last log lines, kept in memory for the dashboard (`GET /v1/logs`).

One handler per process, on the `compat_serve` and `uvicorn.error` loggers: it keeps what
those loggers let through at their configured level (INFO under `compat-serve`), so the
dashboard shows the lines the terminal shows, minus uvicorn's access log. The CLI starts
it before the model loads; uvicorn's own lines are kept from the app's startup on.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from functools import cache
from typing import Any

LINES_KEPT = 500
LOGGERS = ("compat_serve", "uvicorn.error")
# Longest message kept per line (a traceback is cut, not dropped).
MAX_MESSAGE_CHARS = 4000


class LogRing(logging.Handler):
    """A bounded buffer of formatted records, each with a sequence number."""

    def __init__(self, capacity: int = LINES_KEPT) -> None:
        super().__init__(logging.NOTSET)
        self._lines: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._numbers = itertools.count(1)
        self._ring_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        line = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": message[:MAX_MESSAGE_CHARS],
        }
        with self._ring_lock:
            line["seq"] = next(self._numbers)
            self._lines.append(line)

    def lines(self, after: int = 0, limit: int = LINES_KEPT) -> list[dict[str, Any]]:
        """Lines numbered above `after`, oldest first, at most the last `limit` of them."""
        with self._ring_lock:
            newer = [line for line in self._lines if line["seq"] > after]
        return newer[-limit:] if limit > 0 else []


@cache
def log_ring() -> LogRing:
    """The process's ring, attached to the server's loggers on first use."""
    ring = LogRing()
    attach_log_ring(ring)
    return ring


def attach_log_ring(ring: LogRing | None = None) -> None:
    """(Re)attach the ring: uvicorn's logging setup, which runs after the app is built,
    replaces the handlers of its loggers, so the app attaches it again at startup.
    Attaching twice is harmless (a logger keeps a handler once)."""
    ring = ring or log_ring()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(ring)
