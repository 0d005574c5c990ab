"""Memory sizes given on the command line (bytes, units, or a share of the device's
memory), the device's memory itself, and the one budget weights, live KV, the prefix
cache and a headroom must fit in."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


# ---- the device's memory ------------------------------------------------------------------

# Least served window `--context-length auto` accepts.
MIN_AUTO_CONTEXT = 256
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit_bytes() -> int | None:
    """The container's memory limit (cgroup v2 or v1), None when there is none."""
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            return int(text)
    return None


def gpu_memory_from_info(info: Mapping[str, object]) -> tuple[int, str] | None:
    """The usable memory in `mx.device_info(mx.gpu)`: Metal reports its recommended working
    set (and `memory_size`), CUDA the card's `total_memory` (and `free_memory`); None when
    the dict has neither (the CPU backend, or a GPU-less CUDA build)."""
    for key, source in (
        ("max_recommended_working_set_size", "Metal recommended working set"),
        ("total_memory", "CUDA device memory"),
        ("memory_size", "GPU memory size"),
    ):
        size = info.get(key)
        if isinstance(size, int) and size > 0:
            return size, source
    return None


def device_memory() -> tuple[int, str]:
    """(bytes, where the number comes from) the model may use: on Metal the recommended
    working set, on CUDA the GPU's memory (both from `mx.device_info(mx.gpu)`; CUDA has no
    `memory_size` key, so reading that one fell back to the host's RAM), on the CPU the
    cgroup limit or else physical RAM."""
    import mlx.core as mx

    try:
        if mx.default_device() == mx.gpu:
            found = gpu_memory_from_info(mx.device_info(mx.gpu))
            if found is not None:
                return found
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    ram = physical_memory_bytes()
    limit = cgroup_limit_bytes()
    if limit is not None and limit < ram:
        return limit, "cgroup memory limit"
    return ram, "physical RAM"


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


def weights_nbytes(model: object) -> int:
    """Bytes of a model's parameters as loaded."""
    from mlx.utils import tree_flatten

    parameters = getattr(model, "parameters", None)
    if parameters is None:
        return 0
    flat: Any = tree_flatten(parameters())
    return sum(int(getattr(array, "nbytes", 0)) for _, array in flat)


def collect_memory() -> None:
    """Return freed arrays' memory: Python's references first, then MLX's buffer cache,
    then what the C allocator keeps of it (glibc holds freed heap pages until trimmed; on
    other C libraries there is nothing to call and the step is skipped)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    _trim_c_heap()


def _trim_c_heap() -> None:
    # glibc only (Linux). macOS's allocator hands freed pages back by itself (madvise), and
    # musl has no malloc_trim: elsewhere the step is skipped (docs/platforms.md).
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (AttributeError, OSError):  # not glibc (macOS, musl): nothing to trim
        return
    trim(ctypes.c_size_t(0))
