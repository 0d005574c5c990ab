"""The CLI's entry for `--distributed`: `RankBuilder.preflight` joins the group and checks
the layout and that every rank agrees (before any weight is read, or any heavy import);
the builder then stands in for `build_state`: it loads this rank's shard, and rank 0 gets
its server state back while the other ranks run the follower loop."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from compat_serve.distributed.group import agree, fingerprint, join_group
from compat_serve.distributed.layout import LayoutError, check_layout
from compat_serve.distributed.loading import load_sharded, model_dir
from compat_serve.distributed.transport import PlanLink

if TYPE_CHECKING:
    from compat_serve.bootstrap import ServeOptions
    from compat_serve.distributed.leader import Leader
    from compat_serve.server.state import ServerState

log = logging.getLogger("compat_serve")


def unsupported(settings: dict[str, Any]) -> str | None:
    """The first serve option distributed mode cannot run with yet, as its refusal."""
    mode = settings["distributed"]
    # ngram speculation is plan ops only (verify, rollback); a draft model would run
    # unsharded on rank 0 and is not tested in distributed mode.
    if settings.get("speculative") == "draft":
        return f"--distributed {mode} does not run --speculative draft yet"
    return None


@dataclass
class Preflight:
    """A joined group whose ranks agree, and the model directory, before any weight."""

    group: mx.distributed.Group
    mode: str
    path: Path


def preflight(settings: dict[str, Any]) -> Preflight:
    """Join the group and check the layout and that every rank was started alike, from
    the serve settings (argparse's names) and config.json alone. Raises
    DistributedStartError / LayoutError (ValueErrors, one line) on every rank when the
    group cannot start. Imports nothing heavy, so a refusal comes at once."""
    mode = settings["distributed"]
    group = join_group()
    problem: str | None = None
    config_bytes = b""
    path: Path | None = None
    try:
        problem = unsupported(settings)
        if problem is None:
            path = model_dir(settings.get("model"))
            config_bytes = (path / "config.json").read_bytes()
            check_layout(json.loads(config_bytes), mode, group.size())
    except (LayoutError, OSError, ValueError) as exc:
        problem = str(exc)
    same = {key: value for key, value in settings.items() if key != "model"}
    agree(group, fingerprint(same, config_bytes, path), problem)
    assert path is not None
    log.info("rank %d of %d (%s parallel): layout checked", group.rank(), group.size(), mode)
    return Preflight(group, mode, path)


class RankBuilder:
    """The CLI's `build_state` in distributed mode: `__call__(options)` loads this rank's
    shard; rank 0 gets its server state, the engine wired to the other ranks (`Leader`);
    another rank runs the follower loop and gets None (its status: `follower_exit`)."""

    def __init__(self, pre: Preflight) -> None:
        self.pre = pre
        self.follower_exit = 0
        self.leader: Leader | None = None

    @classmethod
    def preflight(cls, settings: dict[str, Any]) -> RankBuilder | None:
        """`preflight`, or None with its refusal logged as one line."""
        try:
            return cls(preflight(settings))
        except ValueError as exc:
            log.error("%s", exc)
        except RuntimeError as exc:  # a rank lost during the check
            log.error("--distributed: the group failed during its start-up check: %s", exc)
        return None

    @property
    def lost_rank(self) -> bool:
        return self.leader is not None and self.leader.lost is not None

    def __call__(self, options: ServeOptions) -> ServerState | None:
        from compat_serve.bootstrap import _kv_format, build_state
        from compat_serve.distributed.caching import (
            check_prefix_cache,
            follower_prefix,
            for_this_rank,
        )
        from compat_serve.distributed.follower import run_follower
        from compat_serve.distributed.leader import Leader

        pre = self.pre
        link = PlanLink(pre.group)
        options = for_this_rank(options, pre.mode, link.world_size, link.rank)
        loaded = load_sharded(pre.path, pre.mode, pre.group)
        check_prefix_cache(loaded, options, pre.mode)
        if link.rank != 0:
            prefix = follower_prefix(options, loaded)
            self.follower_exit = run_follower(loaded, link, _kv_format(options), prefix)
            return None
        state = build_state(options, loaded=loaded)
        self.leader = Leader(state.engine, link, pre.mode)
        state.engine.distributed_status = self.leader.status
        return state
