"""`--dtype auto` that fits: on the CPU, auto dequantizes to float32 (BLAS is fast there),
which makes a 4-bit file about 7x larger (an 8B Q4 file of 4.5 GB would take 32 GB). When
float32 would take more than the memory budget, or half the machine's memory without one,
auto keeps the weights as stored instead, and says so (one log line, `/v1/status`)."""

from __future__ import annotations

from dataclasses import dataclass

from compat_serve.models.weights import resolve_dtype

__all__ = ["AutoChoice", "choose_auto_dtype"]


@dataclass(frozen=True)
class AutoChoice:
    dtype: str | None  # what the loader applies (None/"auto": the backend's rule)
    note: str | None  # why auto kept the weights as stored; None when it did not


def _memory_limit(budget: int | None) -> tuple[int, str]:
    if budget is not None:
        return budget, "the memory budget"
    from compat_serve.models.device_memory import device_memory

    size, source = device_memory()
    return size // 2, f"half the {source}"


def choose_auto_dtype(path: str | None, dtype: str | None, budget: int | None = None) -> AutoChoice:
    """`dtype` as given, unless it is auto on the CPU and float32 would not fit."""
    plan = resolve_dtype(dtype, warn=False)
    if plan.requested != "auto" or plan.dense != "float32":
        return AutoChoice(dtype, None)
    from compat_serve.models.errors import ModelLoadError
    from compat_serve.models.resident_size import estimate_resident_bytes

    try:
        dense = estimate_resident_bytes(path, "float32", plan.backend)
    except (ModelLoadError, OSError):
        # A hub id (its files are not here yet) or a path that is no model: the loader
        # says what is wrong with it, in its own words.
        return AutoChoice(dtype, None)
    limit, what = _memory_limit(budget)
    if dense <= limit:
        return AutoChoice(dtype, None)
    note = (
        f"--dtype auto keeps the weights as stored: float32 would take {dense / 2**30:.2f} "
        f"GiB, more than {what} ({limit / 2**30:.2f} GiB); pass --dtype float32 to "
        "dequantize anyway"
    )
    return AutoChoice("quantized", note)
