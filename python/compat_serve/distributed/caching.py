"""The prefix cache over several ranks: rank 0's engine keeps the index and records every
K/V copy as a step-plan op; each other rank keeps its shard of the blocks
(engine/prefix/shard.py). On disk (`--cache-dir`) every rank writes its own shard under
its own directory, named by the layout, so ranks sharing a directory never collide and a
restart with another mode, world size or rank is a miss, never another shard's K/V."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_lm.models.cache import make_prompt_cache

from compat_serve.engine.prefix.disk import open_disk_tier
from compat_serve.engine.prefix.shard import ShardPrefix
from compat_serve.engine.prefix.store import is_attention_cache

if TYPE_CHECKING:
    from compat_serve.bootstrap import ServeOptions
    from compat_serve.models.types import LoadedModel


def layout_dir(mode: str, world_size: int, rank: int) -> str:
    """This rank's directory under `--cache-dir`."""
    return f"{mode}-{world_size}ranks-rank{rank}"


def for_this_rank(options: ServeOptions, mode: str, world_size: int, rank: int) -> ServeOptions:
    """The options with `--cache-dir` narrowed to this rank's layout directory."""
    if options.cache_dir is None:
        return options
    cache_dir = str(Path(options.cache_dir) / layout_dir(mode, world_size, rank))
    return dataclasses.replace(options, cache_dir=cache_dir)


def check_prefix_cache(loaded: LoadedModel, options: ServeOptions, mode: str) -> None:
    """Refuse what the step plan cannot mirror: the state snapshots of hybrid models
    (every rank runs this on its own shard and comes to the same answer)."""
    if not options.prefix_cache:
        return
    if not all(is_attention_cache(c) for c in make_prompt_cache(loaded.model)):
        raise ValueError(
            f"--distributed {mode}: this model has non-attention layers, whose prefix-cache "
            "snapshots are not mirrored on the other ranks yet; use --no-prefix-cache"
        )


def follower_prefix(options: ServeOptions, loaded: LoadedModel) -> ShardPrefix | None:
    """A follower's shard of the prefix cache, with its own disk tier; None with
    `--no-prefix-cache`. (`options`: already `for_this_rank`.)"""
    from compat_serve.bootstrap import _engine_config

    config = _engine_config(options)
    if not config.prefix_cache:
        return None
    # The fingerprint of this rank's shard: its weights digest differs from rank 0's.
    disk = open_disk_tier(config, loaded)
    return ShardPrefix(config.block_size, disk)
