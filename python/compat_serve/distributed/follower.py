"""A rank other than 0: load its shard, then apply rank 0's step plans until told to stop.
It never binds a port, tokenises or samples."""

from __future__ import annotations

import logging
import os
import time

from compat_serve.distributed.transport import (
    IDLE,
    IDLE_BEAT_S,
    IDLE_MARGIN_S,
    PLAN,
    STOP,
    PlanLink,
)
from compat_serve.distributed.watchdog import start_watchdog
from compat_serve.engine.applier import StepApplier
from compat_serve.engine.kv_quant import KVFormat, check_head_dim
from compat_serve.engine.prefix.shard import ShardPrefix
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.step_plan import PlanError, StepPlan
from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve")


def start_runner(runner: ModelRunner, kv_format: KVFormat) -> None:
    """The forwards `Engine.__init__` runs at start (rank 0 runs them in the same order, so
    the model's collectives pair up): the head dims when K/V is quantized, then the KV
    bytes per token."""
    check_head_dim(runner.head_dims() if kv_format.quantized else [], kv_format)
    runner.measure_kv_bytes_per_token()


def _stuck(link: PlanLink, quiet: float) -> None:
    log.error("rank %d: nothing from rank 0 for %.0fs; exiting", link.rank, quiet)
    os._exit(1)  # the main thread is blocked in a collective


def run_follower(
    loaded: LoadedModel,
    link: PlanLink,
    kv_format: KVFormat,
    prefix: ShardPrefix | None,
) -> int:
    """The follower's whole life, on its loaded shard; its exit status. `prefix`: its
    shard of the prefix cache (None: off)."""
    runner = ModelRunner(loaded, kv_format)
    runner.one_forward_per_eval = True  # as rank 0's (distributed/leader.py)
    start_runner(runner, kv_format)
    applier = StepApplier(runner)
    if prefix is not None:
        prefix.vote = link.vote
    try:
        return _follow(link, applier, prefix)
    finally:
        if prefix is not None:
            prefix.close()  # queued disk writes


def _follow(link: PlanLink, applier: StepApplier, prefix: ShardPrefix | None) -> int:
    start_watchdog(link, lambda quiet: _stuck(link, quiet))
    log.info("rank %d of %d: applying rank 0's step plans", link.rank, link.world_size)
    while True:
        try:
            kind, payload = link.receive()
        except RuntimeError as exc:
            log.error("rank %d: lost rank 0 (%s); exiting", link.rank, exc)
            return 1
        if kind == STOP:
            log.info("rank %d: rank 0 stopped; exiting", link.rank)
            return 0
        if kind == IDLE:
            time.sleep(IDLE_BEAT_S - IDLE_MARGIN_S)
            continue
        if kind != PLAN:
            log.error("rank %d: unknown message kind %d; exiting", link.rank, kind)
            return 1
        try:
            applier.apply(StepPlan.from_bytes(payload), prefix)
        except PlanError as exc:
            log.error("rank %d: out of step with rank 0 (%s); exiting", link.rank, exc)
            return 1
        except RuntimeError as exc:
            log.error("rank %d: a forward failed (%s); exiting", link.rank, exc)
            return 1
