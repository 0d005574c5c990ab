"""Memory sizes given on the command line (bytes, units, or a share of the device's
memory), and the one budget weights, live KV, the prefix cache and a headroom must fit
in. What the device has is models/device_memory.py's."""

from __future__ import annotations

import re
from dataclasses import dataclass

from compat_serve.models.device_memory import device_memory

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


def parse_memory_size(text: str, *, total: int | None = None) -> int:
    """'30%' (of `total`, default the device's memory: `device_memory`), '4GiB', '512MB',
    '1000000' → bytes."""
    value = text.strip()
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 < share <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
        return int((device_memory()[0] if total is None else total) * share / 100)
    match = _SIZE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 30%, 4GiB, 512MB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return size


# ---- the budget ------------------------------------------------------------------------

# Least served window `--context-length auto` accepts.
MIN_AUTO_CONTEXT = 256


def auto_context_length(model_window: int, kv_capacity_tokens: int) -> int:
    """`--context-length auto`: the model's window, or what one sequence's KV can hold in
    the KV budget if that is less; at least `MIN_AUTO_CONTEXT` or a start-up error."""
    window = min(model_window, kv_capacity_tokens)
    if window < MIN_AUTO_CONTEXT:
        raise ValueError(
            f"--context-length auto: --kv-memory holds only {kv_capacity_tokens} tokens of "
            f"this model's KV; give it room for at least {MIN_AUTO_CONTEXT} tokens (or use "
            "--kv-bits 8 or 4), or pass --context-length as an integer"
        )
    return window


def headroom_bytes(device: int) -> int:
    """Memory left for activations, the allocator's slack and the process itself: a tenth
    of the device, between 512 MiB and 4 GiB."""
    return min(max(device // 10, 512 * 2**20), 4 * 2**30)


@dataclass(frozen=True)
class MemoryBudget:
    """One budget for the device: weights + live KV + prefix cache + headroom must fit."""

    device: int
    source: str
    weights: int
    kv: int
    cache: int
    headroom: int
    # Whether --kv-memory / --cache-memory were given as sizes: then they are memory the
    # user set aside for this model (`reserved`); the default shares of the device are
    # limits the engine fills as requests come, not memory the model holds.
    kv_given: bool = False
    cache_given: bool = False

    @property
    def reserved(self) -> int:
        """KV and prefix-cache bytes set aside on the command line (0 by default)."""
        return (self.kv if self.kv_given else 0) + (self.cache if self.cache_given else 0)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.cache + self.headroom

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / 2**30:.2f} GiB"

        return (
            f"{gib(self.device)} ({self.source}): weights {gib(self.weights)} + live KV "
            f"{gib(self.kv)} + prefix cache {gib(self.cache)} + headroom {gib(self.headroom)}"
            f" = {gib(self.total)}"
        )

    def check(self) -> None:
        if self.total > self.device:
            raise ValueError(
                f"memory budget does not fit the device: {self.describe()}; lower --kv-memory "
                "or --cache-memory (or use --kv-bits 8 to hold the same tokens in less)"
            )


def plan_memory(
    weights: int,
    kv_bytes: int | None,
    cache_bytes: int | None,
    kv_share: float,
    cache_share: float,
    device: tuple[int, str] | None = None,
) -> MemoryBudget:
    """The budget: given sizes as they are, missing ones as shares of what the device has
    left after the weights and the headroom."""
    size, source = device or device_memory()
    headroom = headroom_bytes(size)
    spare = max(size - weights - headroom, 0)
    kv = kv_bytes if kv_bytes is not None else int(spare * kv_share)
    cache = cache_bytes if cache_bytes is not None else int(spare * cache_share)
    return MemoryBudget(
        size,
        source,
        weights,
        kv,
        cache,
        headroom,
        kv_given=kv_bytes is not None,
        cache_given=cache_bytes is not None,
    )
