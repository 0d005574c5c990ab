"""`cache_control` breakpoints as prefix-cache pins (the bookkeeping is Rust's
`PrefixCache.pin`: pinned blocks are evicted only after every unpinned one, in RAM and
in the disk tier).

A request's breakpoints are `(end_token, ttl_seconds)`: the full blocks up to each one
are pinned when the request is admitted (a hit refreshes the pin, read back from disk or
not) and again when it is released (the blocks it computed). Expired pins are dropped at
each admission.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from compat_serve._native import PrefixCache
from compat_serve.engine.prefix.keys import snapshot_key

if TYPE_CHECKING:
    from compat_serve.engine.sequence import Sequence as EngineSequence

# Anthropic's two breakpoint lifetimes; `5m` when `ttl` is absent.
TTL_SECONDS = {"5m": 300, "1h": 3600}
DEFAULT_TTL = "5m"
ONE_HOUR = TTL_SECONDS["1h"]
# OpenAI's `prompt_cache_retention` (chat completions, Responses): the whole prompt is
# pinned; `24h` gets the longest lifetime kept here (1h), `in_memory` the default (5m).
RETENTION_TTL_SECONDS = {"in_memory": TTL_SECONDS[DEFAULT_TTL], "24h": ONE_HOUR}


def retention_breakpoints(retention: str | None, messages: int) -> list[tuple[int, int]]:
    """`prompt_cache_retention` as one breakpoint after all `messages` (none if absent)."""
    if retention is None or messages == 0:
        return []
    return [(messages, RETENTION_TTL_SECONDS[retention])]


DEFAULT_PIN_FRACTION = 0.5


def disk_pins(
    blocks: Sequence[tuple[bytes, float]], *, hybrid: bool, now: float | None = None
) -> dict[str, float]:
    """`PrefixCache.pinned_blocks()` as the disk tier's keys (a block's file, and on a
    hybrid model the state snapshot a hit there needs) and their expiry, in the same
    order; pins expired by `now` (not dropped yet: that happens at admission) hold
    nothing."""
    now = time.time() if now is None else now
    out: dict[str, float] = {}
    for digest, expires_at in blocks:
        if expires_at <= now:
            continue
        out[digest.hex()] = expires_at
        if hybrid:
            out[snapshot_key(digest)] = expires_at
    return out


def pin_request(cache: PrefixCache, seq: EngineSequence, now: float | None = None) -> None:
    """Pins (or refreshes) the blocks `seq` holds up to each of its breakpoints."""
    pins = seq.request.cache_pins
    if not pins:
        return
    cache.pin(seq.request_id, list(pins), time.time() if now is None else now)


def expire_pins(cache: PrefixCache, now: float | None = None) -> None:
    cache.expire_pins(time.time() if now is None else now)


def creation_split(pins: Sequence[tuple[int, int]], start: int, count: int) -> tuple[int, int]:
    """`(5m, 1h)` shares of `count` prompt tokens newly cached from token `start` on:
    the tokens before the last 1-hour breakpoint are 1-hour entries (Anthropic puts
    1-hour breakpoints before 5-minute ones), the rest 5-minute ones."""
    end_1h = max((end for end, ttl in pins if ttl >= ONE_HOUR), default=0)
    one_hour = max(0, min(end_1h, start + count) - start)
    return count - one_hour, one_hour


def pin_table(cache: PrefixCache, now: float | None = None) -> list[dict[str, object]]:
    """The live pins for `/v1/status`: tokens, TTL class and seconds left."""
    now = time.time() if now is None else now
    return [
        {
            "prefix_hash": digest.hex(),
            "tokens": tokens,
            "ttl": "1h" if ttl >= ONE_HOUR else "5m",
            "expires_in_s": round(max(0.0, expires_at - now), 1),
        }
        for digest, tokens, ttl, expires_at in cache.pins()
    ]
