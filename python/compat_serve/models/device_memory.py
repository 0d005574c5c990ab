"""The machine's memory: what the device has for the model (Metal's working set, CUDA's
card, else the cgroup limit or physical RAM), what a loaded model's weights take, and
giving freed memory back."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Mapping
from typing import Any


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
