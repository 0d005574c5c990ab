"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: a bounded
in-memory LRU of the last `DEFAULT_CAPACITY` (a restart forgets them; Codex sends
`store: false` and resends its whole history anyway)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 256


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    # Every input item of the conversation so far, then this response's output items.
    items: list[Any]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        with self._lock:
            self._entries[stored.response["id"]] = stored
            self._entries.move_to_end(stored.response["id"])
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored
