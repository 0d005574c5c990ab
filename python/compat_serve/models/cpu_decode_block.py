"""A llama decoder block's decode step in two Rust calls (CPU), around mlx-lm's KV cache.

After the skinny products (`cpu_linear`) and the decode attention kernel, a batch-8
decode step of the embedded model still spent ~25 ms of ~120 ms evaluating MLX's small
ops between kernel calls (RMS norms, RoPE, residual adds, the attention's reshapes), each
dispatched and synchronised on its own. `compat_serve._native.DecodeBlock` does one
block's step in two calls:

1. `project`: input norm, q/k/v products, rotary embedding at each row's position;
2. the new keys and values go through the block's own mlx-lm cache (`update_and_fetch`,
   the one MLX evaluation left per block, so batching, prefix caching and trimming see an
   ordinary cache);
3. `finish`: attention over the cached keys and values, output product, residual,
   post-attention norm, SwiGLU feed-forward, residual.

`install_fused_decode_blocks(model)` switches the class of each mlx-lm `llama`
`TransformerBlock` whose arithmetic is exactly the one these calls implement: the stock
`__call__` bodies of the block and its attention (checked by source hash, so an mlx-lm
release that changes them falls back to MLX instead of computing something else), plain
`nn.RoPE`, `nn.RMSNorm` norms, bias-free float32 projections already on the skinny
kernel, and the fused SwiGLU feed-forward. Steps with one new position per row, at most
`MAX_KERNEL_ROWS` rows, an unquantized cache and a mask the attention kernel reads take
this path; over a quantized cache (`--kv-bits`) such a step runs the first call, mlx-lm's
quantized attention, then the second call's part after attention (`finish_attended`).
Steps of a few positions per row (a speculative verify: the last token and its drafts; a
short prefill chunk), at most `MAX_KERNEL_ROWS` positions in all, take the same calls with
each position a row of its own: one row's positions attend in the second call, one
query each (so its logits equal that many decode steps bit for bit), several rows'
through the decode attention kernel once per position, a quantized cache's through
mlx-lm's attention. Off this path a width-2 verify of the embedded model cost 2.2 decode
steps, most of it the stock block's small MLX ops. Longer prefill chunks and everything
else run the stock block.

Rows are independent in every call (a request gets the same bits batched or alone).
RoPE angles are computed in float64: MLX computes them in float32, which drifts by up to
~1e-3 at positions in the thousands, so keys written by this path differ from MLX's by
that much at long context (logits at short context agree within 1e-4: tests).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import threading
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.positional_encoding import RoPE
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention

from compat_serve._native import DecodeBlock
from compat_serve.models.cpu_decode_attention import decode_attention, kernel_mask, once_a_step
from compat_serve.models.cpu_linear import MAX_KERNEL_ROWS, SkinnyLinear, fused_swiglu_classes
from compat_serve.models.kernel_perturbation import PERTURB, nudge

log = logging.getLogger(__name__)

# sha256 (first 16 hex digits) of `inspect.getsource` of the stock `__call__` methods this
# path reimplements (mlx-lm 0.32): `TransformerBlock` is `h = x + attn(norm(x)); out = h +
# mlp(norm(h))`; `Attention` is the q/k/v products, RoPE at `cache.offset`,
# `cache.update_and_fetch`, `scaled_dot_product_attention` and the output product.
_STOCK_SOURCES = {
    "TransformerBlock": "937a607a6e7ea3c9",
    "Attention": "3b9b8774b647f7a4",
}


def _source_hash(cls: type) -> str | None:
    call = cls.__dict__.get("__call__")
    try:
        source = inspect.getsource(call) if call is not None else ""
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16] if source else None


def _stock_llama_sources() -> bool:
    """Whether the installed mlx-lm's llama block and attention are the ones reimplemented."""
    return (
        _source_hash(llama.TransformerBlock) == _STOCK_SOURCES["TransformerBlock"]
        and _source_hash(llama.Attention) == _STOCK_SOURCES["Attention"]
    )


def _is_llama_block(module: Any) -> bool:
    return type(module) is llama.TransformerBlock and type(module.self_attn) is llama.Attention


def _kernel_ready(module: Any) -> bool:
    attention = module.self_attn
    projections = [attention.get(name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(p, SkinnyLinear) and "bias" not in p for p in projections):
        return False
    if type(attention.rope) is not RoPE or type(module.mlp) not in fused_swiglu_classes():
        return False
    norms = (module.input_layernorm, module.post_attention_layernorm)
    return all(type(n) is RMSNorm and n.weight.dtype == mx.float32 for n in norms)


def _decode_block(module: Any) -> DecodeBlock:
    attention, mlp, rope = module.self_attn, module.mlp, module.self_attn.rope
    q, k, v, o = (attention[name].weight for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    return DecodeBlock(
        (
            module.input_layernorm.weight,
            float(module.input_layernorm.eps),
            module.post_attention_layernorm.weight,
            float(module.post_attention_layernorm.eps),
        ),
        (q, k, v, o),
        (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight),
        int(attention.head_dim),
        (int(rope.dims), float(rope.base), float(rope.scale), bool(rope.traditional)),
    )


def _positions(offset: Any, rows: int) -> list[int] | None:
    """Each row's position from a cache's `offset` (an int, or one per row when batched)."""
    if isinstance(offset, int):
        return [offset] * rows
    if isinstance(offset, mx.array) and offset.shape == (rows,):
        values: list[int] = offset.tolist()  # type: ignore[assignment]
        return values
    return None


def _fused_call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    rows = x.shape[0]
    positions = None
    one_position = x.ndim == 3 and x.shape[1] == 1 and x.dtype == mx.float32
    plain_cache = cache is not None and not hasattr(cache, "bits")
    if one_position and rows <= MAX_KERNEL_ROWS and cache is not None and not plain_cache:
        return _quantized_step(self, x, mask, cache)
    if _few_positions(x) and cache is not None:
        return _multi_position_step(self, x, mask, cache)
    if one_position and rows <= MAX_KERNEL_ROWS and plain_cache:
        positions = _positions(cache.offset, rows)
    usable, visible = kernel_mask(mask, rows) if positions is not None else (False, None)
    if positions is None or not usable:
        stock: mx.array = llama.TransformerBlock.__call__(self, x, mask, cache)
        return stock
    queries, cached_keys, cached_values = _project(self, x, positions, cache)
    # The new offset too: the next step reads it back as positions (one sync here instead
    # of another there).
    mx.eval(cached_keys, cached_values, cache.offset)
    out = np.empty(x.shape, dtype=np.float32)
    scale = float(self.self_attn.scale)
    self._compat_decode_block.finish(x, queries, cached_keys, cached_values, visible, scale, out)
    if PERTURB:
        nudge(out)
    return mx.array(out)


def _project(
    self: Any, x: mx.array, positions: Any, cache: Any
) -> tuple[np.ndarray, mx.array, mx.array]:
    """The first Rust call (norm, q/k/v, RoPE) on one decode position of every row, the
    new keys and values stored in `cache`: the queries and the cache's keys and values."""
    block: DecodeBlock = self._compat_decode_block
    attention = self.self_attn
    rows = x.shape[0]
    mx.eval(x)
    queries = np.empty((rows, attention.n_heads, 1, attention.head_dim), dtype=np.float32)
    keys = np.empty((rows, attention.n_kv_heads, 1, attention.head_dim), dtype=np.float32)
    values = np.empty_like(keys)
    block.project(x, positions, (queries, keys, values))
    if PERTURB:
        for array in (queries, keys, values):
            nudge(array)
    cached_keys, cached_values = cache.update_and_fetch(mx.array(keys), mx.array(values))
    return queries, cached_keys, cached_values


def _quantized_step(self: Any, x: mx.array, mask: Any, cache: Any) -> mx.array:
    """A decode step over quantized KV (engine/kv_quant.py): the first Rust call (norm,
    q/k/v, RoPE), mlx-lm's quantized attention over the cache's stored arrays (quantized
    matmuls, no dequantized copy), then the second call's output product, norm and
    feed-forward on that attention (`finish_attended`)."""
    rows = x.shape[0]
    positions = _positions(cache.offset, rows)
    if positions is None:
        stock: mx.array = llama.TransformerBlock.__call__(self, x, mask, cache)
        return stock
    attention = self.self_attn
    queries, cached_keys, cached_values = _project(self, x, positions, cache)
    attended = scaled_dot_product_attention(
        mx.array(queries), cached_keys, cached_values, cache, attention.scale, mask
    )
    mx.eval(attended, cache.offset)
    out = np.empty(x.shape, dtype=np.float32)
    self._compat_decode_block.finish_attended(x, attended, out)
    if PERTURB:
        nudge(out)
    return mx.array(out)


def _few_positions(x: mx.array) -> bool:
    """A step of a few new positions per row (a speculative verify, a short chunk): rows
    times positions within the products' kernel."""
    return (
        x.ndim == 3
        and x.shape[1] > 1
        and x.shape[0] * x.shape[1] <= MAX_KERNEL_ROWS
        and x.dtype == mx.float32
    )


def _multi_position_step(self: Any, x: mx.array, mask: Any, cache: Any) -> mx.array:
    """Several new positions per row (a verify's draft tokens) through the same two Rust
    calls as a decode step, each position a row of its own (rows are independent in both
    calls): norm, q/k/v products and RoPE at each position; attention over the cache with
    the mask the model built (one row: inside the second call, a query per position;
    several rows: the decode attention kernel once per position; a quantized cache or a
    mask the kernel cannot read: mlx-lm's attention); then the output product, norm and
    feed-forward. Off this path such a step ran the
    stock block, whose dozens of small MLX ops per block cost about as much again as the
    products: a width-2 verify took 2.2x a decode step on the embedded model."""
    rows, width, hidden = x.shape
    plain_cache = not hasattr(cache, "bits")
    starts = _positions(cache.offset, rows)
    if starts is None:
        stock: mx.array = llama.TransformerBlock.__call__(self, x, mask, cache)
        return stock
    attention = self.self_attn
    heads, kv_heads, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    flat = x.reshape(rows * width, 1, hidden)
    mx.eval(flat)
    queries = np.empty((rows * width, heads, 1, head_dim), dtype=np.float32)
    keys = np.empty((rows * width, kv_heads, 1, head_dim), dtype=np.float32)
    values = np.empty_like(keys)
    positions = [start + j for start in starts for j in range(width)]
    self._compat_decode_block.project(flat, positions, (queries, keys, values))
    if PERTURB:
        for array in (queries, keys, values):
            nudge(array)

    def per_row(array: np.ndarray, count: int) -> mx.array:  # [rows, heads, width, dim]
        return mx.array(array).reshape(rows, width, count, head_dim).transpose(0, 2, 1, 3)

    cached_keys, cached_values = cache.update_and_fetch(
        per_row(keys, kv_heads), per_row(values, kv_heads)
    )
    visible = _one_row_visible(mask, width, cached_keys) if rows == 1 and plain_cache else None
    if visible is not None:  # one row: the decode attention kernel, a query per position
        shape = (width, *cached_keys.shape[1:])
        keys_seen, values_seen = (mx.broadcast_to(a, shape) for a in (cached_keys, cached_values))
        mx.eval(keys_seen, values_seen, visible, cache.offset)
        out = np.empty((width, hidden), dtype=np.float32)
        block: DecodeBlock = self._compat_decode_block
        block.finish(flat, queries, keys_seen, values_seen, visible, attention.scale, out)
        if PERTURB:
            nudge(out)
        return mx.array(out).reshape(rows, width, hidden)
    queries_per_row = per_row(queries, heads)
    attended = None
    if plain_cache:  # several rows: the decode attention kernel once per position
        attended = _per_position_attention(
            queries_per_row, cached_keys, cached_values, mask, attention.scale
        )
    if attended is None:
        attended = scaled_dot_product_attention(
            queries_per_row, cached_keys, cached_values, cache, attention.scale, mask
        )
    attended = attended.transpose(0, 2, 1, 3).reshape(rows * width * heads, head_dim)
    mx.eval(attended, cache.offset)
    out = np.empty((rows * width, hidden), dtype=np.float32)
    self._compat_decode_block.finish_attended(flat, attended, out)
    if PERTURB:
        nudge(out)
    return mx.array(out).reshape(rows, width, hidden)


def _per_position_attention(
    queries: mx.array, keys: mx.array, values: mx.array, mask: Any, scale: float
) -> mx.array | None:
    """`queries` `[rows, heads, width, dim]` over the cached `keys`/`values`, position j of
    every row on the decode attention kernel with row j of the mask (what that position
    sees); None when the mask is not one the kernel reads."""
    rows, _, width, _ = queries.shape
    total = keys.shape[2]

    def masks() -> list[mx.array] | None:  # bool [rows or 1, 1, 1, total] per position
        seen = _seen(mask, rows, width, total)
        return None if seen is None else [seen[:, j].reshape(-1, 1, 1, total) for j in range(width)]

    per_position = once_a_step(_converted, mask, ("rows", rows, width, total), masks)
    if per_position is None:
        return None
    outputs = []
    for j, seen in enumerate(per_position):
        out = decode_attention(
            queries[:, :, j : j + 1], keys, values, scale=scale, mask=seen, sinks=None
        )
        if out is None:
            return None
        outputs.append(out)
    return mx.concatenate(outputs, axis=2)


def _one_row_visible(mask: Any, width: int, keys: mx.array) -> mx.array | None:
    """For one row's `width` new positions over its `keys` (`[1, heads, total, dim]`),
    which cached positions each sees, as the attention kernel reads them (uint8
    `[width, 1, 1, total]`); None for a mask of another kind."""
    total = keys.shape[2]

    def visible() -> mx.array | None:
        seen = _seen(mask, 1, width, total)
        return None if seen is None else seen.reshape(width, 1, 1, total).astype(mx.uint8)

    found: mx.array | None = once_a_step(_converted, mask, ("one row", width, total), visible)
    return found


def _seen(mask: Any, rows: int, width: int, total: int) -> mx.array | None:
    """Boolean `[rows or 1, width, total]`: which cached positions each of `width` new
    positions sees, by the causal rule or the model's boolean mask; None for a mask of
    another kind."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        ends = total - width + mx.arange(width)
        return (mx.arange(total)[None, :] <= ends[:, None])[None]
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4:
        return None
    if mask.shape[0] not in (1, rows) or mask.shape[1] != 1 or mask.shape[2:] != (width, total):
        return None
    return mask[:, 0]


_converted = threading.local()  # the few-position steps' mask conversions


@functools.cache
def _fused_block_class() -> type:
    fused = type("TransformerBlock", (llama.TransformerBlock,), {"__call__": _fused_call})
    fused.__qualname__ = "FusedDecode[llama.TransformerBlock]"
    return fused


def install_fused_decode_blocks(model: Module) -> int:
    """Run decode steps of stock llama blocks in two `DecodeBlock` calls; returns how many
    blocks changed. Call after `install_skinny_linears` (it needs the skinny projections)
    and after the weights are final: the block reads them in place from then on.
    Idempotent."""
    untyped: Any = model
    blocks = [module for _, module in untyped.named_modules() if _is_llama_block(module)]
    if not blocks or not _stock_llama_sources():
        return 0
    changed = 0
    for module in blocks:
        if not _kernel_ready(module):
            continue
        module._compat_decode_block = _decode_block(module)
        module.__class__ = _fused_block_class()
        changed += 1
    log.debug("%d decoder blocks run decode steps fused", changed)
    return changed
