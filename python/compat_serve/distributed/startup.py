"""The CLI's one call for `--distributed`: join the group, check the layout and that every
rank agrees (all before any weight is read), then load this rank's shard. Rank 0 gets
its model back to serve; the other ranks run the follower loop and return its status."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from compat_serve.distributed.group import agree, fingerprint, join_group
from compat_serve.distributed.layout import LayoutError, check_layout
from compat_serve.distributed.loading import load_sharded, model_dir
from compat_serve.distributed.transport import PlanLink

if TYPE_CHECKING:
    from compat_serve.bootstrap import ServeOptions
    from compat_serve.distributed.leader import Leader
    from compat_serve.engine.engine import Engine
    from compat_serve.models.types import LoadedModel
    from compat_serve.server.state import ServerState

log = logging.getLogger("compat_serve")


def unsupported(options: ServeOptions) -> str | None:
    """The first serve option distributed mode cannot run with yet, as its refusal."""
    mode = options.distributed
    if options.prefix_cache:
        return (
            f"--distributed {mode} needs --no-prefix-cache: prefix-cache blocks are not "
            "mirrored on the other ranks yet"
        )
    if options.speculative != "off":
        return f"--distributed {mode} does not run --speculative {options.speculative} yet"
    return None


@dataclass
class Started:
    link: PlanLink
    mode: str
    loaded: LoadedModel | None = None  # rank 0's shard; None on the other ranks
    follower_exit: int | None = None  # the other ranks' exit status
    leader: Leader | None = None

    def attach(self, engine: Engine) -> None:
        """Rank 0: send every step's plan to the other ranks (`Leader`)."""
        from compat_serve.distributed.leader import Leader

        self.leader = Leader(engine, self.link, self.mode)


def _same_everywhere(options: ServeOptions) -> dict[str, object]:
    """The options every rank must share: all but --model's path, which may differ
    between machines (the model itself is compared by its config and weight files)."""
    same = dataclasses.asdict(options)
    same.pop("model")
    return same


def start_distributed(options: ServeOptions) -> Started:
    """Raises DistributedStartError / LayoutError (ValueErrors, one line) on every rank
    when the group cannot start."""
    mode = options.distributed
    assert mode is not None
    group = join_group()
    problem: str | None = None
    config_bytes = b""
    path: Path | None = None
    try:
        path = model_dir(options.model)
        config_bytes = (path / "config.json").read_bytes()
        check_layout(json.loads(config_bytes), mode, group.size())
        problem = unsupported(options)
    except (LayoutError, OSError, ValueError) as exc:
        problem = str(exc)
    agree(group, fingerprint(_same_everywhere(options), config_bytes, path), problem)
    assert path is not None
    link = PlanLink(group)
    log.info("rank %d of %d (%s parallel): layout checked", link.rank, link.world_size, mode)
    if link.rank != 0:
        from compat_serve.bootstrap import _kv_format
        from compat_serve.distributed.follower import run_follower

        status = run_follower(path, mode, link, _kv_format(options))
        return Started(link, mode, follower_exit=status)
    return Started(link, mode, loaded=load_sharded(path, mode, group))


def serve_distributed(
    options: ServeOptions, build_state: Callable[..., ServerState]
) -> tuple[ServerState | None, int]:
    """Rank 0: its server state, the engine wired to the other ranks. Another rank: None
    and its exit status, once rank 0 stops it (or is lost)."""
    started = start_distributed(options)
    if started.loaded is None:
        return None, started.follower_exit or 0
    state = build_state(options, loaded=started.loaded)
    started.attach(state.engine)
    return state, 0
