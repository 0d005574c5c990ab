"""Attention of a decode step on the CPU through compat-kernels (`attention_decode`).

With one query row per request, MLX's CPU attention spends ~0.8 ms per layer at batch 8
mostly on op overhead and its slow `exp`: a third of a decode step's non-matmul time for a
small model. The Rust kernel reads the KV cache in place (the strided view mlx-lm's cache
returns), handles grouped-query heads and the left-padding mask of a batched cache, and
runs the (batch, head) pairs on both cores. A row's result does not depend on the other
rows, so batched decode gives each request the bits it gets alone.

`cpu_attention` routes here before anything else: float32 queries of one position,
keys/values of the same dtype, no attention sinks, and a mask that is absent, `"causal"`
(a no-op for one query row) or a boolean `[batch or 1, 1, 1, positions]` array.
Everything else keeps MLX.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from compat_serve._native import attention_decode
from compat_serve.models.cpu_linear import kernel_output

_converted = threading.local()


def kernel_mask(mask: Any, batch: int) -> tuple[bool, mx.array | None]:
    """(usable, mask as uint8 `[batch, 1, 1, positions]` or None) for the attention kernel.

    A step passes one mask object to every layer: the last conversion is kept, so it runs
    once per step instead of once per layer."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True, None
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4:
        return False, None
    if mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, batch):
        return False, None
    converted: mx.array = once_a_step(
        _converted,
        mask,
        (batch,),
        lambda: mx.broadcast_to(mask, (batch, 1, 1, mask.shape[3])).astype(mx.uint8),
    )
    return True, converted


def once_a_step(
    slot: threading.local, mask: Any, key: tuple[Any, ...], build: Callable[[], Any]
) -> Any:
    """`build()` for this step's `mask` and `key`, kept in `slot` from the step's first
    layer: every layer of a step gets the same mask object, so a conversion runs once a
    step, not once a layer (one slot per kind of conversion, so they do not evict each
    other)."""
    last = getattr(slot, "last", None)
    if last is not None and last[0] is mask and last[1] == key:
        return last[2]
    value = build()
    slot.last = (mask, key, value)
    return value


def decode_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any,
    sinks: mx.array | None,
) -> mx.array | None:
    """The attention output on the kernel, or None when these operands are not its case."""
    batch, _, rows, _ = queries.shape
    if rows != 1 or sinks is not None or keys.ndim != 4:
        return None
    if not queries.dtype == keys.dtype == values.dtype == mx.float32:
        return None
    usable, visible = kernel_mask(mask, batch)
    if not usable or (visible is not None and visible.shape[3] != keys.shape[2]):
        return None
    queries = mx.contiguous(queries)
    operands = (queries, keys, values, visible, float(scale))
    return kernel_output(attention_decode, queries.shape, *operands)
