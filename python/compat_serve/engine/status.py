"""A thread-safe snapshot of what the engine is doing, for /v1/status and logs."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any


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


class StatusBoard:
    """Written by the engine thread, read by HTTP handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, RequestStatus] = {}

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

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            rows = [asdict(s) for s in self._live.values()]
        for row in rows:
            row["age_s"] = round(now - row.pop("submitted_at"), 3)
        return rows
