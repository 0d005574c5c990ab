"""A thread-safe snapshot of what the engine is doing, for /v1/status, the dashboard and
logs: the live requests, the last finished ones, and prompt-cache reads per client."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any

# Finished requests kept for the dashboard, and clients whose cache reads are counted
# (the least recently seen client is dropped first).
RECENT_REQUESTS = 100
MAX_CLIENTS = 32


@dataclass
class RequestStatus:
    request_id: str
    phase: str
    prompt_tokens: int
    computed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    # "miss" or "prefix" once admitted (null while waiting for the engine thread).
    cache_hit: str | None = None
    submitted_at: float = 0.0
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    # Speculative decoding: tokens drafted for this request and accepted by the model.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Who sent it (server/clients.py: the client's name and session), for the dashboard.
    client: str | None = None


@dataclass
class ClientReads:
    """Prompt tokens a client sent and how many of them the prefix cache served."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


class StatusBoard:
    """Written by the engine thread, read by HTTP handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, RequestStatus] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self._clients: OrderedDict[str, ClientReads] = OrderedDict()

    def put(self, status: RequestStatus) -> None:
        with self._lock:
            self._live[status.request_id] = status

    def update(self, request_id: str, **fields: Any) -> None:
        with self._lock:
            status = self._live.get(request_id)
            if status is not None:
                for name, value in fields.items():
                    setattr(status, name, value)

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._live.pop(request_id, None)

    def finish(
        self,
        request_id: str,
        outcome: str,
        generated_tokens: int,
        decode_tokens_per_s: float | None,
        now: float | None = None,
    ) -> None:
        """The request ended: it leaves the live rows and joins the recent ones."""
        now = time.monotonic() if now is None else now
        with self._lock:
            status = self._live.pop(request_id, None)
            if status is None:
                return
            row = asdict(status)
            row.update(
                phase="finished",
                outcome=outcome,
                generated_tokens=generated_tokens,
                decode_tokens_per_s=decode_tokens_per_s,
                duration_s=round(now - status.submitted_at, 3),
                finished_at=round(time.time(), 3),
            )
            del row["submitted_at"]
            self._recent.append(row)
            label = status.client or "unknown"
            reads = self._clients.pop(label, None) or ClientReads()
            self._clients[label] = reads  # most recently seen last
            reads.requests += 1
            reads.prompt_tokens += status.prompt_tokens
            reads.cached_tokens += status.cached_tokens
            reads.generated_tokens += generated_tokens
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            rows = [asdict(s) for s in self._live.values()]
        for row in rows:
            row["age_s"] = round(now - row.pop("submitted_at"), 3)
        return rows

    def recent(self) -> list[dict[str, Any]]:
        """Finished requests, oldest first."""
        with self._lock:
            return [dict(row) for row in self._recent]

    def clients(self) -> list[dict[str, Any]]:
        """Prompt-cache reads per client, most recently seen first."""
        with self._lock:
            items = [(label, asdict(reads)) for label, reads in self._clients.items()]
        return [{"client": label, **reads} for label, reads in reversed(items)]
