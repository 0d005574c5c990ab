"""Rank 0: wires the engine to the plan link so every forward reaches the other ranks
before it runs here."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from compat_serve.distributed.transport import IDLE, IDLE_BEAT_S, PLAN, STOP, PlanLink
from compat_serve.distributed.watchdog import start_watchdog
from compat_serve.engine.engine import Engine
from compat_serve.engine.step_plan import StepPlan

log = logging.getLogger("compat_serve")


class Leader:
    def __init__(self, engine: Engine, link: PlanLink, mode: str) -> None:
        self.link = link
        self.mode = mode
        self.steps = 0
        self.plan_seconds = 0.0  # sending plans, the wait for the other ranks included
        self.lost: str | None = None  # why the group broke (a rank died), once it has
        executor = engine._executor  # the engine thread's executor: the one that plans
        self._applier = executor.applier
        # The settle ops of a step (join, drop, rollback) and aborts go out at its end.
        executor.on_plan = self._send
        executor.batch_prefill = False
        self._applier.runner.one_forward_per_eval = True
        # A forward's ops go out before it runs, so the other ranks join its collectives.
        self._applier.before_forward = self._flush
        if executor.prefix is not None:  # disk entries: served only if every rank has them
            executor.prefix.vote = self._vote
        engine.on_stopped = self.stop
        engine.on_idle = self.idle
        engine.metrics.extra_renderers.append(self.render_metrics)
        start_watchdog(link, self._stuck)

    def _flush(self) -> None:
        plan = self._applier.take_plan()
        if plan is not None:
            self._send(plan)

    def _send(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        self._message(PLAN, plan.to_bytes())
        self.plan_seconds += time.perf_counter() - started
        self.steps += 1

    def _message(self, kind: int, payload: bytes = b"") -> None:
        """Send, or, when a rank is gone, fail this step (the engine thread then ends
        every request with an error) and stop the server so a supervisor can restart the
        group; later sends (the engine's clean-up) do nothing."""
        if self.lost is not None:
            return
        try:
            self.link.send(kind, payload)
        except RuntimeError as exc:
            self._lose(exc)
            raise

    def _lose(self, exc: RuntimeError) -> None:
        self.lost = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        log.error("distributed: lost a rank (%s); ending requests and stopping", self.lost)
        os.kill(os.getpid(), signal.SIGTERM)  # the graceful drain, then exit

    def _vote(self, yes: bool) -> bool:
        """The plan so far (ending with a `Stage` of disk entries), then every rank's
        answer: did it find them."""
        self._flush()
        if self.lost is not None:
            return False
        try:
            return self.link.vote(yes)
        except RuntimeError as exc:
            self._lose(exc)
            raise

    def _stuck(self, quiet: float) -> None:
        """The watchdog: no step or beat completed for `quiet` seconds (a rank hangs).
        The engine thread is blocked in a collective, so: the drain (`/health` 503 at
        once), then exit 3 whatever is still waiting."""
        self.lost = f"no message completed with the other ranks for {quiet:.0f}s"
        log.error("distributed: %s; stopping", self.lost)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the drain's /health 503 and log lines; its engine join would block
        log.error("distributed: the engine is still blocked; exiting")
        os._exit(3)

    def idle(self) -> float:
        """The idle beat (transport.py): the other ranks sleep until the next one."""
        self._message(IDLE)
        return IDLE_BEAT_S

    def stop(self) -> None:
        """Tell the other ranks to exit (the engine thread, after its last plan)."""
        if self.lost is None:
            with contextlib.suppress(RuntimeError):  # a rank already gone: nothing to stop
                self.link.send(STOP)

    def status(self) -> dict[str, object]:
        """/v1/status's `distributed`: the layout, the plan channel's traffic and time,
        and the forwards' time. The model's own collectives run inside each forward's
        lazy graph, so their time is in the forwards' (with the compute and the wait for
        the other ranks), not split out: timing them alone would take an evaluation at
        every collective."""
        link = self.link
        applier = self._applier
        return {
            "mode": self.mode,
            "world_size": link.world_size,
            "rank": link.rank,
            "messages_sent": link.messages,  # plans and idle beats
            "plans_sent": self.steps,
            "plan_bytes_sent": link.bytes_sent,
            "plan_seconds": round(self.plan_seconds, 6),
            "plan_ms_per_plan": round(1000 * self.plan_seconds / max(self.steps, 1), 4),
            "forwards": applier.forwards,
            "forward_seconds": round(applier.forward_seconds, 6),
            "forward_ms_per_forward": round(
                1000 * applier.forward_seconds / max(applier.forwards, 1), 4
            ),
            "lost_rank": self.lost,
        }

    def render_metrics(self) -> list[str]:
        link = self.link
        labels = f'mode="{self.mode}",rank="{link.rank}",world_size="{link.world_size}"'
        return [
            "# HELP compat_distributed_info The distributed layout (value 1).",
            "# TYPE compat_distributed_info gauge",
            f"compat_distributed_info{{{labels}}} 1",
            "# HELP compat_distributed_messages_total Messages rank 0 sent the other ranks "
            "(step plans, idle beats).",
            "# TYPE compat_distributed_messages_total counter",
            f"compat_distributed_messages_total {link.messages}",
            "# HELP compat_distributed_plan_bytes_total Step plan bytes sent.",
            "# TYPE compat_distributed_plan_bytes_total counter",
            f"compat_distributed_plan_bytes_total {link.bytes_sent}",
            "# HELP compat_distributed_plans_total Step plans sent.",
            "# TYPE compat_distributed_plans_total counter",
            f"compat_distributed_plans_total {self.steps}",
            "# HELP compat_distributed_plan_seconds_total Seconds sending step plans (the "
            "collectives, with the wait for the other ranks to join them).",
            "# TYPE compat_distributed_plan_seconds_total counter",
            f"compat_distributed_plan_seconds_total {self.plan_seconds:.6f}",
            "# HELP compat_distributed_forward_seconds_total Seconds in rank 0's forwards "
            "(compute and the model's own collectives, waits included; not the plans).",
            "# TYPE compat_distributed_forward_seconds_total counter",
            f"compat_distributed_forward_seconds_total {self._applier.forward_seconds:.6f}",
            "# HELP compat_distributed_forwards_total Forwards rank 0 ran.",
            "# TYPE compat_distributed_forwards_total counter",
            f"compat_distributed_forwards_total {self._applier.forwards}",
        ]
