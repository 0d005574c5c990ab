"""Step plans from rank 0 to the other ranks over MLX collectives.

A message is two `all_sum`s: a header `[kind, length]` (int32), then the payload as
uint8, with every rank but 0 contributing zeros, so the sum is rank 0's bytes. They run
on the CPU stream (a few hundred bytes; the ring backend's collectives are CPU ops), from
the one thread that also runs the forwards, each evaluated before the next.

A rank waiting inside a collective spins (the ring backend polls its sockets: a whole
core while rank 0 is idle). So an idle rank 0 sends IDLE every `IDLE_BEAT_S`, and the
other ranks sleep through most of the beat before they wait again: about
`IDLE_MARGIN_S / IDLE_BEAT_S` of a core while idle, and the first request after an idle
spell waits at most one beat for them.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

PLAN = 1  # a StepPlan's bytes (engine/step_plan.py)
STOP = 2  # rank 0 is shutting down: exit 0
IDLE = 3  # rank 0 has nothing to do: sleep, then wait for the next message

IDLE_BEAT_S = 0.25
IDLE_MARGIN_S = 0.01


class PlanLink:
    """Rank 0's sending end and the other ranks' receiving end of the plan channel."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.messages = 0
        self.bytes_sent = 0
        self.collective_seconds = 0.0  # time inside the plan collectives, all messages
        self.last_progress = time.monotonic()  # when the last message completed (watchdog)

    def _sum(self, values: mx.array) -> mx.array:
        started = time.perf_counter()
        total = mx.distributed.all_sum(values, group=self.group, stream=mx.cpu)
        mx.eval(total)
        self.collective_seconds += time.perf_counter() - started
        return total

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: broadcast one message to every other rank."""
        assert self.rank == 0, "only rank 0 sends plans"
        self._sum(mx.array([kind, len(payload)], dtype=mx.int32))
        if payload:
            self._sum(mx.array(np.frombuffer(payload, dtype=np.uint8)))
        self.messages += 1
        self.bytes_sent += len(payload)
        self.last_progress = time.monotonic()

    def vote(self, yes: bool) -> bool:
        """Every rank: whether all ranks say yes (after a plan that asks, engine/step_plan.py
        `Stage`: rank 0 serves a disk entry only if every rank found its shard of it)."""
        noes = self._sum(mx.array([0 if yes else 1], dtype=mx.int32))
        self.last_progress = time.monotonic()
        return int(np.array(noes)[0]) == 0

    def receive(self) -> tuple[int, bytes]:
        """Another rank: wait for rank 0's next message."""
        header = np.array(self._sum(mx.zeros((2,), dtype=mx.int32)))
        kind, length = int(header[0]), int(header[1])
        payload = b""
        if length:
            payload = bytes(np.array(self._sum(mx.zeros((length,), dtype=mx.uint8))))
        self.messages += 1
        self.last_progress = time.monotonic()
        return kind, payload
