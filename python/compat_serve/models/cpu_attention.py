"""Prefill attention on the CPU backend, split across two cores.

MLX runs each CPU op on one thread, and on this class of machine its `exp` (the softmax
inside attention) costs ~20 ns per element: at 2k tokens of context a 300-token prefill
chunk spends ~85% of its time there. Query rows of attention are independent, so the
rows are split in two halves and the second half runs on a second MLX CPU stream (its
own thread); the results are concatenated. Same kernel, same arithmetic per row.

With a causal mask the first half attends to the keys up to its own last position
(lower-right aligned, as MLX's `"causal"` mask expects); an explicit mask array is
sliced by rows. Decode and short chunks are not split.

`install_split_attention(model)` replaces mlx-lm's `scaled_dot_product_attention` in
the module that defines the model class (every mlx-lm model module imports it from
`mlx_lm.models.base` by name). Models that call `mx.fast` directly, or use a quantized
KV cache, keep the stock path. `benches/cpu_paths.py` measures both.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from compat_serve.models.cpu_decode_attention import decode_attention

log = logging.getLogger(__name__)

# Split only chunks of at least this many query rows: measured in the model, 512- and
# 300-row chunks at 1-2k tokens of context prefill 1.24-1.52x faster split, while
# 64-row chunks at 2-4k got 7-17% slower (the second stream then competes with
# OpenBLAS's spinning worker threads more than it saves).
MIN_SPLIT_ROWS = 128
_MARK = "_compat_split_attention"
_KERNEL_MARK = "_compat_decode_kernel"
_local = threading.local()


def _stream() -> Any:
    """This thread's second CPU stream (MLX streams belong to the thread that made them)."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.cpu)
    return stream


def _rows(mask: Any, start: int, stop: int, rows: int) -> Any:
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == rows:
        return mask[..., start:stop, :]
    return mask


def split_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, its query rows split over two streams."""
    rows, positions = queries.shape[2], keys.shape[2]
    splittable_mask = mask is None or isinstance(mask, mx.array) or mask == "causal"
    if rows < MIN_SPLIT_ROWS or not splittable_mask:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    half = rows // 2
    first_keys, first_values = keys, values
    if isinstance(mask, str):  # causal: the first half sees keys up to its last row
        visible = positions - (rows - half)
        first_keys, first_values = keys[:, :, :visible], values[:, :, :visible]
    first = mx.fast.scaled_dot_product_attention(
        queries[:, :, :half],
        first_keys,
        first_values,
        scale=scale,
        mask=_rows(mask, 0, half, rows),
        sinks=sinks,
    )
    with mx.stream(_stream()):
        second = mx.fast.scaled_dot_product_attention(
            queries[:, :, half:],
            keys,
            values,
            scale=scale,
            mask=_rows(mask, half, rows, rows),
            sinks=sinks,
        )
    return mx.concatenate([first, second], axis=2)


def _wrap(original: Callable[..., mx.array], decode_kernel: bool) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if hasattr(cache, "bits"):  # quantized KV: mlx-lm's own path
            return original(queries, keys, values, cache, scale, mask, sinks)
        if decode_kernel:
            out = decode_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            if out is not None:
                return out
        return split_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _MARK, original)
    setattr(scaled_dot_product_attention, _KERNEL_MARK, decode_kernel)
    return scaled_dot_product_attention


def install_split_attention(model: Any, *, decode_kernel: bool = False) -> bool:
    """Route the model module's attention through `split_attention` (and, with
    `decode_kernel`, decode steps through `cpu_decode_attention`); False if the model does
    not use mlx-lm's shared function. Patches are per mlx-lm module: once one model asks
    for the decode kernel, every model of that module uses it."""
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if module is None or not callable(current):
        return False
    installed_kernel = getattr(current, _KERNEL_MARK, None)
    if installed_kernel is None or (decode_kernel and not installed_kernel):
        original = getattr(current, _MARK, current)
        wrapped = _wrap(original, decode_kernel)
        module.scaled_dot_product_attention = wrapped  # type: ignore[attr-defined]
        log.debug("attention of %s split across two CPU streams", module.__name__)
    return True
