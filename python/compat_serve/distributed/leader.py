"""Rank 0: wires the engine to the plan link so every forward reaches the other ranks
before it runs here."""

from __future__ import annotations

import logging

from compat_serve.distributed.transport import IDLE, IDLE_BEAT_S, PLAN, STOP, PlanLink
from compat_serve.engine.engine import Engine
from compat_serve.engine.step_plan import StepPlan

log = logging.getLogger("compat_serve")


class Leader:
    def __init__(self, engine: Engine, link: PlanLink, mode: str) -> None:
        self.link = link
        self.mode = mode
        self.steps = 0
        executor = engine._executor  # the engine thread's executor: the one that plans
        self._applier = executor.applier
        # The settle ops of a step (join, drop, rollback) and aborts go out at its end.
        executor.on_plan = self._send
        executor.batch_prefill = False
        self._applier.runner.one_forward_per_eval = True
        # A forward's ops go out before it runs, so the other ranks join its collectives.
        self._applier.before_forward = self._flush
        engine.on_stopped = self.stop
        engine.on_idle = self.idle

    def _flush(self) -> None:
        plan = self._applier.take_plan()
        if plan is not None:
            self._send(plan)

    def _send(self, plan: StepPlan) -> None:
        self.link.send(PLAN, plan.to_bytes())
        self.steps += 1

    def idle(self) -> float:
        """The idle beat (transport.py): the other ranks sleep until the next one."""
        self.link.send(IDLE)
        return IDLE_BEAT_S

    def stop(self) -> None:
        """Tell the other ranks to exit (the engine thread, after its last plan)."""
        try:
            self.link.send(STOP)
        except RuntimeError as exc:  # a rank already gone: nothing left to stop
            log.warning("could not stop the other ranks: %s", exc)

    def status(self) -> dict[str, object]:
        link = self.link
        return {
            "mode": self.mode,
            "world_size": link.world_size,
            "rank": link.rank,
            "plans_sent": link.messages,
            "plan_bytes_sent": link.bytes_sent,
            "plan_collective_seconds": round(link.collective_seconds, 6),
        }
