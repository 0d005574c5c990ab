"""Memory sizes given on the command line: bytes, units, or a share of physical RAM."""

from __future__ import annotations

import os
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_memory_size(text: str, *, total: int | None = None) -> int:
    """'30%' (of `total`, default physical RAM), '4GiB', '512MB', '1000000' → bytes."""
    value = text.strip()
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 < share <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
        return int((physical_memory_bytes() if total is None else total) * share / 100)
    match = _SIZE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 30%, 4GiB, 512MB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return size
