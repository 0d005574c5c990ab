"""Which file the disk tier deletes first past its size cap, with `cache_control` pins.

Unpinned files go first, least recently used first. Pinned ones go only when no unpinned
file is left, or when pinned files alone take more than the pin fraction of the cap
(`--cache-pin-fraction`, as in RAM); then the pin that expires first goes first. The pins
are the RAM side's table (`PrefixCache.pinned_blocks`), asked for at each eviction: the
disk tier keeps no copy, so a restart leaves plain LRU files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Sized(Protocol):
    size: int


def next_victim(index: Mapping[str, Sized], pinned: Mapping[str, float], pin_bytes: float) -> str:
    """The key to delete from `index` (non-empty; least recently used first), given the
    pinned keys and their expiry (`pinned`, in the order to let go of them when they
    expire together) and how many bytes pinned files may take."""
    held = [key for key in pinned if key in index]
    if not held:
        return next(iter(index))
    if sum(index[key].size for key in held) <= pin_bytes:
        unpinned = next((key for key in index if key not in pinned), None)
        if unpinned is not None:
            return unpinned
    # The earliest expiry; `min` keeps the given order among equal ones.
    return min(held, key=pinned.__getitem__)
